//! LayerNorm over the last dimension of a contiguous row-major `rows x cols` buffer, forward and
//! backward, with the semantics of ATen's `native_layer_norm` / `native_layer_norm_backward`:
//!
//! - forward: `mean = sum(x) / cols`, `var = sum((x - mean)^2) / cols` (two passes over the row,
//!   the second from cache), `rstd = 1 / sqrt(var + eps)`, `y = (x - mean) * rstd * w + b`;
//! - backward: `xhat = (x - mean) * rstd`, `g = dy * w`,
//!   `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`, `dw = sum(dy * xhat)`, `db = sum(dy)`
//!   over rows (deterministic: rows summed in fixed blocks, then the blocks in order).
//!
//! Arithmetic in the accumulation type; element access as [`crate::elem`] describes.
//!
//! Here: the calls, cut into parallel tasks, and their dispatch; `rows`: one task run (f16
//! panels included) and the row loops.

mod rows;

use self::rows::{run_backward, run_forward};
use crate::blocks;
use crate::float::Acc;
use crate::ops::convert::Convert;
use crate::parallel::Parallel;

/// Element types the kernels accept.
pub use crate::elem::DirectFloat as NormFloat;

/// Forward work per task, in elements (rows are never split).
const FORWARD_BLOCK_ELEMS: usize = 1 << 14;
/// Backward blocks per call at most: one partial of `dw` and `db` (`cols` values each) each.
const BACKWARD_MAX_BLOCKS: usize = 32;
/// Backward work per block at least, in elements.
const BACKWARD_MIN_BLOCK_ELEMS: usize = 1 << 14;
/// Elements of f16 rows widened at a time (whole rows: one row when longer).
const PANEL: usize = 1 << 14;

/// The affine parameters, in the accumulation type (`cols` values each).
#[derive(Clone, Copy, Debug, Default)]
pub struct Affine<'a, A> {
    /// Per-column scale (`w`), or none (1).
    pub weight: Option<&'a [A]>,
    /// Per-column shift (`b`), or none (0).
    pub bias: Option<&'a [A]>,
}

/// The forward outputs.
pub struct ForwardOut<'a, T: NormFloat> {
    /// `rows * cols` values.
    pub y: &'a mut [T],
    /// One mean per row.
    pub mean: &'a mut [T::Acc],
    /// One reciprocal standard deviation per row.
    pub rstd: &'a mut [T::Acc],
}

/// `y = (x - mean) * rstd * w + b` per row of `cols` values, with the row's mean and rstd.
///
/// With `cols == 0`, mean is 0 and rstd NaN (ATen's CPU kernel). Parallel work goes through
/// `par`.
///
/// # Panics
/// If a slice's length does not match `rows` / `cols`.
pub fn forward<T: NormFloat>(
    x: &[T],
    (rows, cols): (usize, usize),
    affine: Affine<'_, T::Acc>,
    eps: T::Acc,
    out: ForwardOut<'_, T>,
    par: &dyn Parallel,
) {
    const FN: &str = "layer_norm::forward";
    let len = elements(FN, rows, cols);
    check_len(FN, "x", x.len(), len);
    check_len(FN, "y", out.y.len(), len);
    check_len(FN, "mean", out.mean.len(), rows);
    check_len(FN, "rstd", out.rstd.len(), rows);
    check_affine(FN, affine, cols);
    if rows == 0 {
        return;
    }
    if cols == 0 {
        out.mean.fill(T::Acc::ZERO);
        out.rstd.fill(T::Acc::NAN);
        return;
    }
    let cv = Convert::<T>::new();
    let block_rows = (FORWARD_BLOCK_ELEMS / cols).max(1);
    let block_elems = block_rows * cols;
    let pieces: Vec<_> = out
        .y
        .chunks_mut(block_elems)
        .zip(
            out.mean
                .chunks_mut(block_rows)
                .zip(out.rstd.chunks_mut(block_rows)),
        )
        .collect();
    blocks::for_each(par, pieces, block_elems, |b, (y, (mean, rstd))| {
        let x = &x[b * block_elems..][..y.len()];
        let task = ForwardTask {
            x,
            y,
            mean,
            rstd,
            cols,
            affine,
            eps,
        };
        dispatch_forward(cv, task);
    });
}

/// The gradients wanted from [`backward`], each `None` when not wanted.
pub struct Grads<'a, T: NormFloat> {
    /// `rows * cols` values.
    pub dx: Option<&'a mut [T]>,
    /// `cols` values.
    pub dw: Option<&'a mut [T::Acc]>,
    /// `cols` values.
    pub db: Option<&'a mut [T::Acc]>,
}

/// The forward's saved values (one per row each).
#[derive(Clone, Copy)]
pub struct Stats<'a, A> {
    /// The rows' means.
    pub mean: &'a [A],
    /// The rows' reciprocal standard deviations.
    pub rstd: &'a [A],
}

/// `dx`, `dw` and `db` from `dy`, the forward's input `x`, its `mean` and `rstd`, and the weight
/// (`None`: all ones). With `rows == 0`, dw and db are zero.
///
/// # Panics
/// If a slice's length does not match `rows` / `cols`.
pub fn backward<T: NormFloat>(
    (dy, x): (&[T], &[T]),
    (rows, cols): (usize, usize),
    stats: Stats<'_, T::Acc>,
    weight: Option<&[T::Acc]>,
    grads: Grads<'_, T>,
    par: &dyn Parallel,
) {
    const FN: &str = "layer_norm::backward";
    let len = elements(FN, rows, cols);
    check_len(FN, "dy", dy.len(), len);
    check_len(FN, "x", x.len(), len);
    check_len(FN, "mean", stats.mean.len(), rows);
    check_len(FN, "rstd", stats.rstd.len(), rows);
    let affine = Affine { weight, bias: None };
    check_affine(FN, affine, cols);
    let Grads { dx, dw, db } = grads;
    if let Some(dx) = dx.as_deref() {
        check_len(FN, "dx", dx.len(), len);
    }
    for (name, g) in [("dw", dw.as_deref()), ("db", db.as_deref())] {
        if let Some(g) = g {
            check_len(FN, name, g.len(), cols);
        }
    }
    let sums = dw.is_some() || db.is_some();
    if rows == 0 || cols == 0 || (dx.is_none() && !sums) {
        for g in [dw, db].into_iter().flatten() {
            g.fill(T::Acc::ZERO);
        }
        return;
    }
    let cv = Convert::<T>::new();
    let block_rows = rows
        .div_ceil(BACKWARD_MAX_BLOCKS)
        .max(BACKWARD_MIN_BLOCK_ELEMS.div_ceil(cols));
    let block_elems = block_rows * cols;
    let n_blocks = rows.div_ceil(block_rows);
    // One (dw, db) partial per block, reduced in block order below.
    let mut partials = if sums {
        vec![T::Acc::ZERO; n_blocks * 2 * cols]
    } else {
        Vec::new()
    };
    let mut dx_blocks = dx.map(|dx| dx.chunks_mut(block_elems));
    let mut part_blocks = sums.then(|| partials.chunks_mut(2 * cols));
    let pieces: Vec<_> = (0..n_blocks)
        .map(|_| {
            let dx = dx_blocks.as_mut().and_then(Iterator::next);
            let part = part_blocks.as_mut().and_then(Iterator::next);
            (dx, part)
        })
        .collect();
    blocks::for_each(par, pieces, block_elems, |b, (dx, part)| {
        let start = b * block_elems;
        let end = (start + block_elems).min(len);
        let r = start / cols..end / cols;
        let task = BackwardTask {
            dy: &dy[start..end],
            x: &x[start..end],
            mean: &stats.mean[r.clone()],
            rstd: &stats.rstd[r],
            cols,
            weight,
            dx,
            part,
        };
        dispatch_backward(cv, task);
    });
    if sums {
        let mut parts = partials.chunks_exact(2 * cols);
        let first = parts.next().expect("rows > 0 makes one block at least");
        let (mut w_sum, mut b_sum) = (first[..cols].to_vec(), first[cols..].to_vec());
        for part in parts {
            for (acc, &p) in w_sum.iter_mut().zip(&part[..cols]) {
                *acc += p;
            }
            for (acc, &p) in b_sum.iter_mut().zip(&part[cols..]) {
                *acc += p;
            }
        }
        if let Some(dw) = dw {
            dw.copy_from_slice(&w_sum);
        }
        if let Some(db) = db {
            db.copy_from_slice(&b_sum);
        }
    }
}

#[track_caller]
fn elements(func: &str, rows: usize, cols: usize) -> usize {
    rows.checked_mul(cols)
        .unwrap_or_else(|| panic!("{func}: rows * cols = {rows} * {cols} overflows usize"))
}

#[track_caller]
fn check_len(func: &str, what: &str, got: usize, want: usize) {
    assert!(
        got == want,
        "{func}: `{what}` has {got} elements, expected {want}"
    );
}

#[track_caller]
fn check_affine<A>(func: &str, affine: Affine<'_, A>, cols: usize) {
    if let Some(w) = affine.weight {
        check_len(func, "weight", w.len(), cols);
    }
    if let Some(b) = affine.bias {
        check_len(func, "bias", b.len(), cols);
    }
}

/// One task's rows of a forward call.
struct ForwardTask<'a, T: NormFloat> {
    x: &'a [T],
    y: &'a mut [T],
    mean: &'a mut [T::Acc],
    rstd: &'a mut [T::Acc],
    cols: usize,
    affine: Affine<'a, T::Acc>,
    eps: T::Acc,
}

/// One task's rows of a backward call; `part` holds its `dw` then `db` partial (`2 * cols`).
struct BackwardTask<'a, T: NormFloat> {
    dy: &'a [T],
    x: &'a [T],
    mean: &'a [T::Acc],
    rstd: &'a [T::Acc],
    cols: usize,
    weight: Option<&'a [T::Acc]>,
    dx: Option<&'a mut [T]>,
    part: Option<&'a mut [T::Acc]>,
}

fn dispatch_forward<T: NormFloat>(cv: Convert<T>, task: ForwardTask<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Isa;
        match Isa::current() {
            Isa::Avx512 => {
                if let Some(token) = crate::simd::x86::Avx512::detect() {
                    return x86::avx512::forward(token, cv, task);
                }
            }
            Isa::Avx2 => {
                if let Some(token) = crate::simd::x86::Avx2::detect() {
                    return x86::avx2::forward(token, cv, task);
                }
            }
            Isa::Portable => {}
        }
    }
    run_forward(cv, task)
}

fn dispatch_backward<T: NormFloat>(cv: Convert<T>, task: BackwardTask<'_, T>) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Isa;
        match Isa::current() {
            Isa::Avx512 => {
                if let Some(token) = crate::simd::x86::Avx512::detect() {
                    return x86::avx512::backward(token, cv, task);
                }
            }
            Isa::Avx2 => {
                if let Some(token) = crate::simd::x86::Avx2::detect() {
                    return x86::avx2::backward(token, cv, task);
                }
            }
            Isa::Portable => {}
        }
    }
    run_backward(cv, task)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::rows::{run_backward, run_forward};
    use super::{BackwardTask, ForwardTask, NormFloat};
    use crate::ops::convert::Convert;

    crate::vectorize::x86_entry_points! { [avx2, avx512]
        /// [`run_forward`] compiled for this token's features.
        fn forward<T>(_: S, cv: Convert<T>, task: ForwardTask<'_, T>)
        where [T: NormFloat]
        { run_forward(cv, task) }

        /// [`run_backward`] compiled for this token's features.
        fn backward<T>(_: S, cv: Convert<T>, task: BackwardTask<'_, T>)
        where [T: NormFloat]
        { run_backward(cv, task) }
    }
}
