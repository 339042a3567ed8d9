//! Shared test helpers: a seeded PRNG, f64 references, NaN-aware comparisons, odd `Parallel`s.
#![allow(dead_code)] // each test binary uses a different subset

use std::ops::Range;

use graft_kernels::{Float, Parallel};
use half::{bf16, f16};

/// splitmix64: small, seedable, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }

    /// Roughly normal (a sum of uniforms), scaled.
    pub fn normal(&mut self, scale: f64) -> f64 {
        (self.uniform() + self.uniform() + self.uniform()) * scale
    }
}

/// The element types under test (with their accumulation types also [`Approx`]).
pub trait TestFloat: Approx + Float<Acc: Approx> {}

impl<T: Approx + Float<Acc: Approx>> TestFloat for T {}

/// Exact conversion to f64 and a tolerance.
pub trait Approx: Copy + std::fmt::Debug {
    const NAME: &'static str;
    /// Relative-norm tolerance for values stored in this type.
    const TOL: f64;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

impl Approx for f32 {
    const NAME: &'static str = "f32";
    const TOL: f64 = 1e-6;
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Approx for f64 {
    const NAME: &'static str = "f64";
    const TOL: f64 = 1e-12;
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

impl Approx for bf16 {
    const NAME: &'static str = "bf16";
    const TOL: f64 = 1e-2;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
}

impl Approx for f16 {
    const NAME: &'static str = "f16";
    const TOL: f64 = 2e-3;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}

/// `n` random values of `T` (roughly normal, scale `scale`), never all zero.
pub fn random<T: Approx>(rng: &mut Rng, n: usize, scale: f64) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.normal(scale))).collect()
}

pub fn to_f64<T: Approx>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&v| v.to_f64()).collect()
}

/// A slice of `n` NaNs, to show elements a kernel failed to write.
pub fn poisoned<T: Approx>(n: usize) -> Vec<T> {
    vec![T::from_f64(f64::NAN); n]
}

/// Reference forward in f64: (y, rstd).
pub fn ref_forward(
    x: &[f64],
    rows: usize,
    cols: usize,
    w: Option<&[f64]>,
    eps: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; rows * cols];
    let mut rstd = vec![0.0; rows];
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let mean_sq = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
        rstd[r] = 1.0 / (mean_sq + eps).sqrt();
        for c in 0..cols {
            let scale = w.map_or(1.0, |w| w[c]);
            y[r * cols + c] = row[c] * rstd[r] * scale;
        }
    }
    (y, rstd)
}

/// Reference backward in f64: (dx, dw).
pub fn ref_backward(
    dy: &[f64],
    x: &[f64],
    rstd: &[f64],
    rows: usize,
    cols: usize,
    w: Option<&[f64]>,
) -> (Vec<f64>, Vec<f64>) {
    let mut dx = vec![0.0; rows * cols];
    let mut dw = vec![0.0; cols];
    for r in 0..rows {
        let xhat: Vec<f64> = (0..cols).map(|c| x[r * cols + c] * rstd[r]).collect();
        let g: Vec<f64> = (0..cols)
            .map(|c| dy[r * cols + c] * w.map_or(1.0, |w| w[c]))
            .collect();
        let mean = (0..cols).map(|c| g[c] * xhat[c]).sum::<f64>() / cols as f64;
        for c in 0..cols {
            dx[r * cols + c] = (g[c] - xhat[c] * mean) * rstd[r];
            dw[c] += dy[r * cols + c] * xhat[c];
        }
    }
    (dx, dw)
}

/// The norm of the terms `dx` is the difference of: ||dy * w * rstd||.
pub fn dx_scale(dy: &[f64], rstd: &[f64], cols: usize, w: Option<&[f64]>) -> f64 {
    let sum: f64 = dy
        .iter()
        .enumerate()
        .map(|(i, &d)| (d * w.map_or(1.0, |w| w[i % cols]) * rstd[i / cols]).powi(2))
        .filter(|t| t.is_finite())
        .sum();
    sum.sqrt()
}

/// Asserts `got` matches `want`: NaNs and infinities in the same places, and the finite rest
/// within relative norm `tol` (||got - want|| / ||want||).
pub fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str, ctx: &str) {
    assert_close_scaled(got, want, 0.0, tol, what, ctx);
}

/// [`assert_close`] for a result of cancelling terms of norm `scale`: rounding errors scale with
/// the terms, not the result, so the error is measured against max(||want||, scale).
pub fn assert_close_scaled(got: &[f64], want: &[f64], scale: f64, tol: f64, what: &str, ctx: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length ({ctx})");
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}] = {g}, expected NaN ({ctx})");
        } else if w.is_infinite() {
            assert_eq!(g, w, "{what}[{i}] ({ctx})");
        } else {
            assert!(g.is_finite(), "{what}[{i}] = {g}, expected {w} ({ctx})");
            diff += (g - w) * (g - w);
            norm += w * w;
        }
    }
    let rel = diff.sqrt() / norm.sqrt().max(scale).max(f64::MIN_POSITIVE);
    assert!(
        rel <= tol,
        "{what}: relative error {rel:e} > {tol:e} ({ctx})"
    );
}

/// Runs the ranges in reverse order, each exactly `grain` long (the last takes the remainder):
/// a legal `Parallel` unlike `Serial` and `Threads`.
pub struct ReverseChunks;

impl Parallel for ReverseChunks {
    fn for_range(&self, n: usize, grain: usize, body: &(dyn Fn(Range<usize>) + Sync)) {
        let chunks = (n / grain.max(1)).max(1);
        for i in (0..chunks).rev() {
            let end = if i + 1 == chunks { n } else { (i + 1) * grain };
            body(i * grain..end);
        }
    }
}
