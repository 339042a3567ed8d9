//! The vector abstraction the kernels are written against, and its implementations: the ISA
//! traits and their tokens, a leaf that names no op.
//!
//! A *token* type (`Portable`, `x86::Avx2`, `x86::Avx512`) implements [`Simd`] for the
//! accumulation types; element types implement [`Lanes`] for the tokens they can be loaded with.
//! An x86 token can only be obtained after run-time feature detection succeeds, which is what
//! makes its methods sound; they are `#[inline(always)]` so that they compile, inlined, into the
//! ops' `#[target_feature]` entry points ([`crate::vectorize::x86_entry_points`]).

use crate::float::{Acc, Float};

pub(crate) mod portable;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// The widest vector any token has, in lanes (AVX-512 with `f32`): the size of tail buffers.
pub(crate) const MAX_LANES: usize = 16;

/// Vector arithmetic on lanes of `A`, available through the token `Self`.
pub(crate) trait Simd<A: Acc>: Copy {
    /// A vector of `LANES` values of `A`.
    type V: Copy;
    /// Lanes per vector (at most [`MAX_LANES`]).
    const LANES: usize;
    /// Every lane set to `v`.
    fn splat(self, v: A) -> Self::V;
    /// Lane-wise `a + b`.
    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `a - b`.
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `a * b`.
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `a / b`, correctly rounded.
    fn div(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `a * b + c`, fused (one rounding) where the instruction set has FMA.
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// The sum of the lanes, in a fixed order.
    fn sum(self, v: Self::V) -> A;
    /// Hints that the cache line holding `data[0]` will be read soon. A hint only: it never
    /// faults (also for an empty `data`), and the portable token ignores it.
    #[inline(always)]
    fn prefetch<E>(self, data: &[E]) {
        let _ = data;
    }
}

/// Loading and storing element type `Self` as vectors of `Self::Acc` with the token `S`.
pub(crate) trait Lanes<S>: Float
where
    S: Simd<Self::Acc>,
{
    /// Widens `src[..S::LANES]` for arithmetic. Panics if `src` is shorter.
    ///
    /// Like [`Float::to_acc`], except that a signaling NaN may stay signaling: arithmetic turns
    /// it into the same quiet NaN that `to_acc` gives, so results do not change.
    fn load(s: S, src: &[Self]) -> S::V;
    /// Widens `src[..S::LANES]` exactly as [`Float::to_acc`] (for conversions).
    #[inline(always)]
    fn load_exact(s: S, src: &[Self]) -> S::V {
        Self::load(s, src)
    }
    /// Narrows `v` into `dst[..S::LANES]` (rounding as [`Float::from_acc`]). Panics if `dst` is
    /// shorter.
    fn store(s: S, v: S::V, dst: &mut [Self]);
    /// Widens `src[..2 * S::LANES]` into two vectors whose lanes hold those elements in an
    /// order of the token's choosing, which [`Lanes::store_pair`] undoes: for elementwise
    /// kernels, where every operand is loaded the same way and lane order does not matter.
    /// By default the two halves in order. Panics if `src` is shorter.
    #[inline(always)]
    fn load_pair(s: S, src: &[Self]) -> (S::V, S::V) {
        (Self::load(s, src), Self::load(s, &src[S::LANES..]))
    }
    /// Narrows two vectors in [`Lanes::load_pair`]'s lane order into `dst[..2 * S::LANES]`
    /// (rounding as [`Lanes::store`]). Panics if `dst` is shorter.
    #[inline(always)]
    fn store_pair(s: S, v: (S::V, S::V), dst: &mut [Self]) {
        Self::store(s, v.0, dst);
        Self::store(s, v.1, &mut dst[S::LANES..]);
    }
    /// `v` rounded to `Self` and widened back: what `.to(dtype)` then arithmetic in `Self::Acc`
    /// sees. The accumulation types override it with the identity.
    #[inline(always)]
    fn round(s: S, v: S::V) -> S::V {
        let mut buf = [Self::default(); MAX_LANES];
        Self::store(s, v, &mut buf);
        Self::load(s, &buf)
    }
}

/// Loads fewer than `S::LANES` elements; the missing lanes read as zero.
#[inline(always)]
pub(crate) fn load_part<S, T>(s: S, src: &[T]) -> S::V
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    let mut buf = [T::default(); MAX_LANES];
    buf[..src.len()].copy_from_slice(src);
    T::load(s, &buf)
}

/// [`Lanes::load_exact`] of fewer than `S::LANES` elements; the missing lanes read as zero.
#[inline(always)]
pub(crate) fn load_exact_part<S, T>(s: S, src: &[T]) -> S::V
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    let mut buf = [T::default(); MAX_LANES];
    buf[..src.len()].copy_from_slice(src);
    T::load_exact(s, &buf)
}

/// Stores the first `dst.len()` (fewer than `S::LANES`) lanes of `v`.
#[inline(always)]
pub(crate) fn store_part<S, T>(s: S, v: S::V, dst: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    let mut buf = [T::default(); MAX_LANES];
    T::store(s, v, &mut buf);
    dst.copy_from_slice(&buf[..dst.len()]);
}

/// The `f32` lane operations that vectorized transcendental functions ([`crate::vmath`]) are
/// built from, beyond [`Simd`]'s arithmetic.
pub(crate) trait SimdF32: Simd<f32> {
    /// Lane-wise `if a < b { a } else { b }`: a NaN in `b` (or in both) gives `b`.
    fn min(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `if a > b { a } else { b }`: a NaN in `b` (or in both) gives `b`.
    fn max(self, a: Self::V, b: Self::V) -> Self::V;
    /// Lane-wise `|v|`.
    fn abs(self, v: Self::V) -> Self::V;
    /// Lanes rounded to the nearest integer, ties to even.
    fn round(self, v: Self::V) -> Self::V;
    /// `v * 2^n` for lanes of `n` holding integers in `-150..=128`: exact, except for one
    /// rounding when the result is subnormal, and `inf` when it overflows.
    fn scale(self, v: Self::V, n: Self::V) -> Self::V;
    /// Lane-wise `a * b + c` with one rounding, on every instruction set.
    fn fma(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Lane-wise `if a < b { x } else { y }`.
    fn select_lt(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V;
    /// Lane-wise `if a < b { x * y } else { x }` (AVX-512: one masked multiplication).
    #[inline(always)]
    fn mul_where_lt(self, a: Self::V, b: Self::V, x: Self::V, y: Self::V) -> Self::V {
        self.select_lt(a, b, self.mul(x, y), x)
    }
    /// Lane-wise `max(-limit, -|v| * scale)` for positive `scale` and `limit`, which is
    /// `-min(|v * scale|, limit)`; NaN stays NaN (AVX-512 with AVX512-DQ: a multiplication and
    /// one `vrangeps`).
    #[inline(always)]
    fn neg_abs_scaled_min(self, v: Self::V, scale: f32, limit: f32) -> Self::V {
        // `max` keeps a NaN in its second operand.
        self.max(
            self.splat(-limit),
            self.mul(self.abs(v), self.splat(-scale)),
        )
    }
}
