//! The portable token: arrays of 8 lanes in plain Rust, for any target and any [`Float`].

use super::{Lanes, Simd};
use crate::float::{Acc, Float};

/// Lanes per portable vector: enough for the compiler to use whatever vectors the target has.
const LANES: usize = 8;

/// Token of the portable implementation; always available.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Portable;

impl<A: Acc> Simd<A> for Portable {
    type V = [A; LANES];
    const LANES: usize = LANES;

    #[inline(always)]
    fn splat(self, v: A) -> [A; LANES] {
        [v; LANES]
    }
    #[inline(always)]
    fn add(self, a: [A; LANES], b: [A; LANES]) -> [A; LANES] {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    fn mul(self, a: [A; LANES], b: [A; LANES]) -> [A; LANES] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    /// Unfused: a software fused multiply-add would be slow where the target has no FMA.
    #[inline(always)]
    fn mul_add(self, a: [A; LANES], b: [A; LANES], c: [A; LANES]) -> [A; LANES] {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    fn sum(self, v: [A; LANES]) -> A {
        let quads: [A; 4] = std::array::from_fn(|i| v[i] + v[i + 4]);
        (quads[0] + quads[2]) + (quads[1] + quads[3])
    }
}

impl<T: Float> Lanes<Portable> for T {
    #[inline(always)]
    fn load(_: Portable, src: &[T]) -> [T::Acc; LANES] {
        let src = &src[..LANES];
        std::array::from_fn(|i| src[i].to_acc())
    }
    #[inline(always)]
    fn store(_: Portable, v: [T::Acc; LANES], dst: &mut [T]) {
        for (d, v) in dst[..LANES].iter_mut().zip(v) {
            *d = T::from_acc(v);
        }
    }
}
