//! The activations and their derivatives: scalar in the accumulation types ([`GluMath`],
//! [`eval`]) and lane-wise for a token ([`ActLanes`], `f32` through [`crate::vmath`]).

use super::Activation;
use crate::float::{Acc, Float};
use crate::simd::{Lanes, Simd, SimdF32, MAX_LANES};
use crate::vmath;

/// `sqrt(2 / pi)` and the cubic coefficient of the tanh approximation.
const TANH_K0: f64 = 0.797_884_560_802_865_4;
const TANH_K1: f64 = 0.044_715;
/// `1 / sqrt(2 pi)`.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// The transcendental functions the activations need, in the accumulation types (scalar).
pub trait GluMath: Acc {
    /// `e^self`.
    fn exp(self) -> Self;
    /// The complementary error function, `1 - erf(self)`.
    fn erfc(self) -> Self;
    /// `v` rounded to `Self`.
    fn lit(v: f64) -> Self;
}

impl GluMath for f32 {
    #[inline(always)]
    fn exp(self) -> f32 {
        f32::exp(self)
    }
    #[inline(always)]
    fn erfc(self) -> f32 {
        libm::erfcf(self)
    }
    #[inline(always)]
    fn lit(v: f64) -> f32 {
        v as f32
    }
}

impl GluMath for f64 {
    #[inline(always)]
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    #[inline(always)]
    fn erfc(self) -> f64 {
        libm::erfc(self)
    }
    #[inline(always)]
    fn lit(v: f64) -> f64 {
        v
    }
}

/// `1 / (1 + e^-x)`, as `e^x / (1 + e^x)` for negative `x` (no overflow of `e^-x`).
fn sigmoid<A: GluMath>(x: A) -> A {
    if x < A::ZERO {
        let e = x.exp();
        e / (A::ONE + e)
    } else {
        A::ONE / (A::ONE + (A::ZERO - x).exp())
    }
}

/// `(act(x), act'(x))`, one element. `0.5 (1 + tanh(u))` is computed as `sigmoid(2u)` and
/// `0.5 (1 + erf(z))` as `0.5 erfc(-z)`: the same values without the cancellation that
/// `1 + tanh` / `1 + erf` suffer for negative `x`.
#[inline(always)]
pub(super) fn eval<A: GluMath>(act: Activation, x: A) -> (A, A) {
    let one = A::ONE;
    match act {
        Activation::Silu => {
            let s = sigmoid(x);
            (x * s, s * (one + x * (one - s)))
        }
        Activation::GeluTanh => {
            let (k0, k1) = (A::lit(TANH_K0), A::lit(TANH_K1));
            let x2 = x * x;
            let s = sigmoid(A::lit(2.0) * k0 * (x + k1 * x2 * x));
            let ds = A::lit(2.0) * s * (one - s) * k0 * (one + A::lit(3.0) * k1 * x2);
            (x * s, s + x * ds)
        }
        Activation::GeluErf => {
            let cdf = A::lit(0.5) * (A::ZERO - x * A::lit(std::f64::consts::FRAC_1_SQRT_2)).erfc();
            let pdf = A::lit(INV_SQRT_2PI) * (A::lit(-0.5) * x * x).exp();
            (x * cdf, cdf + x * pdf)
        }
    }
}

/// `(act(x), act'(x))` lane-wise, for vectors of `Self` with the token `S`.
pub(super) trait ActLanes<S: Simd<Self>>: Acc {
    /// The activation and its derivative at every lane of `x`, with the accuracy `MATH` (one of
    /// the [`math`] constants; see [`math_for`]).
    fn act<const MATH: u8>(s: S, act: Activation, x: S::V) -> (S::V, S::V);
    /// The activation alone (the forward), as accurate as [`ActLanes::act`]'s.
    #[inline(always)]
    fn value<const MATH: u8>(s: S, act: Activation, x: S::V) -> S::V {
        Self::act::<MATH>(s, act, x).0
    }
}

/// How accurate [`ActLanes::act`]'s `f32` activations must be, by the type they are rounded to.
pub(super) mod math {
    /// `f32` outputs: [`crate::vmath`]'s full-accuracy functions (and `f64`, which always has
    /// libm's).
    pub(crate) const FULL: u8 = 0;
    /// f16 outputs (11 significant bits): the `_short` functions, within about 1e-5 relative.
    pub(crate) const F16: u8 = 1;
    /// bf16 outputs (8 significant bits): as [`F16`], with a shorter normal-CDF tail (8e-5).
    pub(crate) const BF16: u8 = 2;
}

/// The [`math`] for `T`'s outputs: shorter math for elements narrower than the accumulation type
/// (bf16 and f16, computed in `f32`), whose outputs keep within about 1 ulp of the 16-bit type
/// (tests/glu.rs measures them against float64 over every 16-bit gate value); `f32` and `f64`
/// keep the full math.
#[inline(always)]
pub(super) fn math_for<T: Float>() -> u8 {
    use std::any::TypeId;
    if std::mem::size_of::<T>() >= std::mem::size_of::<T::Acc>() {
        math::FULL
    } else if TypeId::of::<T>() == TypeId::of::<half::bf16>() {
        math::BF16
    } else {
        math::F16
    }
}

impl<S: SimdF32> ActLanes<S> for f32 {
    #[inline(always)]
    fn act<const MATH: u8>(s: S, act: Activation, x: S::V) -> (S::V, S::V) {
        let one = s.splat(1.0);
        match act {
            Activation::Silu if MATH != math::FULL => {
                // sigmoid(x) = q for x >= 0 and e q for x < 0, with e = e^-|x|, q = 1 / (1 + e);
                // act' = sg + f (1 - sg).
                let e = vmath::exp_neg_abs_short(s, x);
                let q = s.div(one, s.add(one, e));
                let sg = s.mul_where_lt(x, s.splat(0.0), q, e);
                let f = s.mul(x, sg);
                (f, s.mul_add(f, s.sub(one, sg), sg))
            }
            Activation::Silu => {
                let sg = vmath::sigmoid(s, x, MATH != math::FULL);
                let df = s.mul(sg, s.mul_add(x, s.sub(one, sg), one));
                (s.mul(x, sg), df)
            }
            Activation::GeluTanh => {
                let x2 = s.mul(x, x);
                let k1x2 = s.mul(s.splat(TANH_K1 as f32), x2);
                let u = s.mul(s.splat((2.0 * TANH_K0) as f32), s.mul_add(k1x2, x, x));
                let sg = vmath::sigmoid(s, u, MATH != math::FULL);
                // d/dx sigmoid(u) = sigmoid (1 - sigmoid) 2 k0 (1 + 3 k1 x^2)
                let du = s.mul(
                    s.splat((2.0 * TANH_K0) as f32),
                    s.mul_add(s.splat(3.0), k1x2, one),
                );
                let ds = s.mul(s.mul(sg, s.sub(one, sg)), du);
                (s.mul(x, sg), s.mul_add(x, ds, sg))
            }
            Activation::GeluErf => {
                let (cdf, g) = match MATH {
                    math::FULL => vmath::normal_cdf(s, x),
                    m => vmath::normal_cdf_short(s, x, m == math::BF16),
                };
                let pdf = s.mul(s.splat(INV_SQRT_2PI as f32), g);
                (s.mul(x, cdf), s.mul_add(x, pdf, cdf))
            }
        }
    }

    #[inline(always)]
    fn value<const MATH: u8>(s: S, act: Activation, x: S::V) -> S::V {
        match act {
            Activation::Silu if MATH != math::FULL => {
                // x / (1 + e), times e for x < 0 (e = e^-|x|): no separate sigmoid.
                let one = s.splat(1.0);
                let e = vmath::exp_neg_abs_short(s, x);
                s.mul_where_lt(x, s.splat(0.0), s.div(x, s.add(one, e)), e)
            }
            _ => Self::act::<MATH>(s, act, x).0,
        }
    }
}

impl<S: Simd<f64>> ActLanes<S> for f64
where
    f64: Lanes<S>,
{
    /// Lane by lane with libm: exact to libm's accuracy, as the `f64` reference needs.
    #[inline(always)]
    fn act<const MATH: u8>(s: S, act: Activation, x: S::V) -> (S::V, S::V) {
        let mut lanes = [0.0f64; MAX_LANES];
        f64::store(s, x, &mut lanes[..S::LANES]);
        let mut f = [0.0f64; MAX_LANES];
        let mut df = [0.0f64; MAX_LANES];
        for i in 0..S::LANES {
            (f[i], df[i]) = eval(act, lanes[i]);
        }
        (f64::load(s, &f[..S::LANES]), f64::load(s, &df[..S::LANES]))
    }
}
