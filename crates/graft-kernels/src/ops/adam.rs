//! Adam and AdamW steps over contiguous buffers, rounded exactly as ATen's fused CPU kernel
//! (`aten::_fused_adam_` / `aten::_fused_adamw_`, x86-64 with AVX2 and FMA) rounds them.
//!
//! ATen computes the bias corrections in `f64`, then every element in the accumulation type
//! (`f32` for `f32`, `bf16`, `f16`; `f64` for `f64`). Its vector loop (256-bit vectors) and its
//! scalar loop (the last `len % lanes` elements of a buffer) contract different products into
//! fused multiply-adds, so the two give different bits for `exp_avg_sq`; both are reproduced
//! here, split at the same index.

use crate::blocks;
use crate::float::{Acc, Float};
#[cfg(target_arch = "x86_64")]
use crate::isa::Isa;
use crate::ops::convert::Convert;
use crate::parallel::Parallel;

/// Which update: Adam (L2 penalty added to the gradient) or AdamW (decoupled weight decay).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// `grad += weight_decay * param` before the moments.
    Adam,
    /// `param *= 1 - lr * weight_decay` before the update.
    AdamW,
}

/// The hyper-parameters of one step, as the aten operators receive them.
#[derive(Clone, Copy, Debug)]
pub struct Hyper {
    /// Adam or AdamW.
    pub mode: Mode,
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Weight decay (0 for none).
    pub weight_decay: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Whether to ascend instead of descend.
    pub maximize: bool,
    /// Gradients are divided by this (and stored back unscaled) when given (AMP).
    pub grad_scale: Option<f32>,
}

/// One parameter's buffers, all of the same length, updated in place.
#[derive(Debug)]
pub struct Buffers<'a, T> {
    /// The parameter.
    pub param: &'a mut [T],
    /// Its gradient (written only when [`Hyper::grad_scale`] is given).
    pub grad: &'a mut [T],
    /// First moment.
    pub exp_avg: &'a mut [T],
    /// Second moment.
    pub exp_avg_sq: &'a mut [T],
    /// Running maximum of the second moment (AMSGrad), if used.
    pub max_exp_avg_sq: Option<&'a mut [T]>,
}

/// The arithmetic of the accumulation types that the step needs.
pub trait AdamMath: Acc {
    /// `self * b + c` with one rounding.
    fn fma(self, b: Self, c: Self) -> Self;
    /// `v` rounded to `Self`.
    fn lit(v: f64) -> Self;
    /// The absolute value.
    fn abs(self) -> Self;
}

impl AdamMath for f32 {
    #[inline(always)]
    fn fma(self, b: f32, c: f32) -> f32 {
        self.mul_add(b, c)
    }
    #[inline(always)]
    fn lit(v: f64) -> f32 {
        v as f32
    }
    #[inline(always)]
    fn abs(self) -> f32 {
        f32::abs(self)
    }
}

impl AdamMath for f64 {
    #[inline(always)]
    fn fma(self, b: f64, c: f64) -> f64 {
        self.mul_add(b, c)
    }
    #[inline(always)]
    fn lit(v: f64) -> f64 {
        v
    }
    #[inline(always)]
    fn abs(self) -> f64 {
        f64::abs(self)
    }
}

/// Element types the step accepts.
pub trait AdamFloat: Float<Acc: AdamMath> {}
impl<T: Float<Acc: AdamMath>> AdamFloat for T {}

/// Elements per work item handed to the parallel-for (a multiple of every lane count).
const CHUNK: usize = 1 << 14;

/// Elements per ATen vector of `T` (256 bits): the loop tail is `len % lanes::<T>()` long.
pub const fn lanes<T>() -> usize {
    32 / std::mem::size_of::<T>()
}

/// The per-step constants, in the accumulation type, computed as ATen computes them.
#[derive(Clone, Copy, Debug)]
struct Coeffs<A> {
    grad_scale: A,
    sign: A,
    weight_decay: A,
    decay: A,
    lerp_coeff: A,
    lerp_small: bool,
    beta2: A,
    sq_coeff: A,
    bc2_sqrt: A,
    eps: A,
    neg_step_size: A,
    /// Adam with a weight decay: `grad += weight_decay * param`.
    adam_decay: bool,
    /// A grad scale was given: the unscaled gradient is stored back.
    store_grad: bool,
}

impl<A: AdamMath> Coeffs<A> {
    fn new(h: &Hyper, step: f64) -> Coeffs<A> {
        // In f64 like ATen ("to align with non-fused adam"), rounded where ATen rounds them.
        let bias_correction1 = 1.0 - h.beta1.powf(step);
        let bias_correction2 = 1.0 - h.beta2.powf(step);
        let lerp_weight = A::lit(1.0 - h.beta1);
        let lerp_small = lerp_weight.abs() < A::lit(0.5);
        let decay = match h.mode {
            Mode::AdamW if h.weight_decay != 0.0 => 1.0 - h.lr * h.weight_decay,
            _ => 1.0,
        };
        Coeffs {
            grad_scale: h.grad_scale.map_or(A::ONE, |s| A::lit(f64::from(s))),
            sign: if h.maximize { A::lit(-1.0) } else { A::ONE },
            weight_decay: A::lit(h.weight_decay),
            decay: A::lit(decay),
            lerp_coeff: if lerp_small {
                lerp_weight
            } else {
                lerp_weight - A::ONE
            },
            lerp_small,
            beta2: A::lit(h.beta2),
            sq_coeff: A::lit(1.0 - h.beta2),
            bc2_sqrt: A::lit(bias_correction2.sqrt()),
            eps: A::lit(h.eps),
            neg_step_size: A::lit(-(h.lr / bias_correction1)),
            adam_decay: h.mode == Mode::Adam && h.weight_decay != 0.0,
            store_grad: h.grad_scale.is_some(),
        }
    }
}

/// A piece of one parameter's buffers; elements from `tail` on take ATen's scalar-loop rounding.
#[derive(Debug)]
struct Chunk<'a, T> {
    param: &'a mut [T],
    grad: &'a mut [T],
    exp_avg: &'a mut [T],
    exp_avg_sq: &'a mut [T],
    max_exp_avg_sq: Option<&'a mut [T]>,
    tail: usize,
}

/// One element. `TAIL`: ATen's scalar loop (else its vector loop).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update<
    T: AdamFloat,
    const TAIL: bool,
    const STORE: bool,
    const DECAY: bool,
    const SMALL: bool,
>(
    c: &Coeffs<T::Acc>,
    p: &mut T,
    g: &mut T,
    m: &mut T,
    v: &mut T,
    mx: Option<&mut T>,
) {
    let mut grad = g.to_acc() / c.grad_scale;
    if STORE {
        *g = T::from_acc(grad);
    }
    grad = grad * c.sign;
    let mut param = p.to_acc();
    if DECAY {
        grad = param.fma(c.weight_decay, grad);
    }
    param = param * c.decay;
    // exp_avg.lerp_(grad, 1 - beta1), in the form ATen uses for its weight.
    let exp_avg = m.to_acc();
    let base = if SMALL { exp_avg } else { grad };
    let exp_avg = c.lerp_coeff.fma(grad - exp_avg, base);
    let scaled = c.sq_coeff * grad;
    let exp_avg_sq = if TAIL {
        v.to_acc().fma(c.beta2, scaled * grad)
    } else {
        scaled.fma(grad, v.to_acc() * c.beta2)
    };
    *m = T::from_acc(exp_avg);
    *v = T::from_acc(exp_avg_sq);
    let second = match mx {
        Some(mx) => {
            let old = mx.to_acc();
            let max = if TAIL {
                // std::max: the old value unless it is smaller.
                if old < exp_avg_sq {
                    exp_avg_sq
                } else {
                    old
                }
            } else if is_nan(old) || is_nan(exp_avg_sq) {
                // The vector maximum propagates NaN.
                T::Acc::NAN
            } else if old < exp_avg_sq {
                exp_avg_sq
            } else {
                old
            };
            *mx = T::from_acc(max);
            max
        }
        None => exp_avg_sq,
    };
    let denom = second.sqrt() / c.bc2_sqrt + c.eps;
    *p = T::from_acc(param + c.neg_step_size * exp_avg / denom);
}

/// NaN test through the accumulation type's own comparison (`x != x`).
#[inline(always)]
#[allow(clippy::eq_op)]
fn is_nan<A: Acc>(x: A) -> bool {
    x != x
}

#[inline(always)]
fn run_range<
    T: AdamFloat,
    const TAIL: bool,
    const STORE: bool,
    const DECAY: bool,
    const SMALL: bool,
>(
    c: &Coeffs<T::Acc>,
    p: &mut [T],
    g: &mut [T],
    m: &mut [T],
    v: &mut [T],
    mx: Option<&mut [T]>,
) {
    let elems = p.iter_mut().zip(g.iter_mut()).zip(m.iter_mut()).zip(v);
    match mx {
        Some(mx) => {
            for ((((p, g), m), v), mx) in elems.zip(mx) {
                update::<T, TAIL, STORE, DECAY, SMALL>(c, p, g, m, v, Some(mx));
            }
        }
        None => {
            for (((p, g), m), v) in elems {
                update::<T, TAIL, STORE, DECAY, SMALL>(c, p, g, m, v, None);
            }
        }
    }
}

#[inline(always)]
fn run_split<T: AdamFloat, const STORE: bool, const DECAY: bool, const SMALL: bool>(
    c: &Coeffs<T::Acc>,
    chunk: Chunk<'_, T>,
) {
    let at = chunk.tail.min(chunk.param.len());
    let (p0, p1) = chunk.param.split_at_mut(at);
    let (g0, g1) = chunk.grad.split_at_mut(at);
    let (m0, m1) = chunk.exp_avg.split_at_mut(at);
    let (v0, v1) = chunk.exp_avg_sq.split_at_mut(at);
    let (mx0, mx1) = match chunk.max_exp_avg_sq {
        Some(mx) => {
            let (a, b) = mx.split_at_mut(at);
            (Some(a), Some(b))
        }
        None => (None, None),
    };
    run_range::<T, false, STORE, DECAY, SMALL>(c, p0, g0, m0, v0, mx0);
    run_range::<T, true, STORE, DECAY, SMALL>(c, p1, g1, m1, v1, mx1);
}

/// Updates a chunk; inlined into the instruction-set entry point (`x86`), so that the fused
/// multiply-adds compile to FMA instructions there.
#[inline(always)]
fn run_chunk<T: AdamFloat>(c: &Coeffs<T::Acc>, chunk: Chunk<'_, T>) {
    if std::mem::size_of::<T>() < std::mem::size_of::<T::Acc>() {
        run_widened(c, chunk);
    } else {
        run_same(c, chunk);
    }
}

#[inline(always)]
fn run_same<T: AdamFloat>(c: &Coeffs<T::Acc>, chunk: Chunk<'_, T>) {
    // Every per-call switch is a compile-time parameter, so that the loops have no branches
    // left to keep them from vectorizing.
    match (c.store_grad, c.adam_decay, c.lerp_small) {
        (false, false, false) => run_split::<T, false, false, false>(c, chunk),
        (false, false, true) => run_split::<T, false, false, true>(c, chunk),
        (false, true, false) => run_split::<T, false, true, false>(c, chunk),
        (false, true, true) => run_split::<T, false, true, true>(c, chunk),
        (true, false, false) => run_split::<T, true, false, false>(c, chunk),
        (true, false, true) => run_split::<T, true, false, true>(c, chunk),
        (true, true, false) => run_split::<T, true, true, false>(c, chunk),
        (true, true, true) => run_split::<T, true, true, true>(c, chunk),
    }
}

/// Elements widened at a time for 16-bit types (on the stack, five buffers).
const BLOCK: usize = 1024;

/// 16-bit types: blocks widened to the accumulation type with the vectorized conversions,
/// updated there, and narrowed back (the same roundings as per element, done faster).
#[inline(always)]
fn run_widened<T: AdamFloat>(c: &Coeffs<T::Acc>, chunk: Chunk<'_, T>) {
    let zero = T::Acc::ZERO;
    // The conversions, looked up once (a lookup per call would cost as much as a block).
    let cv = Convert::<T>::new();
    let (widen, narrow) = (cv.widen, cv.narrow);
    let mut buf = [[zero; BLOCK]; 5];
    let len = chunk.param.len();
    let mut max = chunk.max_exp_avg_sq;
    let mut at = 0;
    while at < len {
        let end = (at + BLOCK).min(len);
        let n = end - at;
        let [p, g, m, v, mx] = &mut buf;
        let (p, g, m, v, mx) = (
            &mut p[..n],
            &mut g[..n],
            &mut m[..n],
            &mut v[..n],
            &mut mx[..n],
        );
        widen(&chunk.param[at..end], p);
        widen(&chunk.grad[at..end], g);
        widen(&chunk.exp_avg[at..end], m);
        widen(&chunk.exp_avg_sq[at..end], v);
        if let Some(max) = max.as_deref_mut() {
            widen(&max[at..end], mx);
        }
        let block = Chunk {
            param: &mut *p,
            grad: &mut *g,
            exp_avg: &mut *m,
            exp_avg_sq: &mut *v,
            max_exp_avg_sq: max.is_some().then_some(&mut *mx),
            tail: chunk.tail.saturating_sub(at),
        };
        run_same::<T::Acc>(c, block);
        narrow(p, &mut chunk.param[at..end]);
        if c.store_grad {
            narrow(g, &mut chunk.grad[at..end]);
        }
        narrow(m, &mut chunk.exp_avg[at..end]);
        narrow(v, &mut chunk.exp_avg_sq[at..end]);
        if let Some(max) = max.as_deref_mut() {
            narrow(mx, &mut max[at..end]);
        }
        at = end;
    }
}

/// The chunk update compiled with AVX2 and FMA, as ATen's kernel is (also on AVX-512 CPUs).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{run_chunk, AdamFloat, Chunk, Coeffs};

    crate::vectorize::x86_entry_points! { [avx2]
        /// [`run_chunk`] compiled for AVX2, FMA and F16C.
        fn update_chunk<T>(_: S, c: &Coeffs<T::Acc>, chunk: Chunk<'_, T>)
        where [T: AdamFloat]
        { run_chunk(c, chunk) }
    }
}

fn dispatch_chunk<T: AdamFloat>(c: &Coeffs<T::Acc>, chunk: Chunk<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    if Isa::current() != Isa::Portable {
        if let Some(token) = crate::simd::x86::Avx2::detect() {
            return x86::avx2::update_chunk(token, c, chunk);
        }
    }
    run_chunk(c, chunk)
}

fn check_lengths(n: usize, lens: &[(&str, usize)]) {
    for (name, len) in lens {
        assert_eq!(*len, n, "adam: {name} has {len} elements, expected {n}");
    }
}

/// One Adam/AdamW step of one parameter at step count `step` (already incremented, as the
/// optimizers pass it).
///
/// # Panics
/// If the buffers' lengths differ.
pub fn step<T: AdamFloat>(h: &Hyper, step: f64, b: Buffers<'_, T>, par: &dyn Parallel) {
    let n = b.param.len();
    check_lengths(
        n,
        &[
            ("grad", b.grad.len()),
            ("exp_avg", b.exp_avg.len()),
            ("exp_avg_sq", b.exp_avg_sq.len()),
            (
                "max_exp_avg_sq",
                b.max_exp_avg_sq.as_ref().map_or(n, |m| m.len()),
            ),
        ],
    );
    let c = Coeffs::<T::Acc>::new(h, step);
    let tail = n - n % lanes::<T>();
    let mut maxes = b.max_exp_avg_sq.map(|m| m.chunks_mut(CHUNK));
    let chunks: Vec<Chunk<'_, T>> = b
        .param
        .chunks_mut(CHUNK)
        .zip(b.grad.chunks_mut(CHUNK))
        .zip(b.exp_avg.chunks_mut(CHUNK))
        .zip(b.exp_avg_sq.chunks_mut(CHUNK))
        .enumerate()
        .map(|(i, (((param, grad), exp_avg), exp_avg_sq))| Chunk {
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq: maxes.as_mut().and_then(Iterator::next),
            tail: tail.saturating_sub(i * CHUNK),
        })
        .collect();
    blocks::for_each(par, chunks, CHUNK, |_, chunk| dispatch_chunk(&c, chunk));
}
