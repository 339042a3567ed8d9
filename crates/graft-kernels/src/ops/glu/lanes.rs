//! The vector loops of [`super::forward`], [`super::backward`] and
//! [`super::backward_in_place`] over one chunk, written against the tokens: `UNROLL` vectors
//! side by side, the activation resolved at compile time.

use super::activation::{math, math_for, ActLanes};
use super::Activation;
use crate::float::Acc;
use crate::simd::{load_part, store_part, Lanes, Simd};

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
pub(super) fn forward_lanes<S, T>(s: S, act: Activation, gate: &[T], up: &[T], y: &mut [T])
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
pub(super) fn backward_lanes<S, T>(
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
pub(super) fn backward_in_place_lanes<S, T>(
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
