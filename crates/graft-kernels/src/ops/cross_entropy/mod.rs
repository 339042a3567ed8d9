//! Cross-entropy over rows of logits, with the gradient computed in the same call.
//!
//! For a row `x` of `cols` logits, target class `t` and label smoothing `eps`:
//!
//! ```text
//! lse  = log(sum_c exp(x_c))
//! loss = lse - (1 - eps) x_t - (eps / cols) sum_c x_c
//! grad = scale * (softmax(x) - (1 - eps) onehot(t) - eps / cols)
//! ```
//!
//! which is PyTorch's `cross_entropy(x.float(), t, label_smoothing=eps)` per row. Rows whose
//! target is `ignore_index` get a zero loss and a zero gradient. Arithmetic happens in `T::Acc`
//! (f32, f64 for f64). Each row is read twice (its maximum, then its exponentials, stored in a
//! per-thread scratch row in `T::Acc`; the second read comes from cache); the gradient is made
//! in the scratch row and narrowed once to `T` by the ISA's vectorized conversion, possibly over
//! the logits themselves ([`forward_in_place`]).
//!
//! The loops work on [`LANES`]-wide arrays with a branch-free exponential
//! ([`CeMath::exp_nonpos`]), so that the compiler vectorizes them; [`crate::vectorize`] compiles
//! them for the best instruction set.
//!
//! - `math`: the exponential, the logarithm and the per-thread scratch, per accumulation type;
//! - `rows`: the loss and gradient of whole rows ([`forward`], [`forward_in_place`]);
//! - `scale`: a gradient times per-row factors ([`scale_in_place`], [`scale_into`]);
//! - `vocab_blocks`: the online softmax over blocks of classes that fused linear
//!   cross-entropy runs ([`block_stats`], [`block_grad`]).

mod math;
mod rows;
mod scale;
mod vocab_blocks;

pub use self::math::CeMath;
pub use self::rows::{forward, forward_in_place};
pub use self::scale::{scale_in_place, scale_into};
pub use self::vocab_blocks::{block_grad, block_stats, Block, BlockStats};

use crate::float::Acc;

/// Lanes of the arrays the row loops work on (one AVX-512 vector of f32, two of AVX2).
const LANES: usize = 16;

/// Elements per parallel task, about (whole rows for the loss).
const TASK_ELEMS: usize = 1 << 15;

/// The loss's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    /// Classes per row (`V`), at least 1.
    pub cols: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
    /// Label smoothing in `[0, 1]` (PyTorch treats negative values as 0; callers pass 0 then).
    pub smoothing: f64,
}

/// The factor each row's gradient is multiplied by: `all`, times `rows[r]` when given (the
/// per-row upstream gradient of an unreduced loss).
#[derive(Clone, Copy, Debug)]
pub struct Scale<'a, A> {
    /// Factor of every row (e.g. `1 / valid rows` for a mean).
    pub all: A,
    /// Per-row factors, one per row, when given.
    pub rows: Option<&'a [A]>,
}

/// A target that is neither `ignore_index` nor a class in `0..cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadTarget(pub i64);

/// Checks every target and counts the rows that are not ignored.
///
/// # Errors
/// The first target outside `0..cols` that is not `ignore_index`.
pub fn count_valid(target: &[i64], cols: usize, ignore_index: i64) -> Result<usize, BadTarget> {
    let mut valid = 0;
    for &t in target {
        if t == ignore_index {
            continue;
        }
        if t < 0 || t as u64 >= cols as u64 {
            return Err(BadTarget(t));
        }
        valid += 1;
    }
    Ok(valid)
}

/// Row `row`'s gradient factor.
#[inline(always)]
fn row_scale<A: Acc>(s: &Scale<'_, A>, row: usize) -> A {
    match s.rows {
        Some(rows) => s.all * rows[row],
        None => s.all,
    }
}

/// Whole rows of `cols` per parallel task: about [`TASK_ELEMS`] elements, at least one row.
fn rows_per_task(cols: usize) -> usize {
    (TASK_ELEMS / cols.max(1)).max(1)
}

/// The reduced loss: the sum of the per-row losses, divided by `valid` for a mean (`0 / 0` is
/// NaN, as in PyTorch). Summed in f64 in row order.
pub fn reduce<A: CeMath + Into<f64>>(loss: &[A], mean: bool, valid: usize) -> A {
    let total: f64 = loss.iter().map(|&l| l.into()).sum();
    A::from_f64(if mean { total / valid as f64 } else { total })
}
