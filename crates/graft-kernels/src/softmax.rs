//! Softmax and log-softmax over one dim of a contiguous tensor, forward and backward, with the
//! semantics of ATen's `_softmax` / `_log_softmax` and their `_backward_data` ops.
//!
//! The tensor is seen as `outer x dim x inner` (row-major): the reduction runs over `dim`, whose
//! elements lie `inner` apart. Arithmetic happens in the accumulation type (`f32`, `f64` for
//! `f64`); 16-bit values are widened a block at a time with the vectorized conversions.
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
use crate::dispatch::kernels;
use crate::exp::VecExp;
use crate::float::{Acc, Float};
use crate::parallel::Parallel;

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

/// Element types the kernels accept.
pub trait SoftmaxFloat: Float<Acc: VecExp> {}
impl<T: Float<Acc: VecExp>> SoftmaxFloat for T {}

/// Elements widened at a time (stack buffers of the accumulation type).
const BLOCK: usize = 256;
/// Columns computed together when `inner > 1`.
pub const TILE: usize = 64;
/// Work per parallel task, in elements (rows and tiles are never split).
const TASK_ELEMS: usize = 1 << 15;

/// The conversions between `T` and its accumulation type, looked up once per call.
#[derive(Clone, Copy)]
pub(crate) struct Convert<T: Float> {
    widen: fn(&[T], &mut [T::Acc]),
    narrow: fn(&[T::Acc], &mut [T]),
}

impl<T: Float> Convert<T> {
    fn new() -> Self {
        let k = kernels::<T>();
        Convert {
            widen: k.widen,
            narrow: k.narrow,
        }
    }
}

/// One parallel task's share of a forward call.
pub(crate) enum ForwardTask<'a, T: Float> {
    /// Whole rows (`inner == 1`): `x` and `y` hold `y.len() / dim` rows.
    Rows {
        x: &'a [T],
        y: &'a mut [T],
        dim: usize,
    },
    /// A tile of columns: `x` is the whole `dim x inner` slab of one outer index, `y` the
    /// tile's `dim` segments, `first` the tile's first column.
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
    /// A tile of columns, as in [`ForwardTask::Columns`].
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
        let (tiles, width) = column_tiles(shape);
        blocks::for_each(par, tiles_of(y, shape, width), shape.dim * width, |i, y| {
            let (o, t) = (i / tiles, i % tiles);
            let slab = shape.dim * shape.inner;
            let x = &x[o * slab..(o + 1) * slab];
            let task = ForwardTask::Columns {
                x,
                y,
                inner: shape.inner,
                first: t * width,
            };
            dispatch_forward(kind, cv, task);
        });
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
        let (tiles, width) = column_tiles(shape);
        blocks::for_each(par, tiles_of(dx, shape, width), shape.dim * width, |i, dx| {
            let (o, t) = (i / tiles, i % tiles);
            let slab = shape.dim * shape.inner;
            let task = BackwardTask::Columns {
                dy: &dy[o * slab..(o + 1) * slab],
                y: &y[o * slab..(o + 1) * slab],
                dx,
                inner: shape.inner,
                first: t * width,
            };
            dispatch_backward(kind, cv, task);
        });
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

/// (tiles per outer index, columns per tile): tiles of whole [`TILE`]s, wide enough that a
/// task gets about [`TASK_ELEMS`] elements.
fn column_tiles(shape: Shape) -> (usize, usize) {
    let want = (TASK_ELEMS / shape.dim.max(1)).max(TILE);
    let width = want.div_ceil(TILE) * TILE;
    let width = width.min(shape.inner);
    (shape.inner.div_ceil(width), width)
}

/// `out` cut into the `dim` segments of each (outer index, tile), in (outer, tile) order.
fn tiles_of<T>(out: &mut [T], shape: Shape, width: usize) -> Vec<Vec<&mut [T]>> {
    let tiles = shape.inner.div_ceil(width);
    let mut groups: Vec<Vec<&mut [T]>> = (0..shape.outer * tiles)
        .map(|_| Vec::with_capacity(shape.dim))
        .collect();
    for (r, row) in out.chunks_mut(shape.inner).enumerate() {
        let o = r / shape.dim;
        for (t, seg) in row.chunks_mut(width).enumerate() {
            groups[o * tiles + t].push(seg);
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
                    return token.softmax_forward(kind, cv, task);
                }
            }
            Isa::Avx2 => {
                if let Some(token) = crate::simd::x86::Avx2::detect() {
                    return token.softmax_forward(kind, cv, task);
                }
            }
            Isa::Portable => {}
        }
    }
    run_forward(kind, cv, task)
}

fn dispatch_backward<T: SoftmaxFloat>(kind: Kind, cv: Convert<T>, task: BackwardTask<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Isa;
        match Isa::current() {
            Isa::Avx512 => {
                if let Some(token) = crate::simd::x86::Avx512::detect() {
                    return token.softmax_backward(kind, cv, task);
                }
            }
            Isa::Avx2 => {
                if let Some(token) = crate::simd::x86::Avx2::detect() {
                    return token.softmax_backward(kind, cv, task);
                }
            }
            Isa::Portable => {}
        }
    }
    run_backward(kind, cv, task)
}

/// A forward task; inlined into the instruction-set entry points (simd/x86.rs) so that its
/// loops vectorize there.
#[inline(always)]
pub(crate) fn run_forward<T: SoftmaxFloat>(kind: Kind, cv: Convert<T>, task: ForwardTask<'_, T>) {
    match task {
        ForwardTask::Rows { x, y, dim } => {
            let mut scratch = Scratch::default();
            for (x, y) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
                forward_row(kind, cv, x, y, &mut scratch);
            }
        }
        ForwardTask::Columns {
            x,
            mut y,
            inner,
            first,
        } => {
            let mut exps = Vec::new();
            let width = y.first().map_or(0, |s| s.len());
            for start in (0..width).step_by(TILE) {
                let place = (first + start, start);
                forward_tile(kind, cv, x, &mut y[..], inner, place, &mut exps);
            }
        }
    }
}

/// A backward task, inlined like [`run_forward`].
#[inline(always)]
pub(crate) fn run_backward<T: SoftmaxFloat>(
    kind: Kind,
    cv: Convert<T>,
    task: BackwardTask<'_, T>,
) {
    match task {
        BackwardTask::Rows { dy, y, dx, dim } => {
            let rows = dy.chunks_exact(dim).zip(y.chunks_exact(dim));
            for ((dy, y), dx) in rows.zip(dx.chunks_exact_mut(dim)) {
                backward_row(kind, cv, dy, y, dx);
            }
        }
        BackwardTask::Columns {
            dy,
            y,
            mut dx,
            inner,
            first,
        } => {
            let width = dx.first().map_or(0, |s| s.len());
            for start in (0..width).step_by(TILE) {
                backward_tile(kind, cv, (dy, y), &mut dx[..], inner, (first + start, start));
            }
        }
    }
}

/// Buffers a task reuses from row to row.
#[derive(Default)]
struct Scratch<A> {
    /// A row's exponentials (softmax).
    exps: Vec<A>,
    /// The running maximum each block's exponentials were taken against.
    block_max: Vec<A>,
}

/// `max(m, buf)`, vectorized over lanes of 16.
#[inline(always)]
fn max_of<A: VecExp>(m: A, buf: &[A]) -> A {
    let mut lanes = [A::NEG_INFINITY; 16];
    let chunks = buf.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max_of(v);
        }
    }
    for &v in rest {
        lanes[0] = lanes[0].max_of(v);
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
    let mut w = 16;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            lanes[i] = lanes[i] + lanes[i + w];
        }
    }
    lanes[0]
}

/// `exp(v - m)`, with -inf giving 0 also when `m` is -inf (no finite element seen yet).
#[inline(always)]
fn exp_shift<A: VecExp>(v: A, m: A) -> A {
    let e = (v - m).exp();
    if v == A::NEG_INFINITY {
        A::ZERO
    } else {
        e
    }
}

#[inline(always)]
fn forward_row<T: SoftmaxFloat>(
    kind: Kind,
    cv: Convert<T>,
    x: &[T],
    y: &mut [T],
    scratch: &mut Scratch<T::Acc>,
) {
    let zero = T::Acc::ZERO;
    let mut buf = [zero; BLOCK];
    let softmax = kind == Kind::Softmax;
    if softmax {
        scratch.exps.resize(x.len(), zero);
        scratch.block_max.clear();
    }
    // Pass 1: the maximum and the sum of exponentials in one read, rescaling the sum when a
    // block raises the maximum.
    let (mut m, mut s) = (T::Acc::NEG_INFINITY, zero);
    for (b, xb) in x.chunks(BLOCK).enumerate() {
        let buf = &mut buf[..xb.len()];
        (cv.widen)(xb, buf);
        let bm = max_of(m, buf);
        if bm > m {
            s = s * (m - bm).exp();
            m = bm;
        }
        for v in buf.iter_mut() {
            *v = exp_shift(*v, m);
        }
        s += sum_of(buf);
        if softmax {
            scratch.exps[b * BLOCK..b * BLOCK + xb.len()].copy_from_slice(buf);
            scratch.block_max.push(m);
        }
    }
    if m == T::Acc::INFINITY {
        // +inf: ATen's exp(inf - inf) makes the sum NaN.
        s = T::Acc::NAN;
    }
    // Pass 2: the outputs.
    if softmax {
        for (b, yb) in y.chunks_mut(BLOCK).enumerate() {
            let c = (scratch.block_max[b] - m).exp() / s;
            let out = &mut buf[..yb.len()];
            let exps = &scratch.exps[b * BLOCK..b * BLOCK + yb.len()];
            for (o, &e) in out.iter_mut().zip(exps) {
                *o = e * c;
            }
            (cv.narrow)(out, yb);
        }
    } else {
        let log_sum = s.ln();
        for (xb, yb) in x.chunks(BLOCK).zip(y.chunks_mut(BLOCK)) {
            let b = &mut buf[..xb.len()];
            (cv.widen)(xb, b);
            for v in b.iter_mut() {
                *v = (*v - m) - log_sum;
            }
            (cv.narrow)(b, yb);
        }
    }
}

#[inline(always)]
fn backward_row<T: SoftmaxFloat>(kind: Kind, cv: Convert<T>, dy: &[T], y: &[T], dx: &mut [T]) {
    let zero = T::Acc::ZERO;
    let (mut gb, mut yb) = ([zero; BLOCK], [zero; BLOCK]);
    // Pass 1: sum(dy * y) or sum(dy).
    let mut total = zero;
    for (g, o) in dy.chunks(BLOCK).zip(y.chunks(BLOCK)) {
        let n = g.len();
        let g_acc = &mut gb[..n];
        (cv.widen)(g, g_acc);
        if kind == Kind::Softmax {
            let y_acc = &mut yb[..n];
            (cv.widen)(o, y_acc);
            for (gv, &yv) in g_acc.iter_mut().zip(y_acc.iter()) {
                *gv = *gv * yv;
            }
        }
        total += sum_of(g_acc);
    }
    // Pass 2: dx.
    for ((g, o), d) in dy.chunks(BLOCK).zip(y.chunks(BLOCK)).zip(dx.chunks_mut(BLOCK)) {
        let n = g.len();
        let (g_acc, y_acc) = (&mut gb[..n], &mut yb[..n]);
        (cv.widen)(g, g_acc);
        (cv.widen)(o, y_acc);
        match kind {
            Kind::Softmax => {
                for (gv, &yv) in g_acc.iter_mut().zip(y_acc.iter()) {
                    *gv = yv * (*gv - total);
                }
            }
            Kind::LogSoftmax => {
                for (gv, &yv) in g_acc.iter_mut().zip(y_acc.iter()) {
                    *gv = *gv - yv.exp() * total;
                }
            }
        }
        (cv.narrow)(g_acc, d);
    }
}

/// Columns `col .. col + TILE` (or fewer at the edge) of one outer slab: `x` is the slab
/// (`dim x inner`), `y` its output segments (one per `d`, `at` being the tile's offset inside
/// each segment).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn forward_tile<T: SoftmaxFloat>(
    kind: Kind,
    cv: Convert<T>,
    x: &[T],
    y: &mut [&mut [T]],
    inner: usize,
    (col, at): (usize, usize),
    exps: &mut Vec<T::Acc>,
) {
    let dim = y.len();
    let w = (inner - col).min(TILE).min(y[0].len() - at);
    let zero = T::Acc::ZERO;
    let mut buf = [zero; TILE];
    let buf = &mut buf[..w];
    let seg = |d: usize| &x[d * inner + col..d * inner + col + w];
    // Pass 1: column maxima.
    let mut m = [T::Acc::NEG_INFINITY; TILE];
    let m = &mut m[..w];
    for d in 0..dim {
        (cv.widen)(seg(d), buf);
        for (mv, &v) in m.iter_mut().zip(buf.iter()) {
            *mv = mv.max_of(v);
        }
    }
    // Pass 2: column sums of exponentials (softmax keeps the exponentials).
    let mut s = [zero; TILE];
    let s = &mut s[..w];
    let softmax = kind == Kind::Softmax;
    if softmax {
        exps.resize(dim * w, zero);
    }
    for d in 0..dim {
        (cv.widen)(seg(d), buf);
        for (v, &mv) in buf.iter_mut().zip(m.iter()) {
            *v = exp_shift(*v, mv);
        }
        for (sv, &e) in s.iter_mut().zip(buf.iter()) {
            *sv += e;
        }
        if softmax {
            exps[d * w..(d + 1) * w].copy_from_slice(buf);
        }
    }
    for (sv, &mv) in s.iter_mut().zip(m.iter()) {
        if mv == T::Acc::INFINITY {
            // ATen's exp(inf - inf) makes the sum NaN.
            *sv = T::Acc::NAN;
        }
    }
    // Pass 3: the outputs.
    if softmax {
        let mut inv = [zero; TILE];
        for (i, &sv) in inv.iter_mut().zip(s.iter()) {
            *i = T::Acc::ONE / sv;
        }
        for (d, out) in y.iter_mut().enumerate() {
            let e = &exps[d * w..(d + 1) * w];
            for ((v, &e), &i) in buf.iter_mut().zip(e).zip(inv.iter()) {
                *v = e * i;
            }
            (cv.narrow)(buf, &mut out[at..at + w]);
        }
    } else {
        let mut log_sum = [zero; TILE];
        for (l, &sv) in log_sum.iter_mut().zip(s.iter()) {
            *l = sv.ln();
        }
        for (d, out) in y.iter_mut().enumerate() {
            (cv.widen)(seg(d), buf);
            for ((v, &mv), &l) in buf.iter_mut().zip(m.iter()).zip(log_sum.iter()) {
                *v = (*v - mv) - l;
            }
            (cv.narrow)(buf, &mut out[at..at + w]);
        }
    }
}

#[inline(always)]
fn backward_tile<T: SoftmaxFloat>(
    kind: Kind,
    cv: Convert<T>,
    (dy, y): (&[T], &[T]),
    dx: &mut [&mut [T]],
    inner: usize,
    (col, at): (usize, usize),
) {
    let dim = dx.len();
    let w = (inner - col).min(TILE).min(dx[0].len() - at);
    let zero = T::Acc::ZERO;
    let (mut gb, mut yb) = ([zero; TILE], [zero; TILE]);
    let (gb, yb) = (&mut gb[..w], &mut yb[..w]);
    let range = |d: usize| d * inner + col..d * inner + col + w;
    let mut total = [zero; TILE];
    let total = &mut total[..w];
    for d in 0..dim {
        (cv.widen)(&dy[range(d)], gb);
        if kind == Kind::Softmax {
            (cv.widen)(&y[range(d)], yb);
            for ((t, &g), &o) in total.iter_mut().zip(gb.iter()).zip(yb.iter()) {
                *t += g * o;
            }
        } else {
            for (t, &g) in total.iter_mut().zip(gb.iter()) {
                *t += g;
            }
        }
    }
    for (d, out) in dx.iter_mut().enumerate() {
        (cv.widen)(&dy[range(d)], gb);
        (cv.widen)(&y[range(d)], yb);
        match kind {
            Kind::Softmax => {
                for ((g, &o), &t) in gb.iter_mut().zip(yb.iter()).zip(total.iter()) {
                    *g = o * (*g - t);
                }
            }
            Kind::LogSoftmax => {
                for ((g, &o), &t) in gb.iter_mut().zip(yb.iter()).zip(total.iter()) {
                    *g = *g - o.exp() * t;
                }
            }
        }
        (cv.narrow)(gb, &mut out[at..at + w]);
    }
}
