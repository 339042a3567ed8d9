//! The transcendental functions of the loss and its per-thread scratch, per accumulation type.

use std::cell::RefCell;

use crate::float::Acc;

/// The transcendental functions the rows need, in the accumulation types.
pub trait CeMath: Acc {
    /// `-inf`.
    const NEG_INF: Self;
    /// `e^self` for `self <= 0` (or NaN, which stays NaN). Below the smallest normal result it
    /// returns 0.
    fn exp_nonpos(self) -> Self;
    /// The natural logarithm.
    fn ln(self) -> Self;
    /// `v` rounded to `Self`.
    fn from_f64(v: f64) -> Self;
    /// Runs `f` with `len` values of this thread's scratch (reused between calls).
    fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [Self]) -> R) -> R;
}

thread_local! {
    static SCRATCH_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static SCRATCH_F64: RefCell<Vec<f64>> = const { RefCell::new(Vec::new()) };
}

fn with_scratch_in<A: Copy + Default, R>(
    cell: &RefCell<Vec<A>>,
    len: usize,
    f: impl FnOnce(&mut [A]) -> R,
) -> R {
    let mut v = cell.borrow_mut();
    if v.len() < len {
        v.resize(len, A::default());
    }
    f(&mut v[..len])
}

impl CeMath for f32 {
    const NEG_INF: f32 = f32::NEG_INFINITY;
    /// Cody-Waite reduction `x = k ln2 + r`, `|r| <= ln2 / 2`, a degree-7 minimax polynomial
    /// for `e^r` (Cephes' coefficients, about 1 ulp), and `2^k` built from its bits: no branch
    /// and no call, so loops over it vectorize.
    #[inline(always)]
    fn exp_nonpos(self) -> f32 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        // ln 2 split so that `k * LN2_HI` is exact for |k| < 2^15.
        const LN2_HI: f32 = 0.693_359_4;
        const LN2_LO: f32 = -2.121_944_4e-4;
        // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
        const ROUND: f32 = 12_582_912.0;
        const LO: f32 = -87.0;
        const HI: f32 = 88.0;
        let x = self;
        // NaN stays NaN and produces NaN.
        let xc = x.clamp(LO, HI);
        // `rounded`'s low mantissa bits hold k (ROUND's bits plus k): 2^k is built from them
        // with integer operations, no float-to-int conversion (which would not vectorize).
        let rounded = xc * LOG2E + ROUND;
        let kf = rounded - ROUND;
        let r = (xc - kf * LN2_HI) - kf * LN2_LO;
        let mut p = 1.987_569_2e-4_f32;
        p = p * r + 1.398_199_9e-3;
        p = p * r + 8.333_452e-3;
        p = p * r + 4.166_579_6e-2;
        p = p * r + 1.666_666_5e-1;
        p = p * r + 0.5;
        let er = p * r * r + r + 1.0;
        // k is in [-126, 127] (garbage for NaN, whose `er` is NaN anyway): 2^k is normal.
        let k_biased = rounded
            .to_bits()
            .wrapping_sub(ROUND.to_bits())
            .wrapping_add(127);
        let two_k = f32::from_bits(k_biased << 23);
        let y = er * two_k;
        if x < LO {
            0.0
        } else {
            y
        }
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    #[inline(always)]
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
    fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        SCRATCH_F32.with(|c| with_scratch_in(c, len, f))
    }
}

impl CeMath for f64 {
    const NEG_INF: f64 = f64::NEG_INFINITY;
    #[inline(always)]
    fn exp_nonpos(self) -> f64 {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    #[inline(always)]
    fn from_f64(v: f64) -> f64 {
        v
    }
    fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f64]) -> R) -> R {
        SCRATCH_F64.with(|c| with_scratch_in(c, len, f))
    }
}
