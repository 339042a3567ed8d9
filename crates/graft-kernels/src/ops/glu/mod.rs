//! Gated linear units over contiguous buffers: `y = act(gate) * up` and its backward
//! `dgate = dy * up * act'(gate)`, `dup = dy * act(gate)`, with act SiLU (SwiGLU) or GELU
//! (GeGLU, tanh-approximated or exact). Arithmetic in `T::Acc`, each output rounded once.
//!
//! The vector kernels compute `f32` activations with [`crate::vmath`] (`e^x` within 1 ulp, the
//! normal CDF within 3.2 ulp) and `f64` ones lane by lane with libm's `exp`/`erfc`, as the
//! scalar path ([`GluMath`]) does for element types without vector kernels. bf16 and f16
//! outputs get shorter `f32` math whose error is far below their rounding ([`math_for`]).

use crate::blocks;
use crate::float::{Acc, Float};
use crate::isa::Isa;
use crate::parallel::Parallel;
use crate::simd::portable::Portable;
#[cfg(target_arch = "x86_64")]
use crate::simd::x86::{Avx2, Avx512};
use crate::simd::{load_part, store_part, Lanes, Simd, SimdF32, MAX_LANES};
use crate::tables::select_table;
use crate::vmath;

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
fn eval<A: GluMath>(act: Activation, x: A) -> (A, A) {
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
pub(crate) trait ActLanes<S: Simd<Self>>: Acc {
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
pub(crate) mod math {
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
pub(crate) fn math_for<T: Float>() -> u8 {
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
    let kernel = kernels::<T>().map(|k| k.forward);
    let chunks: Vec<&mut [T]> = y.chunks_mut(CHUNK).collect();
    blocks::for_each(par, chunks, CHUNK, |i, y| {
        let at = i * CHUNK..i * CHUNK + y.len();
        let (gate, up) = (&gate[at.clone()], &up[at]);
        match kernel {
            Some(kernel) => kernel(act, gate, up, y),
            None => {
                for (y, (&g, &u)) in y.iter_mut().zip(gate.iter().zip(up)) {
                    let (f, _) = eval(act, g.to_acc());
                    *y = T::from_acc(f * u.to_acc());
                }
            }
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
    let kernel = kernels::<T>().map(|k| k.backward);
    let chunks: Vec<(&mut [T], &mut [T])> =
        dgate.chunks_mut(CHUNK).zip(dup.chunks_mut(CHUNK)).collect();
    blocks::for_each(par, chunks, CHUNK, |i, (dg, du)| {
        let at = i * CHUNK..i * CHUNK + dg.len();
        let (gate, up, dy) = (&gate[at.clone()], &up[at.clone()], &dy[at]);
        match kernel {
            Some(kernel) => kernel(act, gate, up, dy, dg, du),
            None => {
                let inputs = gate.iter().zip(up).zip(dy);
                for ((dg, du), ((&g, &u), &d)) in dg.iter_mut().zip(du.iter_mut()).zip(inputs) {
                    let (f, df) = eval(act, g.to_acc());
                    let d = d.to_acc();
                    *dg = T::from_acc(d * u.to_acc() * df);
                    *du = T::from_acc(d * f);
                }
            }
        }
    });
}

/// [`backward`] writing `dgate` over `gate` and `dup` over `up` (no output buffers: what the
/// `inplace_backward` option of the Python ops asks for). Each element of `gate`, `up` and `dy`
/// is read before the same element is written.
///
/// # Panics
/// If the buffers' lengths differ.
pub fn backward_in_place<T: Float>(
    act: Activation,
    gate: &mut [T],
    up: &mut [T],
    dy: &[T],
    par: &dyn Parallel,
) where
    T::Acc: GluMath,
{
    let n = gate.len();
    check_lengths(n, &[("up", up.len()), ("dy", dy.len())]);
    let kernel = kernels::<T>().map(|k| k.backward_in_place);
    let chunks: Vec<(&mut [T], &mut [T])> =
        gate.chunks_mut(CHUNK).zip(up.chunks_mut(CHUNK)).collect();
    blocks::for_each(par, chunks, CHUNK, |i, (g, u)| {
        let dy = &dy[i * CHUNK..i * CHUNK + g.len()];
        match kernel {
            Some(kernel) => kernel(act, g, u, dy),
            None => {
                for ((g, u), &d) in g.iter_mut().zip(u.iter_mut()).zip(dy) {
                    let (f, df) = eval(act, g.to_acc());
                    let d = d.to_acc();
                    (*g, *u) = (T::from_acc(d * u.to_acc() * df), T::from_acc(d * f));
                }
            }
        }
    });
}

/// `(act, gate, up, dy, dgate, dup)`: [`backward_lanes`] over one chunk.
type BackwardFn<T> = fn(Activation, &[T], &[T], &[T], &mut [T], &mut [T]);

/// GLU's vector kernels for element type `T`, compiled for one instruction set.
struct Kernels<T: Float> {
    /// [`forward_lanes`] over one chunk.
    forward: fn(Activation, &[T], &[T], &mut [T]),
    /// [`backward_lanes`] over one chunk.
    backward: BackwardFn<T>,
    /// [`backward_in_place_lanes`] over one chunk: `(act, gate, up, dy)`.
    backward_in_place: fn(Activation, &mut [T], &mut [T], &[T]),
}

impl<T: Float> Clone for Kernels<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Float> Copy for Kernels<T> {}

/// The vector kernels for `T` and [`Isa::current`]; `None` for element types other than
/// `f32`, `f64`, `bf16` and `f16` (their callers then compute one element at a time).
fn kernels<T: Float>() -> Option<Kernels<T>> {
    let isa = Isa::current();
    select_table!(|N| match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Kernels::<N> {
            forward: |act, g, u, y| x86::avx512_bf16::forward(Avx512::get(), act, g, u, y),
            backward: |act, g, u, dy, dg, du| {
                x86::avx512_bf16::backward(Avx512::get(), act, g, u, dy, dg, du)
            },
            backward_in_place: |act, g, u, dy| {
                x86::avx512_bf16::backward_in_place(Avx512::get(), act, g, u, dy)
            },
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Kernels::<N> {
            forward: |act, g, u, y| x86::avx2::forward(Avx2::get(), act, g, u, y),
            backward: |act, g, u, dy, dg, du| {
                x86::avx2::backward(Avx2::get(), act, g, u, dy, dg, du)
            },
            backward_in_place: |act, g, u, dy| {
                x86::avx2::backward_in_place(Avx2::get(), act, g, u, dy)
            },
        },
        _ => Kernels::<N> {
            forward: |act, g, u, y| forward_lanes(Portable, act, g, u, y),
            backward: |act, g, u, dy, dg, du| backward_lanes(Portable, act, g, u, dy, dg, du),
            backward_in_place: |act, g, u, dy| backward_in_place_lanes(Portable, act, g, u, dy),
        },
    })
}

/// GLU's kernels compiled for each x86 token; on AVX-512 CPUs with AVX512-BF16 once more with
/// it, so that bf16 outputs are rounded by `vcvtneps2bf16` (2 instructions a vector instead of
/// 10; the other element types compile to the same code as without it).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{backward_in_place_lanes, backward_lanes, forward_lanes, ActLanes, Activation};
    use crate::simd::{Lanes, Simd};

    crate::vectorize::x86_entry_points! { [avx2, avx512, avx512_bf16]
        /// [`forward_lanes`] compiled for the token `S`.
        fn forward<T>(s: S, act: Activation, gate: &[T], up: &[T], y: &mut [T])
        where [T: Lanes<S>, S: Simd<T::Acc>, T::Acc: ActLanes<S>]
        { forward_lanes(s, act, gate, up, y) }

        /// [`backward_lanes`] compiled for the token `S`.
        fn backward<T>(
            s: S,
            act: Activation,
            gate: &[T],
            up: &[T],
            dy: &[T],
            dgate: &mut [T],
            dup: &mut [T]
        )
        where [T: Lanes<S>, S: Simd<T::Acc>, T::Acc: ActLanes<S>]
        { backward_lanes(s, act, gate, up, dy, dgate, dup) }

        /// [`backward_in_place_lanes`] compiled for the token `S`.
        fn backward_in_place<T>(s: S, act: Activation, gate: &mut [T], up: &mut [T], dy: &[T])
        where [T: Lanes<S>, S: Simd<T::Acc>, T::Acc: ActLanes<S>]
        { backward_in_place_lanes(s, act, gate, up, dy) }
    }
}

/// `n` elements from `src` as a vector (a partial one past the last whole vector).
#[inline(always)]
fn load_n<S, T>(s: S, src: &[T], n: usize) -> S::V
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    if n == S::LANES {
        T::load(s, src)
    } else {
        load_part(s, &src[..n])
    }
}

/// Stores the first `dst.len()` lanes of `v`.
#[inline(always)]
fn store_n<S, T>(s: S, v: S::V, dst: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
{
    if dst.len() == S::LANES {
        T::store(s, v, dst)
    } else {
        store_part(s, v, dst)
    }
}

/// Vectors processed side by side: the activations are long dependency chains, and independent
/// ones let the core overlap them. Even: operands are loaded and stored in pairs
/// ([`Lanes::load_pair`], interleaved bf16 on AVX-512 with AVX512-BF16).
const UNROLL: usize = 4;

/// An activation as a type, so that each loop below is compiled once per activation with the
/// `match` on it resolved at compile time (closures would not inherit the entry points' target
/// features, and their intrinsics would become calls).
trait Kind {
    const ACT: Activation;
}
struct SiluKind;
struct GeluTanhKind;
struct GeluErfKind;
impl Kind for SiluKind {
    const ACT: Activation = Activation::Silu;
}
impl Kind for GeluTanhKind {
    const ACT: Activation = Activation::GeluTanh;
}
impl Kind for GeluErfKind {
    const ACT: Activation = Activation::GeluErf;
}

/// [`forward`] over one chunk, in vectors of the token `S`.
#[inline(always)]
pub(crate) fn forward_lanes<S, T>(s: S, act: Activation, gate: &[T], up: &[T], y: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
{
    match math_for::<T>() {
        math::BF16 => forward_act::<S, T, { math::BF16 }>(s, act, gate, up, y),
        math::F16 => forward_act::<S, T, { math::F16 }>(s, act, gate, up, y),
        _ => forward_act::<S, T, { math::FULL }>(s, act, gate, up, y),
    }
}

#[inline(always)]
fn forward_act<S, T, const MATH: u8>(s: S, act: Activation, gate: &[T], up: &[T], y: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
{
    match act {
        Activation::Silu => forward_with::<S, T, SiluKind, MATH>(s, gate, up, y),
        Activation::GeluTanh => forward_with::<S, T, GeluTanhKind, MATH>(s, gate, up, y),
        Activation::GeluErf => forward_with::<S, T, GeluErfKind, MATH>(s, gate, up, y),
    }
}

#[inline(always)]
fn forward_with<S, T, K, const MATH: u8>(s: S, gate: &[T], up: &[T], y: &mut [T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
    K: Kind,
{
    let lanes = S::LANES;
    let step = UNROLL * lanes;
    let split = y.len() / step * step;
    let (whole, rest) = y.split_at_mut(split);
    for (k, y) in whole.chunks_exact_mut(step).enumerate() {
        let (gate, up) = (&gate[k * step..][..step], &up[k * step..][..step]);
        let mut out = [s.splat(T::Acc::ZERO); UNROLL];
        for j in (0..UNROLL).step_by(2) {
            let at = j * lanes;
            let (g0, g1) = T::load_pair(s, &gate[at..]);
            let (u0, u1) = T::load_pair(s, &up[at..]);
            let f0 = T::Acc::value::<MATH>(s, K::ACT, g0);
            let f1 = T::Acc::value::<MATH>(s, K::ACT, g1);
            out[j] = s.mul(f0, u0);
            out[j + 1] = s.mul(f1, u1);
        }
        for j in (0..UNROLL).step_by(2) {
            T::store_pair(s, (out[j], out[j + 1]), &mut y[j * lanes..]);
        }
    }
    let (gate, up) = (&gate[split..], &up[split..]);
    for (k, y) in rest.chunks_mut(lanes).enumerate() {
        let (at, n) = (k * lanes, y.len());
        let f = T::Acc::value::<MATH>(s, K::ACT, load_n(s, &gate[at..], n));
        store_n(s, s.mul(f, load_n(s, &up[at..], n)), y);
    }
}

/// [`backward`] over one chunk, in vectors of the token `S`.
#[inline(always)]
pub(crate) fn backward_lanes<S, T>(
    s: S,
    act: Activation,
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
) where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
{
    match math_for::<T>() {
        math::BF16 => backward_act::<S, T, { math::BF16 }>(s, act, gate, up, dy, dgate, dup),
        math::F16 => backward_act::<S, T, { math::F16 }>(s, act, gate, up, dy, dgate, dup),
        _ => backward_act::<S, T, { math::FULL }>(s, act, gate, up, dy, dgate, dup),
    }
}

#[inline(always)]
fn backward_act<S, T, const MATH: u8>(
    s: S,
    act: Activation,
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
) where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
{
    match act {
        Activation::Silu => backward_with::<S, T, SiluKind, MATH>(s, gate, up, dy, dgate, dup),
        Activation::GeluTanh => {
            backward_with::<S, T, GeluTanhKind, MATH>(s, gate, up, dy, dgate, dup)
        }
        Activation::GeluErf => {
            backward_with::<S, T, GeluErfKind, MATH>(s, gate, up, dy, dgate, dup)
        }
    }
}

#[inline(always)]
fn backward_with<S, T, K, const MATH: u8>(
    s: S,
    gate: &[T],
    up: &[T],
    dy: &[T],
    dgate: &mut [T],
    dup: &mut [T],
) where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
    K: Kind,
{
    let lanes = S::LANES;
    let step = UNROLL * lanes;
    let split = dgate.len() / step * step;
    let (dg_whole, dg_rest) = dgate.split_at_mut(split);
    let (du_whole, du_rest) = dup.split_at_mut(split);
    let wholes = dg_whole
        .chunks_exact_mut(step)
        .zip(du_whole.chunks_exact_mut(step));
    for (k, (dg, du)) in wholes.enumerate() {
        let at = k * step;
        let (gate, up, dy) = (&gate[at..][..step], &up[at..][..step], &dy[at..][..step]);
        let zero = s.splat(T::Acc::ZERO);
        let (mut dg_v, mut du_v) = ([zero; UNROLL], [zero; UNROLL]);
        for j in (0..UNROLL).step_by(2) {
            let at = j * lanes;
            let g = T::load_pair(s, &gate[at..]);
            let u = T::load_pair(s, &up[at..]);
            let d = T::load_pair(s, &dy[at..]);
            for (i, (g, u, d)) in [(g.0, u.0, d.0), (g.1, u.1, d.1)].into_iter().enumerate() {
                let (f, df) = T::Acc::act::<MATH>(s, K::ACT, g);
                dg_v[j + i] = s.mul(s.mul(d, u), df);
                du_v[j + i] = s.mul(d, f);
            }
        }
        for j in (0..UNROLL).step_by(2) {
            let at = j * lanes;
            T::store_pair(s, (dg_v[j], dg_v[j + 1]), &mut dg[at..]);
            T::store_pair(s, (du_v[j], du_v[j + 1]), &mut du[at..]);
        }
    }
    let (gate, up, dy) = (&gate[split..], &up[split..], &dy[split..]);
    let rests = dg_rest.chunks_mut(lanes).zip(du_rest.chunks_mut(lanes));
    for (k, (dg, du)) in rests.enumerate() {
        let (at, n) = (k * lanes, dg.len());
        let (f, df) = T::Acc::act::<MATH>(s, K::ACT, load_n(s, &gate[at..], n));
        let d = load_n(s, &dy[at..], n);
        store_n(s, s.mul(s.mul(d, load_n(s, &up[at..], n)), df), dg);
        store_n(s, s.mul(d, f), du);
    }
}

/// [`backward_in_place`] over one chunk, in vectors of the token `S`.
#[inline(always)]
pub(crate) fn backward_in_place_lanes<S, T>(
    s: S,
    act: Activation,
    gate: &mut [T],
    up: &mut [T],
    dy: &[T],
) where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
{
    match math_for::<T>() {
        math::BF16 => backward_in_place_act::<S, T, { math::BF16 }>(s, act, gate, up, dy),
        math::F16 => backward_in_place_act::<S, T, { math::F16 }>(s, act, gate, up, dy),
        _ => backward_in_place_act::<S, T, { math::FULL }>(s, act, gate, up, dy),
    }
}

#[inline(always)]
fn backward_in_place_act<S, T, const MATH: u8>(
    s: S,
    act: Activation,
    gate: &mut [T],
    up: &mut [T],
    dy: &[T],
) where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
{
    match act {
        Activation::Silu => backward_in_place_with::<S, T, SiluKind, MATH>(s, gate, up, dy),
        Activation::GeluTanh => backward_in_place_with::<S, T, GeluTanhKind, MATH>(s, gate, up, dy),
        Activation::GeluErf => backward_in_place_with::<S, T, GeluErfKind, MATH>(s, gate, up, dy),
    }
}

/// [`backward_with`] with the outputs over the inputs: each block of `UNROLL` vectors is read
/// whole before it is written.
#[inline(always)]
fn backward_in_place_with<S, T, K, const MATH: u8>(s: S, gate: &mut [T], up: &mut [T], dy: &[T])
where
    S: Simd<T::Acc>,
    T: Lanes<S>,
    T::Acc: ActLanes<S>,
    K: Kind,
{
    let lanes = S::LANES;
    let step = UNROLL * lanes;
    let split = gate.len() / step * step;
    let (g_whole, g_rest) = gate.split_at_mut(split);
    let (u_whole, u_rest) = up.split_at_mut(split);
    let wholes = g_whole
        .chunks_exact_mut(step)
        .zip(u_whole.chunks_exact_mut(step));
    for (k, (g, u)) in wholes.enumerate() {
        let dy = &dy[k * step..][..step];
        let zero = s.splat(T::Acc::ZERO);
        let (mut dg_v, mut du_v) = ([zero; UNROLL], [zero; UNROLL]);
        for j in (0..UNROLL).step_by(2) {
            let at = j * lanes;
            let gv = T::load_pair(s, &g[at..]);
            let uv = T::load_pair(s, &u[at..]);
            let d = T::load_pair(s, &dy[at..]);
            for (i, (g, u, d)) in [(gv.0, uv.0, d.0), (gv.1, uv.1, d.1)]
                .into_iter()
                .enumerate()
            {
                let (f, df) = T::Acc::act::<MATH>(s, K::ACT, g);
                dg_v[j + i] = s.mul(s.mul(d, u), df);
                du_v[j + i] = s.mul(d, f);
            }
        }
        for j in (0..UNROLL).step_by(2) {
            let at = j * lanes;
            T::store_pair(s, (dg_v[j], dg_v[j + 1]), &mut g[at..]);
            T::store_pair(s, (du_v[j], du_v[j + 1]), &mut u[at..]);
        }
    }
    let dy = &dy[split..];
    let rests = g_rest.chunks_mut(lanes).zip(u_rest.chunks_mut(lanes));
    for (k, (g, u)) in rests.enumerate() {
        let (at, n) = (k * lanes, g.len());
        let (f, df) = T::Acc::act::<MATH>(s, K::ACT, load_n(s, g, n));
        let d = load_n(s, &dy[at..], n);
        let dg = s.mul(s.mul(d, load_n(s, u, n)), df);
        store_n(s, dg, g);
        store_n(s, s.mul(d, f), u);
    }
}
