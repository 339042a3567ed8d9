//! `e^x` written so that loops of it vectorize: range reduction, a polynomial, and the power of
//! two built from the exponent's bits, with no branch and no libm call.
//!
//! Inlined into loops compiled for AVX2 / AVX-512 (simd/x86.rs) it becomes a few vector
//! instructions per lane. Accuracy: about 1 ulp for `f32` (Cephes' `expf` polynomial) and
//! 2 ulp for `f64` (Cephes' `exp` Padé form); subnormal results are computed, not flushed;
//! `exp(-inf) = 0`, `exp(+inf) = inf`, `exp(NaN) = NaN`.

use crate::float::Acc;

/// The accumulation types with a vectorizable [`VecExp::exp`].
pub trait VecExp: Acc {
    /// Negative infinity.
    const NEG_INFINITY: Self;
    /// Positive infinity.
    const INFINITY: Self;
    /// `e^self`.
    fn exp(self) -> Self;
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

impl VecExp for f32 {
    const NEG_INFINITY: f32 = f32::NEG_INFINITY;
    const INFINITY: f32 = f32::INFINITY;

    #[inline(always)]
    fn exp(self) -> f32 {
        const HI: f32 = 88.722_84; // ln(f32::MAX)
        const LO: f32 = -103.972_08; // ln of the smallest subnormal, halved up
        // Adding 1.5 * 2^23 rounds to an integer (nearest even) held in the low mantissa bits.
        const MAGIC: f32 = 12_582_912.0;
        // ln 2 split so that n * C1 is exact (Cephes).
        const C1: f32 = 0.693_359_4;
        const C2: f32 = -2.121_944_4e-4;
        let x = self;
        let xc = if x > 89.0 { 89.0 } else { x };
        let xc = if xc < -104.0 { -104.0 } else { xc };
        let t = xc * std::f32::consts::LOG2_E + MAGIC;
        let n = t - MAGIC;
        let r = (xc - n * C1) - n * C2;
        let mut p = 1.987_569_1e-4;
        p = p * r + 1.398_199_9e-3;
        p = p * r + 8.333_452e-3;
        p = p * r + 4.166_579_6e-2;
        p = p * r + 1.666_666_5e-1;
        p = p * r + 5.000_000_1e-1;
        let e = p * (r * r) + r + 1.0;
        // 2^n as two normal halves (n lies in [-150, 129]), so subnormal results come out right.
        let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
        let n1 = ni >> 1;
        let n2 = ni - n1;
        let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
        let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
        let y = e * s1 * s2;
        let y = if x > HI { f32::INFINITY } else { y };
        if x < LO {
            0.0
        } else {
            y
        }
    }

    fn ln(self) -> f32 {
        f32::ln(self)
    }
}

impl VecExp for f64 {
    const NEG_INFINITY: f64 = f64::NEG_INFINITY;
    const INFINITY: f64 = f64::INFINITY;

    #[inline(always)]
    fn exp(self) -> f64 {
        const HI: f64 = 709.782_712_893_384; // ln(f64::MAX)
        const LO: f64 = -745.133_219_101_941_1; // ln of the smallest subnormal, halved up
        const MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
        const C1: f64 = 6.931_457_519_531_25e-1;
        const C2: f64 = 1.428_606_820_309_417_232_12e-6;
        const P: [f64; 3] = [
            1.261_771_930_748_105_908_78e-4,
            3.029_944_077_074_419_613e-2,
            9.999_999_999_999_999_999_1e-1,
        ];
        const Q: [f64; 4] = [
            3.001_985_051_386_644_550_42e-6,
            2.524_483_403_496_841_041_92e-3,
            2.272_655_482_081_550_287_66e-1,
            2.0,
        ];
        let x = self;
        let xc = if x > 710.0 { 710.0 } else { x };
        let xc = if xc < -746.0 { -746.0 } else { xc };
        let t = xc * std::f64::consts::LOG2_E + MAGIC;
        let n = t - MAGIC;
        let r = (xc - n * C1) - n * C2;
        // Cephes' exp: e^r = 1 + 2 r P(r^2) / (Q(r^2) - r P(r^2)).
        let rr = r * r;
        let px = r * ((P[0] * rr + P[1]) * rr + P[2]);
        let qx = ((Q[0] * rr + Q[1]) * rr + Q[2]) * rr + Q[3];
        let e = 1.0 + 2.0 * (px / (qx - px));
        let ni = (t.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64);
        let n1 = ni >> 1;
        let n2 = ni - n1;
        let s1 = f64::from_bits(((n1 + 1023) as u64) << 52);
        let s2 = f64::from_bits(((n2 + 1023) as u64) << 52);
        let y = e * s1 * s2;
        let y = if x > HI { f64::INFINITY } else { y };
        if x < LO {
            0.0
        } else {
            y
        }
    }

    fn ln(self) -> f64 {
        f64::ln(self)
    }
}

#[cfg(test)]
mod tests {
    use super::VecExp;

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
            worst = worst.max(ulps_f32(VecExp::exp(x), want));
            x += 0.0137;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn f64_exp_is_accurate_over_the_range() {
        let mut worst = 0.0f64;
        let mut x = -708.0f64;
        while x < 709.0 {
            let got = VecExp::exp(x);
            let want = x.exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.173;
        }
        assert!(worst < 5e-16, "worst relative error {worst}");
    }

    #[test]
    fn special_values() {
        assert_eq!(VecExp::exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(VecExp::exp(f32::INFINITY), f32::INFINITY);
        assert!(VecExp::exp(f32::NAN).is_nan());
        assert_eq!(VecExp::exp(0.0f32), 1.0);
        assert_eq!(VecExp::exp(-200.0f32), 0.0);
        assert_eq!(VecExp::exp(100.0f32), f32::INFINITY);
        assert_eq!(VecExp::exp(f64::NEG_INFINITY), 0.0);
        assert_eq!(VecExp::exp(f64::INFINITY), f64::INFINITY);
        assert!(VecExp::exp(f64::NAN).is_nan());
        assert_eq!(VecExp::exp(0.0f64), 1.0);
        // Subnormal results are computed, not flushed.
        let sub = VecExp::exp(-100.0f32);
        assert!(sub > 0.0 && ulps_f32(sub, (-100.0f64).exp()) <= 2.0);
        let sub = VecExp::exp(-740.0f64);
        assert!(sub > 0.0 && ((sub - (-740.0f64).exp()) / (-740.0f64).exp()).abs() < 1e-12);
    }
}
