//! A task's rows, run: the forward's statistics and outputs, the backward's row sums and
//! gradients, over lanes of 16 so that they vectorize; f16 through accumulation-type panels.

use super::{Affine, BackwardTask, ForwardTask, NormFloat, Stats, PANEL};
use crate::elem::{panels, AccType, Elem, PanelBuffer};
use crate::float::Acc;
use crate::ops::convert::Convert;

/// A forward task; inlined into the instruction-set entry points (`super::x86`) so that its
/// loops vectorize there. No closure takes part in a hot loop (a closure is compiled on its
/// own, without the entry point's instruction set).
#[inline(always)]
pub(super) fn run_forward<T: NormFloat>(cv: Convert<T>, t: ForwardTask<'_, T>) {
    let ForwardTask {
        x,
        y,
        mean,
        rstd,
        cols,
        affine,
        eps,
    } = t;
    if !T::PANELS {
        return forward_rows::<T, T::Acc>(x, y, (mean, rstd), cols, affine, eps);
    }
    let panel = (PANEL / cols).max(1) * cols;
    let rows_per_panel = panel / cols;
    let mut buf = panels::<T::Acc>(panel);
    let (xa, rest) = buf.split_at_mut(panel);
    let ya = &mut rest[..panel];
    let parts = x.chunks(panel).zip(y.chunks_mut(panel));
    let stats = mean
        .chunks_mut(rows_per_panel)
        .zip(rstd.chunks_mut(rows_per_panel));
    for ((xp, yp), (m, r)) in parts.zip(stats) {
        let (xa, ya) = (&mut xa[..xp.len()], &mut ya[..xp.len()]);
        (cv.widen)(xp, xa);
        forward_rows::<T::Acc, T::Acc>(xa, ya, (m, r), cols, affine, eps);
        (cv.narrow)(ya, yp);
    }
    T::Acc::put(buf);
}

/// A backward task, inlined like [`run_forward`].
#[inline(always)]
pub(super) fn run_backward<T: NormFloat>(cv: Convert<T>, t: BackwardTask<'_, T>) {
    let BackwardTask {
        dy,
        x,
        mean,
        rstd,
        cols,
        weight,
        dx,
        mut part,
    } = t;
    let stats = Stats { mean, rstd };
    if !T::PANELS {
        return backward_rows::<T, T::Acc>((dy, x), stats, cols, weight, dx, part.as_deref_mut());
    }
    let panel = (PANEL / cols).max(1) * cols;
    let rows_per_panel = panel / cols;
    let mut buf = panels::<T::Acc>(panel);
    let (ga, rest) = buf.split_at_mut(panel);
    let (xa, da) = rest.split_at_mut(panel);
    let mut dx_parts = dx.map(|dx| dx.chunks_mut(panel));
    for (p, (gp, xp)) in dy.chunks(panel).zip(x.chunks(panel)).enumerate() {
        let n = gp.len();
        let (ga, xa, da) = (&mut ga[..n], &mut xa[..n], &mut da[..n]);
        (cv.widen)(gp, ga);
        (cv.widen)(xp, xa);
        let r = p * rows_per_panel..p * rows_per_panel + n / cols;
        let s = Stats {
            mean: &stats.mean[r.clone()],
            rstd: &stats.rstd[r],
        };
        let dx = dx_parts.as_mut().and_then(Iterator::next);
        let want_dx = dx.is_some();
        let out = want_dx.then_some(&mut *da);
        backward_rows::<T::Acc, T::Acc>((ga, xa), s, cols, weight, out, part.as_deref_mut());
        if let Some(dx) = dx {
            (cv.narrow)(da, dx);
        }
    }
    T::Acc::put(buf);
}

/// The sum of `x`, over lanes of 16.
#[inline(always)]
fn sum_of<E: Elem<A>, A: Acc>(x: &[E]) -> A {
    let mut lanes = [A::ZERO; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v.get();
        }
    }
    for (l, &v) in lanes.iter_mut().zip(rest) {
        *l += v.get();
    }
    fold_lanes(lanes)
}

/// The sum of `(x - mean)^2`, over lanes of 16.
#[inline(always)]
fn sq_dev_of<E: Elem<A>, A: Acc>(x: &[E], mean: A) -> A {
    let mut lanes = [A::ZERO; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            let d = v.get() - mean;
            *l += d * d;
        }
    }
    for (l, &v) in lanes.iter_mut().zip(rest) {
        let d = v.get() - mean;
        *l += d * d;
    }
    fold_lanes(lanes)
}

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

#[inline(always)]
fn forward_rows<E: Elem<A>, A: AccType>(
    x: &[E],
    y: &mut [E],
    (mean, rstd): (&mut [A], &mut [A]),
    cols: usize,
    affine: Affine<'_, A>,
    eps: A,
) {
    // Absent parameters as ones and zeros (exact: multiplying by 1 and adding 0 change nothing).
    let ones;
    let w = match affine.weight {
        Some(w) => w,
        None => {
            ones = vec![A::ONE; cols];
            &ones[..]
        }
    };
    let zeros;
    let b = match affine.bias {
        Some(b) => b,
        None => {
            zeros = vec![A::ZERO; cols];
            &zeros[..]
        }
    };
    let n = A::from_usize(cols);
    let rows = x.chunks_exact(cols).zip(y.chunks_exact_mut(cols));
    for ((x, y), (mean, rstd)) in rows.zip(mean.iter_mut().zip(rstd.iter_mut())) {
        let m = sum_of::<E, A>(x) / n;
        let var = sq_dev_of::<E, A>(x, m) / n;
        let r = A::ONE / (var + eps).sqrt();
        *mean = m;
        *rstd = r;
        for (((o, &v), &w), &b) in y.iter_mut().zip(x).zip(w).zip(b) {
            *o = E::set((v.get() - m) * r * w + b);
        }
    }
}

/// `sum(g)` and `sum(g * xhat)` of one row, `g = dy * w`, `xhat = (x - m) * r`, over lanes of
/// 16.
#[inline(always)]
fn row_sums<E: Elem<A>, A: Acc>(g: &[E], x: &[E], w: &[A], (m, r): (A, A)) -> (A, A) {
    let (mut sg, mut sgx) = ([A::ZERO; 16], [A::ZERO; 16]);
    let (gc, xc, wc) = (g.chunks_exact(16), x.chunks_exact(16), w.chunks_exact(16));
    let rest = (gc.remainder(), xc.remainder(), wc.remainder());
    for ((g, x), w) in gc.zip(xc).zip(wc) {
        for i in 0..16 {
            let gw = g[i].get() * w[i];
            sg[i] += gw;
            sgx[i] += gw * ((x[i].get() - m) * r);
        }
    }
    for (i, ((&g, &x), &w)) in rest.0.iter().zip(rest.1).zip(rest.2).enumerate() {
        let gw = g.get() * w;
        sg[i] += gw;
        sgx[i] += gw * ((x.get() - m) * r);
    }
    (fold_lanes(sg), fold_lanes(sgx))
}

/// Per row: `sum(g)` and `sum(g * xhat)` (pass 1), then `dx` (pass 2, from cache); `dw += dy *
/// xhat` and `db += dy` into `part` (`dw` then `db`, `2 * cols`).
#[inline(always)]
fn backward_rows<E: Elem<A>, A: AccType>(
    (dy, x): (&[E], &[E]),
    stats: Stats<'_, A>,
    cols: usize,
    weight: Option<&[A]>,
    mut dx: Option<&mut [E]>,
    mut part: Option<&mut [A]>,
) {
    let ones;
    let w = match weight {
        Some(w) => w,
        None => {
            ones = vec![A::ONE; cols];
            &ones[..]
        }
    };
    let n = A::from_usize(cols);
    let rows = dy.chunks_exact(cols).zip(x.chunks_exact(cols));
    for (i, (g, x)) in rows.enumerate() {
        let (m, r) = (stats.mean[i], stats.rstd[i]);
        if let Some(dx) = dx.as_deref_mut() {
            let dx = &mut dx[i * cols..(i + 1) * cols];
            let (sg, sgx) = row_sums::<E, A>(g, x, w, (m, r));
            let (mean_g, mean_gx) = (sg / n, sgx / n);
            for (((o, &gv), &xv), &w) in dx.iter_mut().zip(g).zip(x).zip(w) {
                let xhat = (xv.get() - m) * r;
                *o = E::set(r * (gv.get() * w - mean_g - xhat * mean_gx));
            }
        }
        if let Some(part) = part.as_deref_mut() {
            let (pw, pb) = part.split_at_mut(cols);
            for ((pw, pb), (&gv, &xv)) in pw.iter_mut().zip(pb.iter_mut()).zip(g.iter().zip(x)) {
                let gv = gv.get();
                *pw += gv * ((xv.get() - m) * r);
                *pb += gv;
            }
        }
    }
}
