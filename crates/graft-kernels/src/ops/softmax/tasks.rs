//! A parallel task's share of a call, run: whole rows or a range of columns, read and written
//! directly or (f16) through accumulation-type panels.

use super::columns::{backward_cols, forward_cols, Cols};
use super::rows::{backward_rows, forward_rows};
use super::{BackwardTask, ForwardTask, Kind, SoftmaxFloat, PANEL};
use crate::elem::{panels, PanelBuffer};
use crate::ops::convert::Convert;

/// A forward task; inlined into the instruction-set entry points (`super::x86`) so that its
/// loops vectorize there (with `FMA`: fused multiply-adds in the exponentials). No closure
/// below takes part in a hot loop: a closure is compiled on its own, without the entry
/// point's instruction set.
#[inline(always)]
pub(super) fn run_forward<T: SoftmaxFloat, const FMA: bool>(
    kind: Kind,
    cv: Convert<T>,
    task: ForwardTask<'_, T>,
) {
    let mut block_max = Vec::new();
    match task {
        ForwardTask::Rows { x, y, dim } if !T::PANELS => {
            forward_rows::<T, T::Acc, FMA>(kind, x, y, dim, &mut block_max);
        }
        ForwardTask::Rows { x, y, dim } => {
            // Panels of whole rows, widened once and narrowed once.
            let panel = (PANEL / dim).max(1) * dim;
            let mut buf = panels::<T::Acc>(panel);
            let (xa, rest) = buf.split_at_mut(panel);
            let ya = &mut rest[..panel];
            for (xp, yp) in x.chunks(panel).zip(y.chunks_mut(panel)) {
                let (xa, ya) = (&mut xa[..xp.len()], &mut ya[..xp.len()]);
                (cv.widen)(xp, xa);
                forward_rows::<T::Acc, T::Acc, FMA>(kind, xa, ya, dim, &mut block_max);
                (cv.narrow)(ya, yp);
            }
            T::Acc::put(buf);
        }
        ForwardTask::Columns {
            x,
            mut y,
            inner,
            first,
        } if !T::PANELS => {
            let cols = Cols {
                x,
                stride: inner,
                first,
            };
            forward_cols::<T, T::Acc, FMA>(kind, cols, &mut y);
        }
        ForwardTask::Columns {
            x,
            mut y,
            inner,
            first,
        } => {
            // The range's columns gathered into a dim x width panel.
            let (dim, width) = (y.len(), y.first().map_or(0, |s| s.len()));
            let n = dim * width;
            let mut buf = panels::<T::Acc>(n);
            let (xa, rest) = buf.split_at_mut(n);
            let ya = &mut rest[..n];
            for (d, xr) in xa.chunks_mut(width).enumerate() {
                (cv.widen)(&x[d * inner + first..d * inner + first + width], xr);
            }
            let mut segs: Vec<&mut [T::Acc]> = ya.chunks_mut(width).collect();
            let cols = Cols {
                x: &*xa,
                stride: width,
                first: 0,
            };
            forward_cols::<T::Acc, T::Acc, FMA>(kind, cols, &mut segs);
            for (yr, seg) in ya.chunks(width).zip(y.iter_mut()) {
                (cv.narrow)(yr, seg);
            }
            T::Acc::put(buf);
        }
    }
}

/// A backward task, inlined like [`run_forward`].
#[inline(always)]
pub(super) fn run_backward<T: SoftmaxFloat, const FMA: bool>(
    kind: Kind,
    cv: Convert<T>,
    task: BackwardTask<'_, T>,
) {
    match task {
        BackwardTask::Rows { dy, y, dx, dim } if !T::PANELS => {
            backward_rows::<T, T::Acc, FMA>(kind, dy, y, dx, dim);
        }
        BackwardTask::Rows { dy, y, dx, dim } => {
            let panel = (PANEL / dim).max(1) * dim;
            let mut buf = panels::<T::Acc>(panel);
            let (ga, rest) = buf.split_at_mut(panel);
            let (ya, da) = rest.split_at_mut(panel);
            let parts = dy
                .chunks(panel)
                .zip(y.chunks(panel))
                .zip(dx.chunks_mut(panel));
            for ((gp, yp), dp) in parts {
                let n = gp.len();
                let (ga, ya, da) = (&mut ga[..n], &mut ya[..n], &mut da[..n]);
                (cv.widen)(gp, ga);
                (cv.widen)(yp, ya);
                backward_rows::<T::Acc, T::Acc, FMA>(kind, ga, ya, da, dim);
                (cv.narrow)(da, dp);
            }
            T::Acc::put(buf);
        }
        BackwardTask::Columns {
            dy,
            y,
            mut dx,
            inner,
            first,
        } if !T::PANELS => {
            let g = Cols {
                x: dy,
                stride: inner,
                first,
            };
            backward_cols::<T, T::Acc, FMA>(kind, g, Cols { x: y, ..g }, &mut dx);
        }
        BackwardTask::Columns {
            dy,
            y,
            mut dx,
            inner,
            first,
        } => {
            let (dim, width) = (dx.len(), dx.first().map_or(0, |s| s.len()));
            let n = dim * width;
            let mut buf = panels::<T::Acc>(n);
            let (ga, rest) = buf.split_at_mut(n);
            let (ya, da) = rest.split_at_mut(n);
            let da = &mut da[..n];
            for (d, (gr, yr)) in ga.chunks_mut(width).zip(ya.chunks_mut(width)).enumerate() {
                let at = d * inner + first;
                (cv.widen)(&dy[at..at + width], gr);
                (cv.widen)(&y[at..at + width], yr);
            }
            let mut segs: Vec<&mut [T::Acc]> = da.chunks_mut(width).collect();
            let g = Cols {
                x: &*ga,
                stride: width,
                first: 0,
            };
            backward_cols::<T::Acc, T::Acc, FMA>(kind, g, Cols { x: &*ya, ..g }, &mut segs);
            for (dr, seg) in da.chunks(width).zip(dx.iter_mut()) {
                (cv.narrow)(dr, seg);
            }
            T::Acc::put(buf);
        }
    }
}
