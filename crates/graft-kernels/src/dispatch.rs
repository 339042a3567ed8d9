//! Picks the compiled kernels for an element type and the current [`Isa`].

use std::any::Any;

use half::{bf16, f16};

use crate::float::Float;
use crate::glu::{self, Activation};
use crate::isa::Isa;
use crate::rope::{self, RopeOperand};
use crate::rows::{self, BackwardRows, ForwardRows};
use crate::simd::portable::Portable;

/// The kernels for element type `T`, compiled for one instruction set.
pub(crate) struct Kernels<T: Float> {
    /// [`rows::forward`] over a block of rows.
    pub forward: fn(ForwardRows<'_, T>),
    /// [`rows::backward`] over a block of rows.
    pub backward: fn(BackwardRows<'_, T>),
    /// [`rows::widen`].
    pub widen: fn(&[T], &mut [T::Acc]),
    /// [`rows::narrow`].
    pub narrow: fn(&[T::Acc], &mut [T]),
    /// [`rows::accumulate`].
    pub accumulate: fn(&mut [T::Acc], &[T::Acc]),
}

impl<T: Float> Clone for Kernels<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Float> Copy for Kernels<T> {}

/// The kernels for `T` and [`Isa::current`]: SIMD ones for `f32`, `f64`, `bf16` and `f16`, the
/// portable ones otherwise.
pub(crate) fn kernels<T: Float>() -> Kernels<T> {
    let isa = Isa::current();
    native::<T, f32>(isa)
        .or_else(|| native::<T, f64>(isa))
        .or_else(|| native::<T, bf16>(isa))
        .or_else(|| native::<T, f16>(isa))
        .unwrap_or_else(portable::<T>)
}

/// `N`'s kernels for `isa` if `T` is `N`.
fn native<T: Float, N: Native>(isa: Isa) -> Option<Kernels<T>> {
    let table = N::kernels(isa);
    (&table as &dyn Any).downcast_ref::<Kernels<T>>().copied()
}

/// The element types with SIMD kernels.
trait Native: Float {
    /// Kernels compiled for `isa` (available on this CPU).
    fn kernels(isa: Isa) -> Kernels<Self>;
}

macro_rules! impl_native {
    ($($t:ty),*) => {$(
        impl Native for $t {
            fn kernels(isa: Isa) -> Kernels<Self> {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => crate::simd::x86::Avx512::kernels(),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => crate::simd::x86::Avx2::kernels(),
                    _ => portable(),
                }
            }
        }
    )*};
}

impl_native!(f32, f64, bf16, f16);

/// The portable kernels, for any `T`.
fn portable<T: Float>() -> Kernels<T> {
    Kernels {
        forward: |rows| rows::forward(Portable, rows),
        backward: |rows| rows::backward(Portable, rows),
        widen: |src, dst| rows::widen(Portable, src, dst),
        narrow: |src, dst| rows::narrow(Portable, src, dst),
        accumulate: |acc, part| rows::accumulate(Portable, acc, part),
    }
}

/// `(act, gate, up, dy, dgate, dup)`: [`glu::backward_lanes`] over one chunk.
type GluBackwardFn<T> = fn(Activation, &[T], &[T], &[T], &mut [T], &mut [T]);

/// The elementwise fused-op kernels for element type `T`, compiled for one instruction set.
pub(crate) struct FusedKernels<T: Float> {
    /// [`glu::forward_lanes`] over one chunk.
    pub glu_forward: fn(Activation, &[T], &[T], &mut [T]),
    /// [`glu::backward_lanes`] over one chunk.
    pub glu_backward: GluBackwardFn<T>,
    /// [`glu::backward_in_place_lanes`] over one chunk: `(act, gate, up, dy)`.
    pub glu_backward_in_place: fn(Activation, &mut [T], &mut [T], &[T]),
    /// [`rope::rows_lanes`] over a block of output rows.
    pub rope: fn(&RopeOperand<'_, T>, bool, usize, &mut [T]),
}

impl<T: Float> Clone for FusedKernels<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Float> Copy for FusedKernels<T> {}

/// The fused-op kernels for `T` and [`Isa::current`]; `None` for element types other than
/// `f32`, `f64`, `bf16` and `f16` (their callers then compute one element at a time).
pub(crate) fn fused_kernels<T: Float>() -> Option<FusedKernels<T>> {
    let isa = Isa::current();
    fused::<T, f32>(isa)
        .or_else(|| fused::<T, f64>(isa))
        .or_else(|| fused::<T, bf16>(isa))
        .or_else(|| fused::<T, f16>(isa))
}

/// `N`'s fused-op kernels for `isa` if `T` is `N`.
fn fused<T: Float, N: NativeFused>(isa: Isa) -> Option<FusedKernels<T>> {
    let table = N::fused_kernels(isa);
    (&table as &dyn Any)
        .downcast_ref::<FusedKernels<T>>()
        .copied()
}

/// The element types with vector fused-op kernels.
trait NativeFused: Float {
    /// Kernels compiled for `isa` (available on this CPU).
    fn fused_kernels(isa: Isa) -> FusedKernels<Self>;
}

macro_rules! impl_native_fused {
    ($($t:ty),*) => {$(
        impl NativeFused for $t {
            fn fused_kernels(isa: Isa) -> FusedKernels<Self> {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 => crate::simd::x86::Avx512::fused_kernels(),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => crate::simd::x86::Avx2::fused_kernels(),
                    _ => FusedKernels {
                        glu_forward: |act, g, u, y| glu::forward_lanes(Portable, act, g, u, y),
                        glu_backward: |act, g, u, dy, dg, du| {
                            glu::backward_lanes(Portable, act, g, u, dy, dg, du)
                        },
                        glu_backward_in_place: |act, g, u, dy| {
                            glu::backward_in_place_lanes(Portable, act, g, u, dy)
                        },
                        rope: |op, bwd, first, out| rope::rows_lanes(Portable, op, bwd, first, out),
                    },
                }
            }
        }
    )*};
}

impl_native_fused!(f32, f64, bf16, f16);
