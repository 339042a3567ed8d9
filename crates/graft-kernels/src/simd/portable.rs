//! The portable token: arrays of 8 lanes in plain Rust, for any target and any [`Float`].

use super::{Lanes, Simd, SimdF32};
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
    fn sub(self, a: [A; LANES], b: [A; LANES]) -> [A; LANES] {
        std::array::from_fn(|i| a[i] - b[i])
    }
    #[inline(always)]
    fn mul(self, a: [A; LANES], b: [A; LANES]) -> [A; LANES] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    fn div(self, a: [A; LANES], b: [A; LANES]) -> [A; LANES] {
        std::array::from_fn(|i| a[i] / b[i])
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

impl SimdF32 for Portable {
    #[inline(always)]
    fn min(self, a: [f32; LANES], b: [f32; LANES]) -> [f32; LANES] {
        std::array::from_fn(|i| if a[i] < b[i] { a[i] } else { b[i] })
    }
    #[inline(always)]
    fn max(self, a: [f32; LANES], b: [f32; LANES]) -> [f32; LANES] {
        std::array::from_fn(|i| if a[i] > b[i] { a[i] } else { b[i] })
    }
    #[inline(always)]
    fn abs(self, v: [f32; LANES]) -> [f32; LANES] {
        v.map(f32::abs)
    }
    #[inline(always)]
    fn round(self, v: [f32; LANES]) -> [f32; LANES] {
        v.map(f32::round_ties_even)
    }
    #[inline(always)]
    fn scale(self, v: [f32; LANES], n: [f32; LANES]) -> [f32; LANES] {
        std::array::from_fn(|i| {
            // Two factors 2^half and 2^(n - half), each a normal number for n in -150..=128.
            let half = (n[i] * 0.5).round_ties_even();
            v[i] * pow2i(half) * pow2i(n[i] - half)
        })
    }
    #[inline(always)]
    fn fma(self, a: [f32; LANES], b: [f32; LANES], c: [f32; LANES]) -> [f32; LANES] {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    fn select_lt(
        self,
        a: [f32; LANES],
        b: [f32; LANES],
        x: [f32; LANES],
        y: [f32; LANES],
    ) -> [f32; LANES] {
        std::array::from_fn(|i| if a[i] < b[i] { x[i] } else { y[i] })
    }
}

/// `2^n` for an integer `n` in `-126..=127` (`as` saturates, so no lane overflows the exponent
/// arithmetic; other values give unspecified results).
#[inline(always)]
fn pow2i(n: f32) -> f32 {
    f32::from_bits(((n as i32).wrapping_add(127) as u32).wrapping_shl(23))
}
