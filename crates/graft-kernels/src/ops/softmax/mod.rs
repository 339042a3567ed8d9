//! Softmax and log-softmax over one dim of a contiguous tensor, forward and backward, with the
//! semantics of ATen's `_softmax` / `_log_softmax` and their `_backward_data` ops.
//!
//! The tensor is seen as `outer x dim x inner` (row-major): the reduction runs over `dim`, whose
//! elements lie `inner` apart. Arithmetic happens in the accumulation type (`f32`, `f64` for
//! `f64`). `f32`, `f64` and `bf16` values are read and written directly (a bf16 converts with
//! a shift and a rounding that vectorize); `f16` values are widened a panel at a time (several
//! short rows, one long row, or a task's columns) with F16C, and the results narrowed back.
//!
//! - Forward, `inner == 1` (rows): one pass reads the row once, keeping a running maximum per
//!   block and rescaling the running sum when it grows (so each element costs one `exp`); a
//!   second pass writes the outputs (softmax from the exponentials kept in a row-long scratch,
//!   log-softmax from the input, now in cache).
//! - Forward, `inner > 1` (columns): tiles of up to [`TILE`] adjacent columns, vectorized across
//!   them: maxima, then sums of exponentials (kept for softmax), then the outputs.
//! - Backward: a reduction (`sum(dy * y)` for softmax, `sum(dy)` for log-softmax), then
//!   `dx = y * (dy - sum)` or `dx = dy - exp(y) * sum`.
//!
//! Special values follow ATen: a row holding NaN or +inf, or only -inf, comes out all NaN;
//! -inf elements of other rows give 0 (softmax) / -inf (log-softmax).

use crate::blocks;
use crate::exp::VecExp;
use crate::float::{Acc, Float};
use crate::parallel::Parallel;

use crate::elem::panels;
pub use crate::elem::{AccType, DirectFloat as SoftmaxFloat, Elem, PanelBuffer};
use crate::ops::convert::Convert;

/// Softmax or log-softmax.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `exp(x - max) / sum(exp(x - max))`.
    Softmax,
    /// `x - max - log(sum(exp(x - max)))`.
    LogSoftmax,
}

/// A contiguous tensor as `outer x dim x inner`, reduced over `dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Product of the sizes before the reduced dim.
    pub outer: usize,
    /// Size of the reduced dim.
    pub dim: usize,
    /// Product of the sizes after it (the stride of the reduced dim).
    pub inner: usize,
}

impl Shape {
    fn numel(&self) -> Option<usize> {
        self.outer.checked_mul(self.dim)?.checked_mul(self.inner)
    }
}

/// Elements of a row reduced at a time (blocks of the running maximum).
const BLOCK: usize = 256;
/// Columns computed together when `inner > 1`.
pub const TILE: usize = 64;
/// Work per parallel task, in elements (rows are never split).
const TASK_ELEMS: usize = 1 << 15;
/// Elements of 16-bit rows widened at a time (whole rows: one row when longer).
const PANEL: usize = 1 << 14;

/// One parallel task's share of a forward call.
pub(crate) enum ForwardTask<'a, T: Float> {
    /// Whole rows (`inner == 1`): `x` and `y` hold `y.len() / dim` rows.
    Rows {
        x: &'a [T],
        y: &'a mut [T],
        dim: usize,
    },
    /// A range of columns: `x` is the whole `dim x inner` slab of one outer index, `y` the
    /// range's `dim` segments, `first` its first column.
    Columns {
        x: &'a [T],
        y: Vec<&'a mut [T]>,
        inner: usize,
        first: usize,
    },
}

/// One parallel task's share of a backward call.
pub(crate) enum BackwardTask<'a, T: Float> {
    /// Whole rows.
    Rows {
        dy: &'a [T],
        y: &'a [T],
        dx: &'a mut [T],
        dim: usize,
    },
    /// A range of columns, as in [`ForwardTask::Columns`].
    Columns {
        dy: &'a [T],
        y: &'a [T],
        dx: Vec<&'a mut [T]>,
        inner: usize,
        first: usize,
    },
}

/// The forward output `y` of `x` (both `outer * dim * inner` elements).
///
/// # Panics
/// If a slice's length does not match `shape`.
pub fn forward<T: SoftmaxFloat>(
    kind: Kind,
    x: &[T],
    y: &mut [T],
    shape: Shape,
    par: &dyn Parallel,
) {
    let n = check_len("softmax::forward", shape, &[("x", x.len()), ("y", y.len())]);
    if n == 0 {
        return;
    }
    let cv = Convert::<T>::new();
    if shape.inner == 1 {
        let dim = shape.dim;
        let rows_per_task = (TASK_ELEMS / dim).max(1);
        let pieces: Vec<&mut [T]> = y.chunks_mut(rows_per_task * dim).collect();
        blocks::for_each(par, pieces, rows_per_task * dim, |i, y| {
            let at = i * rows_per_task * dim;
            let x = &x[at..at + y.len()];
            dispatch_forward(kind, cv, ForwardTask::Rows { x, y, dim });
        });
    } else {
        let (ranges, width) = column_ranges(shape);
        blocks::for_each(
            par,
            ranges_of(y, shape, width),
            shape.dim * width,
            |i, y| {
                let (o, r) = (i / ranges, i % ranges);
                let slab = shape.dim * shape.inner;
                let task = ForwardTask::Columns {
                    x: &x[o * slab..(o + 1) * slab],
                    y,
                    inner: shape.inner,
                    first: r * width,
                };
                dispatch_forward(kind, cv, task);
            },
        );
    }
}

/// The gradient `dx` of the input from `dy` and the forward output `y` (all
/// `outer * dim * inner` elements).
///
/// # Panics
/// If a slice's length does not match `shape`.
pub fn backward<T: SoftmaxFloat>(
    kind: Kind,
    dy: &[T],
    y: &[T],
    dx: &mut [T],
    shape: Shape,
    par: &dyn Parallel,
) {
    let n = check_len(
        "softmax::backward",
        shape,
        &[("dy", dy.len()), ("y", y.len()), ("dx", dx.len())],
    );
    if n == 0 {
        return;
    }
    let cv = Convert::<T>::new();
    if shape.inner == 1 {
        let dim = shape.dim;
        let rows_per_task = (TASK_ELEMS / dim).max(1);
        let pieces: Vec<&mut [T]> = dx.chunks_mut(rows_per_task * dim).collect();
        blocks::for_each(par, pieces, rows_per_task * dim, |i, dx| {
            let at = i * rows_per_task * dim;
            let (dy, y) = (&dy[at..at + dx.len()], &y[at..at + dx.len()]);
            dispatch_backward(kind, cv, BackwardTask::Rows { dy, y, dx, dim });
        });
    } else {
        let (ranges, width) = column_ranges(shape);
        blocks::for_each(
            par,
            ranges_of(dx, shape, width),
            shape.dim * width,
            |i, dx| {
                let (o, r) = (i / ranges, i % ranges);
                let slab = shape.dim * shape.inner;
                let task = BackwardTask::Columns {
                    dy: &dy[o * slab..(o + 1) * slab],
                    y: &y[o * slab..(o + 1) * slab],
                    dx,
                    inner: shape.inner,
                    first: r * width,
                };
                dispatch_backward(kind, cv, task);
            },
        );
    }
}

#[track_caller]
fn check_len(func: &str, shape: Shape, lens: &[(&str, usize)]) -> usize {
    let n = shape
        .numel()
        .unwrap_or_else(|| panic!("{func}: {shape:?} overflows usize"));
    for (name, len) in lens {
        assert_eq!(*len, n, "{func}: {name} has {len} elements, expected {n}");
    }
    n
}

/// (column ranges per outer index, columns per range): whole [`TILE`]s, wide enough that a
/// task gets about [`TASK_ELEMS`] elements.
fn column_ranges(shape: Shape) -> (usize, usize) {
    let want = (TASK_ELEMS / shape.dim.max(1)).max(TILE);
    let width = (want.div_ceil(TILE) * TILE).min(shape.inner);
    (shape.inner.div_ceil(width), width)
}

/// `out` cut into the `dim` segments of each (outer index, column range), in that order.
fn ranges_of<T>(out: &mut [T], shape: Shape, width: usize) -> Vec<Vec<&mut [T]>> {
    let ranges = shape.inner.div_ceil(width);
    let mut groups: Vec<Vec<&mut [T]>> = (0..shape.outer * ranges)
        .map(|_| Vec::with_capacity(shape.dim))
        .collect();
    for (r, row) in out.chunks_mut(shape.inner).enumerate() {
        let o = r / shape.dim;
        for (t, seg) in row.chunks_mut(width).enumerate() {
            groups[o * ranges + t].push(seg);
        }
    }
    groups
}

fn dispatch_forward<T: SoftmaxFloat>(kind: Kind, cv: Convert<T>, task: ForwardTask<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Isa;
        match Isa::current() {
            Isa::Avx512 => {
                if let Some(token) = crate::simd::x86::Avx512::detect() {
                    return x86::avx512::forward(token, kind, cv, task);
                }
            }
            Isa::Avx2 => {
                if let Some(token) = crate::simd::x86::Avx2::detect() {
                    return x86::avx2::forward(token, kind, cv, task);
                }
            }
            Isa::Portable => {}
        }
    }
    run_forward::<T, false>(kind, cv, task)
}

fn dispatch_backward<T: SoftmaxFloat>(kind: Kind, cv: Convert<T>, task: BackwardTask<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Isa;
        match Isa::current() {
            Isa::Avx512 => {
                if let Some(token) = crate::simd::x86::Avx512::detect() {
                    return x86::avx512::backward(token, kind, cv, task);
                }
            }
            Isa::Avx2 => {
                if let Some(token) = crate::simd::x86::Avx2::detect() {
                    return x86::avx2::backward(token, kind, cv, task);
                }
            }
            Isa::Portable => {}
        }
    }
    run_backward::<T, false>(kind, cv, task)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{run_backward, run_forward, BackwardTask, ForwardTask, Kind, SoftmaxFloat};
    use crate::ops::convert::Convert;

    crate::vectorize::x86_entry_points! { [avx2, avx512]
        /// [`run_forward`] compiled for this token's features (exponentials with FMA).
        fn forward<T>(_: S, kind: Kind, cv: Convert<T>, task: ForwardTask<'_, T>)
        where [T: SoftmaxFloat]
        { run_forward::<T, true>(kind, cv, task) }

        /// [`run_backward`] compiled for this token's features (exponentials with FMA).
        fn backward<T>(_: S, kind: Kind, cv: Convert<T>, task: BackwardTask<'_, T>)
        where [T: SoftmaxFloat]
        { run_backward::<T, true>(kind, cv, task) }
    }
}

/// A forward task; inlined into the instruction-set entry points (`x86`) so that its
/// loops vectorize there (with `FMA`: fused multiply-adds in the exponentials). No closure
/// below takes part in a hot loop: a closure is compiled on its own, without the entry
/// point's instruction set.
#[inline(always)]
pub(crate) fn run_forward<T: SoftmaxFloat, const FMA: bool>(
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
pub(crate) fn run_backward<T: SoftmaxFloat, const FMA: bool>(
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

/// Columns `first ..` of a `dim x stride` row-major panel.
struct Cols<'a, E> {
    x: &'a [E],
    stride: usize,
    first: usize,
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
fn exp_shift<A: VecExp, const FMA: bool>(v: A, m: A) -> A {
    let e = (v - m).exp::<FMA>();
    if v == A::NEG_INFINITY {
        A::ZERO
    } else {
        e
    }
}

/// Forward rows of `dim` values.
#[inline(always)]
fn forward_rows<E: Elem<A>, A: AccType, const FMA: bool>(
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
fn backward_rows<E: Elem<A>, A: VecExp, const FMA: bool>(
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

/// Forward over a range of columns, [`TILE`] at a time: maxima, then sums of exponentials
/// (kept for softmax), then the outputs, each vectorized across the tile's columns.
#[inline(always)]
fn forward_cols<E: Elem<A>, A: AccType, const FMA: bool>(
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
fn backward_cols<E: Elem<A>, A: VecExp, const FMA: bool>(
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
