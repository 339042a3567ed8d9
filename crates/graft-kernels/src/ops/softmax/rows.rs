//! The row loops (`inner == 1`): the reduction over each row's `dim` consecutive values, then
//! its outputs, over lanes of 16 so that they vectorize.

use super::{Kind, BLOCK};
use crate::elem::{AccType, Elem};
use crate::exp::VecExp;
use crate::float::Acc;

/// `max(m, buf)`, vectorized over lanes of 16.
#[inline(always)]
fn max_of<E: Elem<A>, A: VecExp>(m: A, buf: &[E]) -> A {
    let mut lanes = [A::NEG_INFINITY; 16];
    let chunks = buf.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max_of(v.get());
        }
    }
    for &v in rest {
        lanes[0] = lanes[0].max_of(v.get());
    }
    lanes.iter().fold(m, |a, &b| a.max_of(b))
}

/// The sum of `buf`, over lanes of 16 (a fixed order).
#[inline(always)]
fn sum_of<A: Acc>(buf: &[A]) -> A {
    let mut lanes = [A::ZERO; 16];
    let chunks = buf.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    for (l, &v) in lanes.iter_mut().zip(rest) {
        *l += v;
    }
    fold_lanes(lanes)
}

/// The sum of 16 lanes, pairwise.
#[inline(always)]
fn fold_lanes<A: Acc>(mut lanes: [A; 16]) -> A {
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            lanes[i] += lanes[i + w];
        }
    }
    lanes[0]
}

/// The sum of `a * b` (or of `a` alone when `!PRODUCT`), over lanes of 16.
#[inline(always)]
fn dot_of<E: Elem<A>, A: Acc, const PRODUCT: bool>(a: &[E], b: &[E]) -> A {
    #[inline(always)]
    fn term<E: Elem<A>, A: Acc, const PRODUCT: bool>(x: E, y: E) -> A {
        if PRODUCT {
            x.get() * y.get()
        } else {
            x.get()
        }
    }
    let mut lanes = [A::ZERO; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((l, &x), &y) in lanes.iter_mut().zip(x).zip(y) {
            *l += term::<E, A, PRODUCT>(x, y);
        }
    }
    for ((l, &x), &y) in lanes.iter_mut().zip(ra).zip(rb) {
        *l += term::<E, A, PRODUCT>(x, y);
    }
    fold_lanes(lanes)
}

/// `exp(v - m)`, with -inf giving 0 also when `m` is -inf (no finite element seen yet).
#[inline(always)]
pub(super) fn exp_shift<A: VecExp, const FMA: bool>(v: A, m: A) -> A {
    let e = (v - m).exp::<FMA>();
    if v == A::NEG_INFINITY {
        A::ZERO
    } else {
        e
    }
}

/// Forward rows of `dim` values.
#[inline(always)]
pub(super) fn forward_rows<E: Elem<A>, A: AccType, const FMA: bool>(
    kind: Kind,
    x: &[E],
    y: &mut [E],
    dim: usize,
    block_max: &mut Vec<A>,
) {
    match kind {
        Kind::LogSoftmax => {
            for (x, y) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
                log_softmax_row::<E, A, FMA>(x, y);
            }
        }
        Kind::Softmax => {
            // A row's exponentials, in the accumulation type.
            let mut exps = A::take();
            exps.resize(dim, A::ZERO);
            for (x, y) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
                softmax_row::<E, A, FMA>(x, y, &mut exps, block_max);
            }
            A::put(exps);
        }
    }
}

/// Pass 1: the maximum and the sum of exponentials in one read, rescaling the sum when a
/// block raises the maximum; pass 2: `(x - m) - log(s)`, from cache.
#[inline(always)]
fn log_softmax_row<E: Elem<A>, A: VecExp, const FMA: bool>(x: &[E], y: &mut [E]) {
    let (mut m, mut s) = (A::NEG_INFINITY, A::ZERO);
    for xb in x.chunks(BLOCK) {
        let bm = max_of(m, xb);
        if bm > m {
            s = s * (m - bm).exp::<FMA>();
            m = bm;
        }
        let mut lanes = [A::ZERO; 16];
        let chunks = xb.chunks_exact(16);
        let rest = chunks.remainder();
        for c in chunks {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l += exp_shift::<A, FMA>(v.get(), m);
            }
        }
        for (l, &v) in lanes.iter_mut().zip(rest) {
            *l += exp_shift::<A, FMA>(v.get(), m);
        }
        s += fold_lanes(lanes);
    }
    if m == A::INFINITY {
        // ATen's exp(inf - inf) makes the sum NaN.
        s = A::NAN;
    }
    let log_sum = s.ln();
    for (o, &v) in y.iter_mut().zip(x) {
        *o = E::set((v.get() - m) - log_sum);
    }
}

/// Pass 1 as for log-softmax, keeping each block's exponentials and the maximum they were
/// taken against; pass 2 rescales them to the final maximum and divides by the sum.
#[inline(always)]
fn softmax_row<E: Elem<A>, A: VecExp, const FMA: bool>(
    x: &[E],
    y: &mut [E],
    exps: &mut [A],
    block_max: &mut Vec<A>,
) {
    block_max.clear();
    let (mut m, mut s) = (A::NEG_INFINITY, A::ZERO);
    for (xb, eb) in x.chunks(BLOCK).zip(exps.chunks_mut(BLOCK)) {
        let bm = max_of(m, xb);
        if bm > m {
            s = s * (m - bm).exp::<FMA>();
            m = bm;
        }
        for (e, &v) in eb.iter_mut().zip(xb) {
            *e = exp_shift::<A, FMA>(v.get(), m);
        }
        s += sum_of(eb);
        block_max.push(m);
    }
    if m == A::INFINITY {
        s = A::NAN;
    }
    let blocks = y.chunks_mut(BLOCK).zip(exps.chunks(BLOCK));
    for ((yb, eb), &bm) in blocks.zip(block_max.iter()) {
        let c = (bm - m).exp::<FMA>() / s;
        for (o, &e) in yb.iter_mut().zip(eb) {
            *o = E::set(e * c);
        }
    }
}

/// Backward rows: `dx = y * (dy - sum(dy * y))` or `dx = dy - exp(y) * sum(dy)`.
#[inline(always)]
pub(super) fn backward_rows<E: Elem<A>, A: VecExp, const FMA: bool>(
    kind: Kind,
    dy: &[E],
    y: &[E],
    dx: &mut [E],
    dim: usize,
) {
    let rows = dy.chunks_exact(dim).zip(y.chunks_exact(dim));
    for ((g, o), d) in rows.zip(dx.chunks_exact_mut(dim)) {
        match kind {
            Kind::Softmax => {
                let total: A = dot_of::<E, A, true>(g, o);
                for ((d, &gv), &yv) in d.iter_mut().zip(g).zip(o) {
                    *d = E::set(yv.get() * (gv.get() - total));
                }
            }
            Kind::LogSoftmax => {
                let total: A = dot_of::<E, A, false>(g, o);
                for ((d, &gv), &yv) in d.iter_mut().zip(g).zip(o) {
                    *d = E::set(gv.get() - yv.get().exp::<FMA>() * total);
                }
            }
        }
    }
}
