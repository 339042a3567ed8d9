//! The column loops (`inner > 1`): [`TILE`] adjacent columns at a time, vectorized across
//! them.

use super::rows::exp_shift;
use super::{Kind, TILE};
use crate::elem::{AccType, Elem};
use crate::exp::VecExp;

/// Columns `first ..` of a `dim x stride` row-major panel.
pub(super) struct Cols<'a, E> {
    /// The panel.
    pub(super) x: &'a [E],
    /// Its row length.
    pub(super) stride: usize,
    /// The first column of the range.
    pub(super) first: usize,
}

impl<E> Clone for Cols<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Cols<'_, E> {}

impl<E> Cols<'_, E> {
    /// Row `d`'s columns `col .. col + w` of the range.
    #[inline(always)]
    fn seg(&self, d: usize, col: usize, w: usize) -> &[E] {
        let at = d * self.stride + self.first + col;
        &self.x[at..at + w]
    }
}

/// Forward over a range of columns, [`TILE`] at a time: maxima, then sums of exponentials
/// (kept for softmax), then the outputs, each vectorized across the tile's columns.
#[inline(always)]
pub(super) fn forward_cols<E: Elem<A>, A: AccType, const FMA: bool>(
    kind: Kind,
    x: Cols<'_, E>,
    y: &mut [&mut [E]],
) {
    let (dim, width) = (y.len(), y.first().map_or(0, |s| s.len()));
    let mut exps = A::take();
    if kind == Kind::Softmax {
        exps.resize(dim * TILE, A::ZERO);
    }
    for col in (0..width).step_by(TILE) {
        let w = (width - col).min(TILE);
        forward_tile::<E, A, FMA>(kind, x, y, (col, w), &mut exps);
    }
    A::put(exps);
}

#[inline(always)]
fn forward_tile<E: Elem<A>, A: VecExp, const FMA: bool>(
    kind: Kind,
    x: Cols<'_, E>,
    y: &mut [&mut [E]],
    (col, w): (usize, usize),
    exps: &mut [A],
) {
    let dim = y.len();
    let zero = A::ZERO;
    let mut m = [A::NEG_INFINITY; TILE];
    let m = &mut m[..w];
    for d in 0..dim {
        for (mv, &v) in m.iter_mut().zip(x.seg(d, col, w)) {
            *mv = mv.max_of(v.get());
        }
    }
    let mut s = [zero; TILE];
    let s = &mut s[..w];
    let softmax = kind == Kind::Softmax;
    for d in 0..dim {
        let xs = x.seg(d, col, w);
        if softmax {
            let e = &mut exps[d * w..(d + 1) * w];
            for ((e, &v), &mv) in e.iter_mut().zip(xs).zip(m.iter()) {
                *e = exp_shift::<A, FMA>(v.get(), mv);
            }
            for (sv, &e) in s.iter_mut().zip(e.iter()) {
                *sv += e;
            }
        } else {
            for ((sv, &v), &mv) in s.iter_mut().zip(xs).zip(m.iter()) {
                *sv += exp_shift::<A, FMA>(v.get(), mv);
            }
        }
    }
    for (sv, &mv) in s.iter_mut().zip(m.iter()) {
        if mv == A::INFINITY {
            // ATen's exp(inf - inf) makes the sum NaN.
            *sv = A::NAN;
        }
    }
    if softmax {
        let mut inv = [zero; TILE];
        for (i, &sv) in inv.iter_mut().zip(s.iter()) {
            *i = A::ONE / sv;
        }
        for (d, dst) in y.iter_mut().enumerate() {
            let e = &exps[d * w..(d + 1) * w];
            for ((o, &e), &i) in dst[col..col + w].iter_mut().zip(e).zip(inv.iter()) {
                *o = E::set(e * i);
            }
        }
    } else {
        let mut log_sum = [zero; TILE];
        for (l, &sv) in log_sum.iter_mut().zip(s.iter()) {
            *l = sv.ln();
        }
        for (d, dst) in y.iter_mut().enumerate() {
            let terms = x.seg(d, col, w).iter().zip(m.iter()).zip(log_sum.iter());
            for (o, ((&v, &mv), &l)) in dst[col..col + w].iter_mut().zip(terms) {
                *o = E::set((v.get() - mv) - l);
            }
        }
    }
}

/// Backward over a range of columns, [`TILE`] at a time.
#[inline(always)]
pub(super) fn backward_cols<E: Elem<A>, A: VecExp, const FMA: bool>(
    kind: Kind,
    dy: Cols<'_, E>,
    y: Cols<'_, E>,
    dx: &mut [&mut [E]],
) {
    let (dim, width) = (dx.len(), dx.first().map_or(0, |s| s.len()));
    for col in (0..width).step_by(TILE) {
        let w = (width - col).min(TILE);
        let mut total = [A::ZERO; TILE];
        let total = &mut total[..w];
        for d in 0..dim {
            let gs = dy.seg(d, col, w);
            if kind == Kind::Softmax {
                for ((t, &g), &o) in total.iter_mut().zip(gs).zip(y.seg(d, col, w)) {
                    *t += g.get() * o.get();
                }
            } else {
                for (t, &g) in total.iter_mut().zip(gs) {
                    *t += g.get();
                }
            }
        }
        for (d, dst) in dx.iter_mut().enumerate() {
            let terms = dy
                .seg(d, col, w)
                .iter()
                .zip(y.seg(d, col, w))
                .zip(total.iter());
            let out = dst[col..col + w].iter_mut();
            match kind {
                Kind::Softmax => {
                    for (o, ((&g, &yv), &t)) in out.zip(terms) {
                        *o = E::set(yv.get() * (g.get() - t));
                    }
                }
                Kind::LogSoftmax => {
                    for (o, ((&g, &yv), &t)) in out.zip(terms) {
                        *o = E::set(g.get() - yv.get().exp::<FMA>() * t);
                    }
                }
            }
        }
    }
}
