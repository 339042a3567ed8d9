//! Element types the kernels accept ([`Float`]) and the types they compute in ([`Acc`]).

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, Sub};

use half::{bf16, f16};

/// Element types the kernels accept; computation happens in `Self::Acc`.
pub trait Float: Copy + Send + Sync + Default + 'static {
    /// The type arithmetic happens in: `f32` for `f32`, `bf16` and `f16`; `f64` for `f64`.
    type Acc: Acc;
    /// Widens to the accumulation type (exact).
    fn to_acc(self) -> Self::Acc;
    /// Narrows from the accumulation type, rounding to nearest even; NaN stays NaN.
    ///
    /// Finite values and infinities round exactly as PyTorch's casts do. NaN becomes a quiet NaN
    /// with the input's sign and leading payload bits (as the `half` crate and F16C do).
    fn from_acc(v: Self::Acc) -> Self;
}

/// The types computation happens in: `f32` or `f64`.
pub trait Acc:
    Float<Acc = Self>
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + AddAssign
    + PartialOrd
    + Debug
{
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
    /// A quiet NaN.
    const NAN: Self;
    /// Square root, correctly rounded.
    fn sqrt(self) -> Self;
    /// `n` converted to `Self`, rounding to nearest (the divisor of a mean).
    fn from_usize(n: usize) -> Self;
}

macro_rules! impl_acc {
    ($t:ty) => {
        impl Float for $t {
            type Acc = $t;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(v: $t) -> $t {
                v
            }
        }

        impl Acc for $t {
            const ZERO: $t = 0.0;
            const ONE: $t = 1.0;
            const NAN: $t = <$t>::NAN;
            #[inline(always)]
            fn sqrt(self) -> $t {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn from_usize(n: usize) -> $t {
                n as $t
            }
        }
    };
}

impl_acc!(f32);
impl_acc!(f64);

impl Float for bf16 {
    type Acc = f32;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

impl Float for f16 {
    type Acc = f32;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(v: f32) -> f16 {
        f16::from_f32(v)
    }
}

/// The math the MoE routing kernels need from the accumulation type (`f32`, `f64`).
pub trait RoutingMath: Acc {
    /// `e^self`.
    fn exp(self) -> Self;
    /// Whether `self` is NaN.
    fn is_nan(self) -> bool;
    /// `v` rounded to `Self` (a scale factor or epsilon given as `f64`).
    fn from_f64(v: f64) -> Self;
}

impl RoutingMath for f32 {
    fn exp(self) -> f32 {
        f32::exp(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
}

impl RoutingMath for f64 {
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn from_f64(v: f64) -> f64 {
        v
    }
}
