//! Picks the compiled kernels for an element type and the current [`Isa`].

use std::any::Any;

use half::{bf16, f16};

use crate::float::Float;
use crate::isa::Isa;
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
