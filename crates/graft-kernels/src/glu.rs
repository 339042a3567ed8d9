//! Gated linear units over contiguous buffers: `y = act(gate) * up` and its backward
//! `dgate = dy * up * act'(gate)`, `dup = dy * act(gate)`, with act SiLU (SwiGLU) or GELU
//! (GeGLU, tanh-approximated or exact). Arithmetic in `T::Acc`, each output rounded once.

use crate::blocks;
use crate::float::{Acc, Float};
use crate::parallel::Parallel;

/// The activation applied to the gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    GeluTanh,
    /// `x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))`.
    GeluErf,
}

/// Elements per work item handed to the parallel-for.
const CHUNK: usize = 1 << 13;

/// The transcendental functions the activations need, in the accumulation types.
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

fn sigmoid<A: GluMath>(x: A) -> A {
    A::ONE / (A::ONE + (A::ZERO - x).exp())
}

/// `(act(x), act'(x))`. `0.5 (1 + tanh(u))` is computed as `sigmoid(2u)` and
/// `0.5 (1 + erf(z))` as `0.5 erfc(-z)`: the same values without the cancellation that
/// `1 + tanh` / `1 + erf` suffer for negative `x`.
#[inline(always)]
fn eval<A: GluMath>(act: Activation, x: A) -> (A, A) {
    let one = A::ONE;
    match act {
        Activation::Silu => {
            let s = sigmoid(x);
            (x * s, s * (one + x * (one - s)))
        }
        Activation::GeluTanh => {
            let k0 = A::lit(0.797_884_560_802_865_4); // sqrt(2 / pi)
            let k1 = A::lit(0.044_715);
            let x2 = x * x;
            let s = sigmoid(A::lit(2.0) * k0 * (x + k1 * x2 * x));
            let ds = A::lit(2.0) * s * (one - s) * k0 * (one + A::lit(3.0) * k1 * x2);
            (x * s, s + x * ds)
        }
        Activation::GeluErf => {
            let cdf = A::lit(0.5) * (A::ZERO - x * A::lit(std::f64::consts::FRAC_1_SQRT_2)).erfc();
            let pdf = A::lit(0.398_942_280_401_432_7) * (A::lit(-0.5) * x * x).exp();
            (x * cdf, cdf + x * pdf)
        }
    }
}

fn check_lengths(n: usize, lens: &[(&str, usize)]) {
    for (name, len) in lens {
        assert_eq!(*len, n, "glu: {name} has {len} elements, expected {n}");
    }
}

/// `y = act(gate) * up`.
///
/// # Panics
/// If the buffers' lengths differ.
pub fn forward<T: Float>(act: Activation, gate: &[T], up: &[T], y: &mut [T], par: &dyn Parallel)
where
    T::Acc: GluMath,
{
    let n = gate.len();
    check_lengths(n, &[("up", up.len()), ("y", y.len())]);
    let chunks: Vec<&mut [T]> = y.chunks_mut(CHUNK).collect();
    blocks::for_each(par, chunks, CHUNK, |i, y| {
        let at = i * CHUNK;
        let inputs = gate[at..].iter().zip(&up[at..]);
        for (y, (&g, &u)) in y.iter_mut().zip(inputs) {
            let (f, _) = eval(act, g.to_acc());
            *y = T::from_acc(f * u.to_acc());
        }
    });
}

/// `dgate = dy * up * act'(gate)`, `dup = dy * act(gate)`.
///
/// # Panics
/// If the buffers' lengths differ.
pub fn backward<T: Float>(
    act: Activation,
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
    par: &dyn Parallel,
) where
    T::Acc: GluMath,
{
    let n = gate.len();
    check_lengths(
        n,
        &[
            ("up", up.len()),
            ("dy", dy.len()),
            ("dgate", dgate.len()),
            ("dup", dup.len()),
        ],
    );
    let chunks: Vec<(&mut [T], &mut [T])> =
        dgate.chunks_mut(CHUNK).zip(dup.chunks_mut(CHUNK)).collect();
    blocks::for_each(par, chunks, CHUNK, |i, (dg, du)| {
        let at = i * CHUNK;
        let inputs = gate[at..].iter().zip(&up[at..]).zip(&dy[at..]);
        for ((dg, du), ((&g, &u), &d)) in dg.iter_mut().zip(du.iter_mut()).zip(inputs) {
            let (f, df) = eval(act, g.to_acc());
            let d = d.to_acc();
            *dg = T::from_acc(d * u.to_acc() * df);
            *du = T::from_acc(d * f);
        }
    });
}
