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
//!
//! Here: the calls, cut into parallel tasks, and their dispatch; `tasks`: one task run (f16
//! panels included); `rows` and `columns`: the loops.

mod columns;
mod rows;
mod tasks;

use self::tasks::{run_backward, run_forward};
use crate::blocks;
pub use crate::elem::{AccType, DirectFloat as SoftmaxFloat, Elem, PanelBuffer};
use crate::float::Float;
use crate::ops::convert::Convert;
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

/// Elements of a row reduced at a time (blocks of the running maximum).
const BLOCK: usize = 256;
/// Columns computed together when `inner > 1`.
pub const TILE: usize = 64;
/// Work per parallel task, in elements (rows are never split).
const TASK_ELEMS: usize = 1 << 15;
/// Elements of 16-bit rows widened at a time (whole rows: one row when longer).
const PANEL: usize = 1 << 14;

/// One parallel task's share of a forward call.
enum ForwardTask<'a, T: Float> {
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
enum BackwardTask<'a, T: Float> {
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
    use super::tasks::{run_backward, run_forward};
    use super::{BackwardTask, ForwardTask, Kind, SoftmaxFloat};
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
