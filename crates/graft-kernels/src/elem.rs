//! How the row kernels of softmax and LayerNorm reach values of each element type: `f32`,
//! `f64` and `bf16` are read and written directly, converted one by one in ways that vectorize
//! ([`Elem`]); `f16` through per-thread panels of `f32` ([`PanelBuffer`]) that the vectorized
//! F16C conversions fill and empty ([`crate::ops::convert::Convert`]).

use half::{bf16, f16};

use crate::exp::VecExp;
use crate::float::{Acc, Float};

/// Accumulation types with a per-thread panel buffer, reused from call to call (so that 16-bit
/// tensors cost no allocation, and no page faults, per task).
pub trait PanelBuffer: Acc {
    /// This thread's buffer, taken out (empty the first time, or while already taken).
    fn take() -> Vec<Self>;
    /// Gives the buffer back for the next task on this thread.
    fn put(buf: Vec<Self>);
}

macro_rules! panel_buffer {
    ($t:ty, $name:ident) => {
        thread_local! {
            static $name: std::cell::Cell<Vec<$t>> = const { std::cell::Cell::new(Vec::new()) };
        }
        impl PanelBuffer for $t {
            fn take() -> Vec<$t> {
                $name.with(std::cell::Cell::take)
            }
            fn put(buf: Vec<$t>) {
                $name.with(|cell| cell.set(buf));
            }
        }
    };
}

panel_buffer!(f32, PANEL_F32);
panel_buffer!(f64, PANEL_F64);

/// `n` values of each of three panels, from this thread's buffer (give it back with
/// [`PanelBuffer::put`]).
pub(crate) fn panels<A: PanelBuffer>(n: usize) -> Vec<A> {
    let mut buf = A::take();
    if buf.len() < 3 * n {
        buf.resize(3 * n, A::ZERO);
    }
    buf
}

/// Values the kernels read and write directly, converted to and from the accumulation type
/// `A` one by one (in ways that vectorize).
pub trait Elem<A>: Copy {
    /// The value in `A` (exact).
    fn get(self) -> A;
    /// `v` rounded to `Self` (as [`Float::from_acc`]).
    fn set(v: A) -> Self;
}

macro_rules! identity_elem {
    ($t:ty) => {
        impl Elem<$t> for $t {
            #[inline(always)]
            fn get(self) -> $t {
                self
            }
            #[inline(always)]
            fn set(v: $t) -> $t {
                v
            }
        }
    };
}

identity_elem!(f32);
identity_elem!(f64);

impl Elem<f32> for bf16 {
    #[inline(always)]
    fn get(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    /// Round to nearest even; a NaN keeps its sign and leading payload and becomes quiet.
    #[inline(always)]
    fn set(v: f32) -> bf16 {
        let u = v.to_bits();
        let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16;
        let nan = (u & 0x7fff_ffff) > 0x7f80_0000;
        bf16::from_bits(if nan { (u >> 16) | 0x40 } else { rounded } as u16)
    }
}

impl Elem<f32> for f16 {
    /// Scalar conversion (correct; the kernels never use it in a loop: f16 goes through panels).
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn set(v: f32) -> f16 {
        f16::from_f32(v)
    }
}

/// The accumulation types, with what the kernels need of them.
pub trait AccType: VecExp + PanelBuffer + Elem<Self> {}
impl<A: VecExp + PanelBuffer + Elem<A>> AccType for A {}

/// Element types the kernels accept.
pub trait DirectFloat: Float<Acc: AccType> + Elem<Self::Acc> {
    /// Whether the kernels go through accumulation-type panels (f16, whose conversions only
    /// vectorize as whole slices) instead of reading and writing the values directly.
    const PANELS: bool;
}

impl DirectFloat for f32 {
    const PANELS: bool = false;
}
impl DirectFloat for f64 {
    const PANELS: bool = false;
}
impl DirectFloat for bf16 {
    const PANELS: bool = false;
}
impl DirectFloat for f16 {
    const PANELS: bool = true;
}
