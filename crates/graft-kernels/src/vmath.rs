//! Vectorized `f32` transcendental functions, written once against [`SimdF32`]: `e^x`, the
//! logistic sigmoid and the standard normal CDF, with the errors measured against 30-digit
//! references over every `f32` range they are used on (see the tests below).
//!
//! - [`exp`]: within 1.05 ulp for normal results; overflows to `inf` and underflows through
//!   the subnormals to `0` as `f32::exp` does; NaN stays NaN.
//! - [`sigmoid`]: within 2 ulp.
//! - [`normal_cdf`]: `Phi(x)` within 3.4 ulp (the left tail: the product of three rounded
//!   factors), and `e^(-x^2/2)` within 1.5 ulp, computed without the cancellation that
//!   `(1 + erf(x / sqrt 2)) / 2` suffers for negative `x` (a relative error of 1e-2 at `x = -4.6`
//!   in `f32`).
//!
//! Like every function written against the tokens, these are `#[inline(always)]` so that they
//! compile into each token's entry point.

use crate::simd::SimdF32;

/// `log2(e)`.
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// `ln(2)` split so that `n * LN2_HI` is exact for the `|n| <= 150` used here.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Taylor coefficients `1/k!` of `e^r` for `k = 2..=7` (`|r| <= ln(2)/2`: truncation 5e-9).
const EXP_TAYLOR: [f32; 6] = [
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
];

/// `Phi(-a) e^(a^2/2) (a + K)` for `a >= 0` is the polynomial [`CDF_TAIL`] in
/// `t = (a - K) / (a + K)`: a flat function of a bounded variable (relative error 1.6e-7 as
/// evaluated in `f32`; fitted by weighted least squares, each coefficient rounded to `f32` in
/// turn and the rest refitted).
const K: f32 = 1.5;
const CDF_TAIL: [f32; 12] = [
    0.617_342,
    -0.195_099_44,
    -0.057_495_53,
    0.017_895_715,
    0.017_641_978,
    0.003_993_632,
    -0.002_441_930_1,
    -0.002_726_292_5,
    -0.001_027_936_5,
    2.712_631_8e-4,
    4.572_769e-4,
    1.409_698_7e-4,
];
/// Beyond this `|x|`, `e^(-x^2/2)` is 0 in `f32` (clamping keeps the tail polynomial finite).
const CDF_LIMIT: f32 = 15.0;

/// `(2^f - 1) / f` for `|f| <= 1/2` as a degree-3 polynomial, so that `2^f = 1 + f P(f)` within
/// 2.9e-6 relative as evaluated in `f32` (fitted for the least largest relative error, by
/// iteratively reweighted least squares, coefficients rounded to `f32`): [`exp2_short`].
const EXP2_SHORT: [f32; 4] = [0.693_124_2, 0.240_240_99, 0.055_906_4, 0.009_582_83];

/// [`CDF_TAIL`] with fewer terms, for [`normal_cdf_short`]: `Phi(-a) e^(a^2/2) (a + K)` as a
/// degree-7 polynomial in `t = (a - K) / (a + K)`, relative error 2.9e-6 as evaluated in `f32`
/// over `0 <= a <= 15` (fitted as [`EXP2_SHORT`]).
const CDF_TAIL_SHORT: [f32; 8] = [
    0.617_343,
    -0.195_112_59,
    -0.057_536_013,
    0.018_089_01,
    0.017_938_426,
    0.003_257_052_3,
    -0.003_277_721_8,
    -0.001_767_836_3,
];

/// [`CDF_TAIL_SHORT`] for bf16 results: 6 terms, relative error 7.8e-5 as evaluated in `f32`
/// (0.02 ulp of bf16's 8-bit significand; fitted as [`EXP2_SHORT`]).
const CDF_TAIL_BF16: [f32; 6] = [
    0.617_296_6,
    -0.195_187_45,
    -0.056_450_695,
    0.018_649_451,
    0.014_199_872,
    0.001_525_539_2,
];

/// `c[0] + t (c[1] + t (c[2] + ...))`.
#[inline(always)]
fn horner<S: SimdF32>(s: S, c: &[f32], t: S::V) -> S::V {
    let (last, rest) = c.split_last().expect("a polynomial has coefficients");
    rest.iter()
        .rev()
        .fold(s.splat(*last), |acc, &c| s.fma(acc, t, s.splat(c)))
}

/// `e^x`, lane-wise.
#[inline(always)]
pub(crate) fn exp<S: SimdF32>(s: S, x: S::V) -> S::V {
    // e^-104 rounds to 0 and e^89 to inf: clamping there changes no result. `max`/`min` keep a
    // NaN in their second operand, so NaN lanes stay NaN.
    let x = s.min(s.splat(89.0), s.max(s.splat(-104.0), x));
    let n = s.round(s.mul(x, s.splat(LOG2_E)));
    let r = s.fma(n, s.splat(-LN2_HI), x);
    let r = s.fma(n, s.splat(-LN2_LO), r);
    let p = s.add(
        s.fma(s.mul(r, r), horner(s, &EXP_TAYLOR, r), r),
        s.splat(1.0),
    );
    s.scale(p, n)
}

/// `2^t` for `t <= 0`, lane-wise, within 3.5e-6 relative: for results that are rounded to a
/// 16-bit type (bf16's 8-bit or f16's 11-bit significand) afterwards. `e^x` as `2^(x log2(e))`
/// adds the rounding of that product, `|x| 6e-8` relative. Against [`exp`]'s 1.05 ulp: 4 fused
/// multiply-adds instead of 8 and one range-reduction step instead of two. Subnormal results are computed, `2^-inf = 0`, NaN stays
/// NaN; positive `t` is not supported (no overflow handling).
#[inline(always)]
pub(crate) fn exp2_short<S: SimdF32>(s: S, t: S::V) -> S::V {
    // 2^-150 rounds to 0: clamping there changes no result and keeps `scale`'s exponent in
    // range. `max` keeps a NaN in its second operand.
    exp2_short_clamped(s, s.max(s.splat(-EXP2_MIN), t))
}

/// Below `2^-EXP2_MIN` (half the smallest subnormal) `2^t` rounds to 0 in `f32`.
const EXP2_MIN: f32 = 150.0;

/// [`exp2_short`] of `t` already clamped to `[-EXP2_MIN, 0]` (or NaN).
#[inline(always)]
fn exp2_short_clamped<S: SimdF32>(s: S, t: S::V) -> S::V {
    let n = s.round(t);
    let f = s.sub(t, n);
    let p = s.fma(horner(s, &EXP2_SHORT, f), f, s.splat(1.0));
    s.scale(p, n)
}

/// `1 / (1 + e^-x)`, lane-wise, as `e^x / (1 + e^x)` for negative `x` so that results below
/// `f32::MIN_POSITIVE` come out as the subnormals they are instead of 0. With `short` (a
/// constant where it is inlined), `e^x`
/// comes from [`exp2_short`] (for 16-bit results: within 4e-6 relative plus `|x| 6e-8`), else
/// from [`exp`].
#[inline(always)]
pub(crate) fn sigmoid<S: SimdF32>(s: S, x: S::V, short: bool) -> S::V {
    let (zero, one) = (s.splat(0.0), s.splat(1.0));
    let e = if short {
        exp_neg_abs_short(s, x)
    } else {
        exp(s, s.sub(zero, s.abs(x)))
    };
    s.div(s.select_lt(x, zero, e, one), s.add(one, e))
}

/// `e^-|x|`, lane-wise, as [`exp2_short`] (for 16-bit results): `-|x| log2(e)` rounded once
/// and clamped in [`SimdF32::neg_abs_scaled_min`] (two instructions on AVX-512 with
/// AVX512-DQ instead of three).
#[inline(always)]
pub(crate) fn exp_neg_abs_short<S: SimdF32>(s: S, x: S::V) -> S::V {
    exp2_short_clamped(s, s.neg_abs_scaled_min(x, LOG2_E, EXP2_MIN))
}

/// `(Phi(x), e^(-x^2/2))`, lane-wise: the standard normal CDF and the unnormalised density.
/// `Phi(-a) = e^(-a^2/2) Q(a)` with `a = |x|` and `Phi(a) = 1 - Phi(-a)`: the left tail keeps
/// its relative accuracy (no `1 + erf` cancellation), the right side is at least 1/2.
#[inline(always)]
pub(crate) fn normal_cdf<S: SimdF32>(s: S, x: S::V) -> (S::V, S::V) {
    let a = s.min(s.splat(CDF_LIMIT), s.abs(x));
    // a^2 = h + l exactly, so that e^(-a^2/2) = e^(-h/2) (1 - l/2) keeps its accuracy for large a.
    let h = s.mul(a, a);
    let l = s.fma(a, a, s.sub(s.splat(0.0), h));
    let e_h = exp(s, s.mul(h, s.splat(-0.5)));
    let g = s.fma(e_h, s.mul(l, s.splat(-0.5)), e_h);
    let a_k = s.add(a, s.splat(K));
    let t = s.div(s.sub(a, s.splat(K)), a_k);
    let tail = s.div(s.mul(g, horner(s, &CDF_TAIL, t)), a_k); // Phi(-a)
    (
        s.select_lt(x, s.splat(0.0), tail, s.sub(s.splat(1.0), tail)),
        g,
    )
}

/// [`normal_cdf`] for 16-bit results: `(Phi(x), e^(-x^2/2))` within about 1e-5 relative
/// (measured: see the tests), the left tail included. The same form, cheaper: `e^(-x^2/2)` from
/// [`exp2_short`] without the exact split of `x^2` (`x^2` is exact in `f32` for bf16 and f16
/// inputs, whose significands have at most 11 bits), [`CDF_TAIL_SHORT`] (8 terms instead of
/// 12), and one division: `1 / (a + K)` gives both `t = 1 - 2K / (a + K)` and the tail's factor.
///
/// With `bf16` (a constant where it is inlined), for results rounded to bf16's 8 significant
/// bits: [`CDF_TAIL_BF16`] (6 terms) instead, within about 9e-5 relative.
#[inline(always)]
pub(crate) fn normal_cdf_short<S: SimdF32>(s: S, x: S::V, bf16: bool) -> (S::V, S::V) {
    let one = s.splat(1.0);
    let a = s.min(s.splat(CDF_LIMIT), s.abs(x));
    let g = exp2_short(s, s.mul(s.mul(a, s.splat(-0.5 * LOG2_E)), a));
    let r = s.div(one, s.add(a, s.splat(K)));
    let t = s.fma(r, s.splat(-2.0 * K), one);
    let q = if bf16 {
        horner(s, &CDF_TAIL_BF16, t)
    } else {
        horner(s, &CDF_TAIL_SHORT, t)
    };
    let tail = s.mul(s.mul(g, q), r); // Phi(-a)
    (s.select_lt(x, s.splat(0.0), tail, s.sub(one, tail)), g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::portable::Portable;
    use crate::simd::Lanes;

    /// The distance from `got` to `want` in units of the `f32` spacing at `want`.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w || (got.is_nan() && want.is_nan()) {
            return 0.0;
        }
        let spacing = if w.is_finite() {
            let up = f32::from_bits(w.abs().to_bits() + 1) as f64;
            (up - w.abs() as f64).max(f32::from_bits(1) as f64)
        } else {
            f64::INFINITY
        };
        (got as f64 - want).abs() / spacing
    }

    /// The largest `error(x, f(x))` of `f` (run through the token `s`) over `xs`, and where it
    /// is; a NaN error counts as infinite.
    fn worst_by<S: SimdF32>(
        s: S,
        xs: &[f32],
        f: impl Fn(S, S::V) -> S::V,
        error: impl Fn(f32, f32) -> f64,
    ) -> (f64, f32)
    where
        f32: Lanes<S>,
    {
        let mut worst = (0.0, 0.0);
        let mut out = vec![0.0f32; S::LANES];
        for chunk in xs.chunks_exact(S::LANES) {
            f32::store(s, f(s, f32::load(s, chunk)), &mut out);
            for (&x, &got) in chunk.iter().zip(&out) {
                let e = error(x, got);
                let e = if e.is_nan() { f64::INFINITY } else { e };
                if e > worst.0 {
                    worst = (e, x);
                }
            }
        }
        worst
    }

    /// The largest ulp error of `f` against `reference` over `xs`.
    fn worst<S: SimdF32>(
        s: S,
        xs: &[f32],
        f: impl Fn(S, S::V) -> S::V,
        reference: impl Fn(f64) -> f64,
    ) -> (f64, f32)
    where
        f32: Lanes<S>,
    {
        worst_by(s, xs, f, |x, got| ulps(got, reference(x as f64)))
    }

    fn grid(lo: f32, hi: f32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| lo + (hi - lo) * (i as f32) / (n - 1) as f32)
            .collect()
    }

    fn phi(x: f64) -> f64 {
        0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)
    }

    fn check_token<S: SimdF32>(s: S)
    where
        f32: Lanes<S>,
    {
        let xs = grid(-110.0, 95.0, 400_000);
        let (e, at) = worst(s, &xs, exp, f64::exp);
        assert!(e <= 1.05, "exp: {e} ulp at {at}");
        let specials = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            88.72,
            -87.5,
        ];
        let mut specials = specials.to_vec();
        specials.resize(S::LANES.max(specials.len()).next_multiple_of(S::LANES), 1.0);
        let (e, at) = worst(s, &specials, exp, f64::exp);
        assert!(e <= 1.05, "exp: {e} ulp at {at}");

        let xs = grid(-20.0, 20.0, 400_000);
        let (e, at) = worst(s, &xs, |s, v| normal_cdf(s, v).0, phi);
        assert!(e <= 3.4, "normal_cdf: {e} ulp at {at}");
        let (e, at) = worst(s, &xs, |s, v| normal_cdf(s, v).1, |x| (-0.5 * x * x).exp());
        assert!(e <= 1.5, "e^(-x^2/2): {e} ulp at {at}");
        let (e, at) = worst(s, &specials, |s, v| normal_cdf(s, v).0, phi);
        assert!(e <= 3.4, "normal_cdf: {e} ulp at {at}");

        let xs = grid(-120.0, 120.0, 200_000);
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let (e, at) = worst(s, &xs, |s, v| sigmoid(s, v, false), sig);
        assert!(e <= 2.0, "sigmoid: {e} ulp at {at}");
        let (e, at) = worst(s, &specials, |s, v| sigmoid(s, v, false), sig);
        assert!(e <= 2.0, "sigmoid: {e} ulp at {at}");
    }

    /// The largest relative error of `f` against `reference` over `xs` divided by `bound` at
    /// the same `x` (results below `f32::MIN_POSITIVE` count their absolute error in units of
    /// it; a NaN where the reference is not NaN counts as infinite), and where it is: a value
    /// at most 1 means `f` keeps within `bound` everywhere.
    fn worst_relative<S: SimdF32>(
        s: S,
        xs: &[f32],
        f: impl Fn(S, S::V) -> S::V,
        reference: impl Fn(f64) -> f64,
        bound: impl Fn(f64) -> f64,
    ) -> (f64, f32)
    where
        f32: Lanes<S>,
    {
        worst_by(s, xs, f, |x, got| {
            let want = reference(x as f64);
            if got as f64 == want || (got.is_nan() && want.is_nan()) {
                return 0.0;
            }
            let scale = want.abs().max(f32::MIN_POSITIVE as f64);
            (got as f64 - want).abs() / scale / bound(x as f64)
        })
    }

    /// `v` padded to whole vectors of the token `S`.
    fn padded<S: SimdF32>(mut v: Vec<f32>) -> Vec<f32> {
        v.resize(S::LANES.max(v.len()).next_multiple_of(S::LANES), 1.0);
        v
    }

    /// The short functions for 16-bit results: relative errors against float64 over dense
    /// grids of their whole ranges (the tails, where results go subnormal and underflow to 0,
    /// included), and the special values. Each bound: the polynomial's error plus the rounding
    /// of the scaled argument (`|x| 6e-8` for `e^x`, `x^2 1e-7` for `e^(-x^2/2)`).
    fn check_short_token<S: SimdF32>(s: S)
    where
        f32: Lanes<S>,
    {
        let specials = padded::<S>(vec![
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            -13.0,
            -87.3,
            -88.8,
            88.8,
            -103.3,
            -104.0,
        ]);
        let exp_bound = |x: f64| 3.5e-6 + 6e-8 * x.abs();
        let xs = grid(-110.0, 0.0, 400_000);
        let exp_short = |s: S, v| exp2_short(s, s.mul(v, s.splat(LOG2_E)));
        let (e, at) = worst_relative(s, &xs, exp_short, f64::exp, exp_bound);
        assert!(e <= 1.0, "exp_short: {e} of the bound at {at}");
        let nonpos: Vec<f32> = specials
            .iter()
            .map(|&x| if x > 0.0 { -x } else { x })
            .collect();
        let (e, at) = worst_relative(s, &nonpos, exp_short, f64::exp, exp_bound);
        assert!(e <= 1.0, "exp_short: {e} of the bound at {at}");

        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let sig_bound = |x: f64| 4e-6 + 6e-8 * x.abs();
        let xs = grid(-120.0, 120.0, 400_000);
        let (e, at) = worst_relative(s, &xs, |s, v| sigmoid(s, v, true), sig, sig_bound);
        assert!(e <= 1.0, "sigmoid short: {e} of the bound at {at}");
        let (e, at) = worst_relative(s, &specials, |s, v| sigmoid(s, v, true), sig, sig_bound);
        assert!(e <= 1.0, "sigmoid short: {e} of the bound at {at}");

        // Phi(-14) = 8e-45 is of the order of the smallest f32 subnormal: beyond, the left tail
        // is 0 in f32 as in float64 rounded to f32.
        let cdf_bound = |x: f64| 6e-6 + 1e-7 * x * x;
        let xs = grid(-20.0, 20.0, 400_000);
        let cdf = |s: S, v| normal_cdf_short(s, v, false).0;
        let (e, at) = worst_relative(s, &xs, cdf, phi, cdf_bound);
        assert!(e <= 1.0, "normal_cdf_short: {e} of the bound at {at}");
        let (e, at) = worst_relative(s, &specials, cdf, phi, cdf_bound);
        assert!(e <= 1.0, "normal_cdf_short: {e} of the bound at {at}");
        // The left tail where `0.5 (1 + erf(x / sqrt 2))` cancels: relative, in units of 2^-24.
        let (e, at) = worst_relative(s, &grid(-10.0, -3.0, 200_000), cdf, phi, |_| 2f64.powi(-24));
        eprintln!("normal_cdf_short on [-10, -3]: {e:.0} x 2^-24 relative at {at}");
        assert!(e <= 280.0, "normal_cdf_short: {e} x 2^-24 at {at}");
        let bf16_bound = |x: f64| 9e-5 + 1e-7 * x * x;
        let cdf16 = |s: S, v| normal_cdf_short(s, v, true).0;
        let (e, at) = worst_relative(s, &xs, cdf16, phi, bf16_bound);
        assert!(
            e <= 1.0,
            "normal_cdf_short (bf16): {e} of the bound at {at}"
        );
        let (e, at) = worst_relative(s, &specials, cdf16, phi, bf16_bound);
        assert!(
            e <= 1.0,
            "normal_cdf_short (bf16): {e} of the bound at {at}"
        );
        let g = |x: f64| (-0.5 * x * x).exp();
        let g_bound = |x: f64| 3.2e-6 + 1e-7 * x * x;
        let (e, at) = worst_relative(s, &xs, |s, v| normal_cdf_short(s, v, false).1, g, g_bound);
        assert!(e <= 1.0, "e^(-x^2/2) short: {e} of the bound at {at}");
    }

    #[test]
    fn portable_functions_are_accurate() {
        check_token(Portable);
        check_short_token(Portable);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_functions_are_accurate() {
        use crate::simd::x86::{Avx2, Avx512};
        if let Some(s) = Avx2::detect() {
            check_token(s);
            check_short_token(s);
        }
        if let Some(s) = Avx512::detect() {
            check_token(s);
            check_short_token(s);
        }
    }
}
