//! Vocabulary blocks: the loss over blocks of consecutive classes, as the vocabulary-blocked
//! fused linear cross-entropy computes it (the rows' running maximum and sum of exponentials
//! over the blocks, then each block's gradient).

use super::rows::row_stats;
use super::{row_scale, rows_per_task, CeMath, Scale};
use crate::blocks;
use crate::float::{Acc, Float};
use crate::isa::Isa;
use crate::ops::convert::Convert;
use crate::parallel::Parallel;
use crate::vectorize::{self, Job};

/// One block of consecutive classes `first_col..first_col + cols` of every row, as the
/// vocabulary-blocked fused linear cross-entropy computes them (two passes over the blocks:
/// statistics, then gradients; the rows' full logits never exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Classes in the block (>= 1); the block's logits are `rows * cols`, row-major.
    pub cols: usize,
    /// Class index of the block's first column.
    pub first_col: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
}

/// Per-row running statistics over the blocks seen so far (accumulation type), and where the
/// last block writes the result.
#[derive(Debug)]
pub struct BlockStats<'a, A> {
    /// Running maximum; after the last block, the row's log-sum-exp.
    pub max: &'a mut [A],
    /// Running sum of `exp(x - max)`.
    pub sum: &'a mut [A],
    /// The target's logit, written by the block that holds the target.
    pub target_logit: &'a mut [A],
    /// For the last block: each row's loss `lse - x_t` (0 for ignored rows); `max` then
    /// becomes the log-sum-exp.
    pub loss: Option<&'a mut [A]>,
    /// Whether this is the first block (the running statistics start from it, unread).
    pub first: bool,
}

/// `(max, sum_c exp(x_c - max))` of a block's row: `(-inf, 0)` for a row of `-inf` (NaN for
/// the sum if a NaN is among them: NaN never wins the maximum, it reaches the sum).
#[inline(always)]
fn block_row_stats<T: Float>(x: &[T]) -> (T::Acc, T::Acc)
where
    T::Acc: CeMath,
{
    let (m, s, _) = row_stats(x, false, None);
    if m == T::Acc::NEG_INF {
        // NaN is the one value not comparable with itself.
        let nan = x
            .iter()
            .any(|v| v.to_acc().partial_cmp(&v.to_acc()).is_none());
        return (m, if nan { T::Acc::NAN } else { T::Acc::ZERO });
    }
    (m, s)
}

/// `(m, s)` merged with `(m2, s2)`: both sums scaled to the larger maximum. While the maximum
/// is `-inf` the sums are 0 (or NaN), and add.
#[inline(always)]
fn merge_stats<A: CeMath>(m: A, s: A, m2: A, s2: A) -> (A, A) {
    let mx = if m2 > m { m2 } else { m };
    if mx == A::NEG_INF {
        return (mx, s + s2);
    }
    (mx, s * (m - mx).exp_nonpos() + s2 * (m2 - mx).exp_nonpos())
}

/// One task of [`block_stats`]: rows `first_row..` of a block.
struct StatsTask<'a, T: Float> {
    x: &'a [T],
    target: &'a [i64],
    max: &'a mut [T::Acc],
    sum: &'a mut [T::Acc],
    target_logit: &'a mut [T::Acc],
    loss: Option<&'a mut [T::Acc]>,
    first: bool,
    b: Block,
}

impl<T: Float> Job for StatsTask<'_, T>
where
    T::Acc: CeMath,
{
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let StatsTask {
            x,
            target,
            max,
            sum,
            target_logit,
            mut loss,
            first,
            b,
        } = self;
        for (r, xr) in x.chunks_exact(b.cols).enumerate() {
            let t = target[r];
            if t == b.ignore_index {
                if let Some(l) = loss.as_deref_mut() {
                    l[r] = T::Acc::ZERO;
                }
                continue;
            }
            let (bm, bs) = block_row_stats(xr);
            let (m, s) = if first {
                (bm, bs)
            } else {
                merge_stats(max[r], sum[r], bm, bs)
            };
            let local = (t as u64).wrapping_sub(b.first_col as u64);
            if local < b.cols as u64 {
                target_logit[r] = xr[local as usize].to_acc();
            }
            match loss.as_deref_mut() {
                Some(l) => {
                    let lse = m + s.ln();
                    max[r] = lse;
                    l[r] = lse - target_logit[r];
                }
                None => {
                    max[r] = m;
                    sum[r] = s;
                }
            }
        }
    }
}

/// The rows of a vocabulary block (one per target), after checking that `b` has classes and
/// the logits hold `rows x b.cols` values.
fn check_block_shape(logits_len: usize, target: &[i64], b: &Block) -> usize {
    let rows = target.len();
    assert!(
        b.cols >= 1,
        "cross_entropy: a block needs at least one class"
    );
    assert_eq!(
        logits_len,
        rows * b.cols,
        "cross_entropy: block logits length"
    );
    rows
}

/// Merges one block of logits (`target.len()` rows of `b.cols`) into each row's running
/// maximum and sum of exponentials (online softmax), and records the target's logit when the
/// target is in the block. Rows whose target is `b.ignore_index` are skipped (their loss is 0).
/// Targets must have passed [`count_valid`](super::count_valid) over the whole vocabulary.
///
/// # Panics
/// If a length disagrees or `b.cols` is 0.
pub fn block_stats<T: Float>(
    logits: &[T],
    target: &[i64],
    b: &Block,
    stats: BlockStats<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let rows = check_block_shape(logits.len(), target, b);
    for (name, len) in [
        ("max", stats.max.len()),
        ("sum", stats.sum.len()),
        ("target logit", stats.target_logit.len()),
        ("loss", stats.loss.as_ref().map_or(rows, |l| l.len())),
    ] {
        assert_eq!(len, rows, "cross_entropy: block {name} length");
    }
    let per = rows_per_task(b.cols);
    let BlockStats {
        max,
        sum,
        target_logit,
        loss,
        first,
    } = stats;
    let mut losses: Vec<Option<&mut [T::Acc]>> = match loss {
        Some(l) => l.chunks_mut(per).map(Some).collect(),
        None => (0..rows.div_ceil(per)).map(|_| None).collect(),
    };
    let items: Vec<_> = logits
        .chunks(per * b.cols)
        .zip(max.chunks_mut(per))
        .zip(sum.chunks_mut(per).zip(target_logit.chunks_mut(per)))
        .zip(losses.drain(..))
        .collect();
    let isa = Isa::current();
    let b = *b;
    blocks::for_each(
        par,
        items,
        per * b.cols,
        |i, (((x, max), (sum, tl)), loss)| {
            let first_row = i * per;
            vectorize::run_with(
                isa,
                StatsTask::<T> {
                    x,
                    target: &target[first_row..first_row + max.len()],
                    max,
                    sum,
                    target_logit: tl,
                    loss,
                    first,
                    b,
                },
            );
        },
    );
}

/// One task of [`block_grad`].
struct GradTask<'a, T: Float> {
    x: &'a mut [T],
    target: &'a [i64],
    lse: &'a [T::Acc],
    scale: Scale<'a, T::Acc>,
    first_row: usize,
    scratch: &'a mut [T::Acc],
    b: Block,
    narrow: fn(&[T::Acc], &mut [T]),
}

impl<T: Float> Job for GradTask<'_, T>
where
    T::Acc: CeMath,
{
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let GradTask {
            x,
            target,
            lse,
            scale,
            first_row,
            scratch,
            b,
            narrow,
        } = self;
        for (r, xr) in x.chunks_exact_mut(b.cols).enumerate() {
            let t = target[r];
            if t == b.ignore_index {
                scratch.fill(T::Acc::ZERO);
                narrow(scratch, xr);
                continue;
            }
            let f = row_scale(&scale, first_row + r);
            let l = lse[r];
            for (e, v) in scratch.iter_mut().zip(xr.iter()) {
                *e = (v.to_acc() - l).exp_nonpos() * f;
            }
            let local = (t as u64).wrapping_sub(b.first_col as u64);
            if local < b.cols as u64 {
                let e = &mut scratch[local as usize];
                *e = *e - f;
            }
            narrow(scratch, xr);
        }
    }
}

/// Replaces one block of logits (`target.len()` rows of `b.cols`) by the loss's gradient over
/// them: `(exp(x - lse) - [class == target]) * factor`, the factor `scale.all` times
/// `scale.rows[row]` when given; rows whose target is `b.ignore_index` get zeros. `lse` is
/// each row's log-sum-exp over the whole vocabulary ([`BlockStats::max`] after the last block).
///
/// # Panics
/// If a length disagrees or `b.cols` is 0.
pub fn block_grad<T: Float>(
    logits: &mut [T],
    target: &[i64],
    b: &Block,
    lse: &[T::Acc],
    scale: Scale<'_, T::Acc>,
    par: &dyn Parallel,
) where
    T::Acc: CeMath,
{
    let rows = check_block_shape(logits.len(), target, b);
    assert_eq!(lse.len(), rows, "cross_entropy: block lse length");
    if let Some(r) = scale.rows {
        assert_eq!(r.len(), rows, "cross_entropy: per-row scale length");
    }
    let per = rows_per_task(b.cols);
    let isa = Isa::current();
    let narrow = Convert::<T>::new().narrow;
    let b = *b;
    let items: Vec<_> = logits.chunks_mut(per * b.cols).collect();
    blocks::for_each(par, items, per * b.cols, |i, x| {
        let first_row = i * per;
        let n = x.len() / b.cols;
        T::Acc::with_scratch(b.cols, |scratch| {
            vectorize::run_with(
                isa,
                GradTask::<T> {
                    x,
                    target: &target[first_row..first_row + n],
                    lse: &lse[first_row..first_row + n],
                    scale,
                    first_row,
                    scratch,
                    b,
                    narrow,
                },
            );
        });
    });
}
