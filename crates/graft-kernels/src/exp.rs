//! `e^x` written so that loops of it vectorize: range reduction, a polynomial, and the power of
//! two built from the exponent's bits, with no branch and no libm call.
//!
//! Inlined into loops compiled for AVX2 / AVX-512 (the ops' `x86` entry points) with
//! `FMA = true` it becomes about a dozen vector instructions per lane; the portable build uses
//! `FMA = false` (separate multiplies and adds: a fused multiply-add without the instruction is a
//! slow libm call). Accuracy: about 1 ulp for `f32` (Cephes' `expf` polynomial) and 2 ulp for
//! `f64` (Cephes' `exp` Padé form); subnormal results are computed, not flushed;
//! `exp(-inf) = 0`, `exp(+inf) = inf`, `exp(NaN) = NaN` (arguments are clamped to a range whose
//! ends overflow to inf and underflow to 0).
//!
//! Not yet shared: `vmath::exp` (GLU; `f32` only, written against the explicit `SimdF32`
//! tokens) and `cross_entropy`'s `exp_nonpos` (`f32` for arguments <= 0, `f64` through libm)
//! compute the same function. This one covers both widths and both argument signs, so it could
//! serve all three; merging them means re-measuring GLU's and cross-entropy's CPU speed and ulp
//! bounds, which is left to a separate change.

use crate::float::Acc;

/// The accumulation types with a vectorizable [`VecExp::exp`].
pub trait VecExp: Acc + MulAdd {
    /// Negative infinity.
    const NEG_INFINITY: Self;
    /// Positive infinity.
    const INFINITY: Self;
    /// `e^self`, with fused multiply-adds when `FMA` (for code compiled where the instruction
    /// exists).
    fn exp<const FMA: bool>(self) -> Self;
    /// The natural logarithm (libm; called once per row, never in a vector loop).
    fn ln(self) -> Self;
    /// The larger of `self` and `v`; `self` when `v` is NaN (a NaN is not a maximum here:
    /// the sums it enters propagate it).
    #[inline(always)]
    fn max_of(self, v: Self) -> Self {
        if v > self {
            v
        } else {
            self
        }
    }
}

/// `a * b + c`: fused when `FMA`, else two roundings.
#[inline(always)]
fn madd<A: Acc + MulAdd, const FMA: bool>(a: A, b: A, c: A) -> A {
    if FMA {
        a.fused(b, c)
    } else {
        a * b + c
    }
}

/// The fused multiply-add of the accumulation types.
pub trait MulAdd: Copy {
    /// `self * b + c` with one rounding.
    fn fused(self, b: Self, c: Self) -> Self;
}

impl MulAdd for f32 {
    #[inline(always)]
    fn fused(self, b: f32, c: f32) -> f32 {
        self.mul_add(b, c)
    }
}

impl MulAdd for f64 {
    #[inline(always)]
    fn fused(self, b: f64, c: f64) -> f64 {
        self.mul_add(b, c)
    }
}

impl VecExp for f32 {
    const NEG_INFINITY: f32 = f32::NEG_INFINITY;
    const INFINITY: f32 = f32::INFINITY;

    #[inline(always)]
    fn exp<const FMA: bool>(self) -> f32 {
        // Adding 1.5 * 2^23 rounds to an integer (nearest even) held in the low mantissa bits.
        const MAGIC: f32 = 12_582_912.0;
        // ln 2 split so that n * C1 is exact (Cephes).
        const C1: f32 = 0.693_359_4;
        const C2: f32 = -2.121_944_4e-4;
        // e^89 overflows to inf and e^-104 underflows to 0 through the scaling below; a NaN
        // passes both comparisons unchanged.
        let x = if self > 89.0 { 89.0 } else { self };
        let x = if x < -104.0 { -104.0 } else { x };
        let t = madd::<f32, FMA>(x, std::f32::consts::LOG2_E, MAGIC);
        let n = t - MAGIC;
        let r = madd::<_, FMA>(n, -C2, madd::<_, FMA>(n, -C1, x));
        let mut p: f32 = 1.987_569_1e-4;
        p = madd::<f32, FMA>(p, r, 1.398_199_9e-3);
        p = madd::<f32, FMA>(p, r, 8.333_452e-3);
        p = madd::<f32, FMA>(p, r, 4.166_579_6e-2);
        p = madd::<f32, FMA>(p, r, 1.666_666_5e-1);
        p = madd::<f32, FMA>(p, r, 0.5); // Cephes: 5.0000001201e-1, which is 0.5 in f32
        let e = madd::<f32, FMA>(p, r * r, r) + 1.0;
        // 2^n as two normal halves (n lies in [-150, 129]), so subnormal results come out right.
        let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
        let n1 = ni >> 1;
        let n2 = ni - n1;
        let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
        let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
        e * s1 * s2
    }

    fn ln(self) -> f32 {
        f32::ln(self)
    }
}

impl VecExp for f64 {
    const NEG_INFINITY: f64 = f64::NEG_INFINITY;
    const INFINITY: f64 = f64::INFINITY;

    #[inline(always)]
    fn exp<const FMA: bool>(self) -> f64 {
        const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
        const C1: f64 = 6.931_457_519_531_25e-1;
        const C2: f64 = 1.428_606_820_309_417_2e-6;
        const P: [f64; 3] = [
            1.261_771_930_748_105_9e-4,
            3.029_944_077_074_419_6e-2,
            1.0, // Cephes: 9.9999999999999999991e-1, which is 1.0 in f64
        ];
        const Q: [f64; 4] = [
            3.001_985_051_386_644_6e-6,
            2.524_483_403_496_841e-3,
            2.272_655_482_081_550_3e-1,
            2.0,
        ];
        // e^710 overflows to inf and e^-746 underflows to 0 through the scaling below.
        let x = if self > 710.0 { 710.0 } else { self };
        let x = if x < -746.0 { -746.0 } else { x };
        let t = madd::<f64, FMA>(x, std::f64::consts::LOG2_E, MAGIC);
        let n = t - MAGIC;
        let r = madd::<_, FMA>(n, -C2, madd::<_, FMA>(n, -C1, x));
        // Cephes' exp: e^r = 1 + 2 r P(r^2) / (Q(r^2) - r P(r^2)).
        let rr = r * r;
        let px = r * madd::<_, FMA>(madd::<_, FMA>(P[0], rr, P[1]), rr, P[2]);
        let qx = madd::<_, FMA>(
            madd::<_, FMA>(madd::<_, FMA>(Q[0], rr, Q[1]), rr, Q[2]),
            rr,
            Q[3],
        );
        let e = madd::<f64, FMA>(2.0, px / (qx - px), 1.0);
        let ni = (t.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
        let n1 = ni >> 1;
        let n2 = ni - n1;
        let s1 = f64::from_bits(((n1 + 1023) as u64) << 52);
        let s2 = f64::from_bits(((n2 + 1023) as u64) << 52);
        e * s1 * s2
    }

    fn ln(self) -> f64 {
        f64::ln(self)
    }
}

#[cfg(test)]
mod tests {
    use super::VecExp;

    /// `e^x` fused and unfused, checked to agree within an ulp; the fused value.
    #[allow(clippy::eq_op)] // `v != v`: the NaN test, for any `VecExp` type
    fn exp_both<A: VecExp + std::fmt::Debug>(x: A) -> A {
        let (a, b) = (x.exp::<true>(), x.exp::<false>());
        let close = (a == b) || (a != a && b != b) || {
            let d = a - b;
            let d = if d < A::ZERO { A::ZERO - d } else { d };
            d <= a * A::from_usize(1) / A::from_usize(1 << 20)
        };
        assert!(close, "exp({x:?}): fused {a:?}, unfused {b:?}");
        a
    }

    /// Distance in units of the last place between `a` and the correctly rounded `b`.
    fn ulps_f32(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        let ulp = (f32::from_bits(b32.abs().to_bits() + 1) - b32.abs()) as f64;
        ((a as f64) - b).abs() / ulp
    }

    #[test]
    fn f32_exp_is_within_two_ulp_over_the_range() {
        let mut worst = 0.0f64;
        let mut x = -103.9f32;
        while x < 88.7 {
            let want = (x as f64).exp();
            worst = worst.max(ulps_f32(exp_both(x), want));
            x += 0.0137;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn f64_exp_is_accurate_over_the_range() {
        let mut worst = 0.0f64;
        let mut x = -708.0f64;
        while x < 709.0 {
            let got = exp_both(x);
            let want = x.exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.173;
        }
        assert!(worst < 5e-16, "worst relative error {worst}");
    }

    #[test]
    fn special_values() {
        assert_eq!(exp_both(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_both(f32::INFINITY), f32::INFINITY);
        assert!(exp_both(f32::NAN).is_nan());
        assert_eq!(exp_both(0.0f32), 1.0);
        assert_eq!(exp_both(-200.0f32), 0.0);
        assert_eq!(exp_both(100.0f32), f32::INFINITY);
        assert_eq!(exp_both(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp_both(f64::INFINITY), f64::INFINITY);
        assert!(exp_both(f64::NAN).is_nan());
        assert_eq!(exp_both(0.0f64), 1.0);
        // Subnormal results are computed, not flushed.
        let sub = exp_both(-100.0f32);
        assert!(sub > 0.0 && ulps_f32(sub, (-100.0f64).exp()) <= 2.0);
        let sub = exp_both(-740.0f64);
        assert!(sub > 0.0 && ((sub - (-740.0f64).exp()) / (-740.0f64).exp()).abs() < 1e-12);
    }
}
