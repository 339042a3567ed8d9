//! The launch arguments of the cross_entropy API and the `#[repr(C)]` parameter blocks of
//! cross_entropy.cu's kernels.

#[cfg(doc)]
use super::{
    accumulate_f32, cross_entropy_block_grad, cross_entropy_block_stats, cross_entropy_count,
    cross_entropy_reduce, cross_entropy_rows, scale_grad,
};
use crate::DType;

/// Arguments of [`cross_entropy_rows`]. Pointers are device addresses; arrays are contiguous.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyRows {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of the logits and the gradient.
    pub dtype: DType,
    /// Logits, `rows * cols`.
    pub logits: u64,
    /// Targets, `rows` int64 (checked by [`cross_entropy_count`] before).
    pub target: u64,
    /// Gradient output, `rows * cols` (may equal `logits`); `None` computes the loss only.
    pub grad: Option<u64>,
    /// Per-row losses, `rows` of the accumulation dtype.
    pub loss: u64,
    /// The count written by [`cross_entropy_count`]: the gradient is divided by it (a mean).
    pub count: Option<u64>,
    /// Per-row factors of the gradient (`rows` of the accumulation dtype).
    pub row_scale: Option<u64>,
    /// Rows.
    pub rows: usize,
    /// Classes per row (>= 1).
    pub cols: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
    /// Label smoothing in `[0, 1]`.
    pub smoothing: f64,
}

/// Arguments of [`cross_entropy_count`].
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyCount {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Targets, `rows` int64.
    pub target: u64,
    /// Output: one f64, the rows whose target is not `ignore_index`.
    pub count: u64,
    /// Rows.
    pub rows: usize,
    /// Classes: any other target outside `0..cols` fails a device-side assertion.
    pub cols: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
}

/// Arguments of [`cross_entropy_reduce`].
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyReduce {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Dtype of the losses: `F32` or `F64`.
    pub dtype: DType,
    /// Per-row losses, `rows`.
    pub loss_rows: u64,
    /// For a mean, the count from [`cross_entropy_count`] (the divisor); `None` sums.
    pub count: Option<u64>,
    /// Output: one value of `dtype`.
    pub out: u64,
    /// Rows (0 writes 0, or NaN for a mean).
    pub rows: usize,
}

/// Arguments of [`scale_grad`]: `dst = src * factor`.
#[derive(Clone, Copy, Debug)]
pub struct ScaleGrad {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of `src` and `dst`.
    pub dtype: DType,
    /// Input, `n` elements.
    pub src: u64,
    /// Output, `n` elements (may equal `src`: then elements whose factor is 1 are untouched).
    pub dst: u64,
    /// One factor, or one per row of `cols` elements, of the accumulation dtype.
    pub factor: u64,
    /// Whether `factor` holds one value per row.
    pub per_row: bool,
    /// Elements.
    pub n: usize,
    /// Row length when `per_row` (>= 1).
    pub cols: usize,
}

/// Arguments of [`cross_entropy_block_stats`]: one block of classes `first_col..first_col +
/// cols` of every row merged into the rows' running statistics.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyBlockStats {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of the logits.
    pub dtype: DType,
    /// The block's logits, `rows * cols`, contiguous.
    pub logits: u64,
    /// Targets, `rows` int64 (whole-vocabulary classes, checked by [`cross_entropy_count`]).
    pub target: u64,
    /// Running maximum, `rows` of the accumulation dtype; the log-sum-exp after the last block.
    pub max: u64,
    /// Running sum of `exp(x - max)`, `rows` of the accumulation dtype.
    pub sum: u64,
    /// The target's logit, `rows` of the accumulation dtype (written by its block).
    pub target_logit: u64,
    /// For the last block: the per-row losses (`rows` of the accumulation dtype).
    pub loss: Option<u64>,
    /// Whether this is the first block (`max` and `sum` are not read).
    pub first: bool,
    /// Rows.
    pub rows: usize,
    /// Classes in the block (>= 1).
    pub cols: usize,
    /// Class index of the block's first column.
    pub first_col: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
}

/// Arguments of [`cross_entropy_block_grad`]: a block's logits replaced by
/// `(exp(x - lse) - [class == target]) * factor`.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyBlockGrad {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Element type of the logits.
    pub dtype: DType,
    /// The block's logits, `rows * cols`, contiguous; the gradient is written over them.
    pub logits: u64,
    /// Targets, `rows` int64.
    pub target: u64,
    /// Log-sum-exp of each row over the whole vocabulary, `rows` of the accumulation dtype.
    pub lse: u64,
    /// The count written by [`cross_entropy_count`]: the gradient is divided by it (a mean).
    pub count: Option<u64>,
    /// Per-row factors of the gradient (`rows` of the accumulation dtype).
    pub row_scale: Option<u64>,
    /// Rows.
    pub rows: usize,
    /// Classes in the block (>= 1).
    pub cols: usize,
    /// Class index of the block's first column.
    pub first_col: usize,
    /// Target value of rows to skip.
    pub ignore_index: i64,
}

/// Arguments of [`accumulate_f32`]: `acc += src`, `n` f32 each.
#[derive(Clone, Copy, Debug)]
pub struct AccumulateF32 {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Accumulator, `n` f32.
    pub acc: u64,
    /// Addend, `n` f32 (not overlapping `acc`).
    pub src: u64,
    /// Elements.
    pub n: usize,
}

/// `graft_ce::CeBlockStatsParams` of cross_entropy.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct BlockStatsParams {
    pub(super) logits: u64,
    pub(super) target: u64,
    pub(super) max: u64,
    pub(super) sum: u64,
    pub(super) target_logit: u64,
    pub(super) loss: u64,
    pub(super) rows: i64,
    pub(super) cols: i64,
    pub(super) first_col: i64,
    pub(super) ignore_index: i64,
    pub(super) first: i64,
}

/// `graft_ce::CeBlockGradParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct BlockGradParams {
    pub(super) logits: u64,
    pub(super) target: u64,
    pub(super) lse: u64,
    pub(super) count: u64,
    pub(super) row_scale: u64,
    pub(super) rows: i64,
    pub(super) cols: i64,
    pub(super) first_col: i64,
    pub(super) ignore_index: i64,
}

/// `graft_ce::CeAccumulateParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct AccumulateParams {
    pub(super) acc: u64,
    pub(super) src: u64,
    pub(super) n: i64,
    pub(super) vec: i64,
}

/// `graft_ce::CeRowsParams` of cross_entropy.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct RowsParams {
    pub(super) logits: u64,
    pub(super) target: u64,
    pub(super) grad: u64,
    pub(super) loss: u64,
    pub(super) count: u64,
    pub(super) row_scale: u64,
    pub(super) rows: i64,
    pub(super) cols: i64,
    pub(super) ignore_index: i64,
    pub(super) on_target: f64,
    pub(super) per_class: f64,
    pub(super) smoothing: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct CountParams {
    pub(super) target: u64,
    pub(super) count: u64,
    pub(super) rows: i64,
    pub(super) cols: i64,
    pub(super) ignore_index: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct ReduceParams {
    pub(super) loss_rows: u64,
    pub(super) count: u64,
    pub(super) out: u64,
    pub(super) rows: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct ScaleParams {
    pub(super) src: u64,
    pub(super) dst: u64,
    pub(super) factor: u64,
    pub(super) n: i64,
    pub(super) cols: i64,
    pub(super) per_row: i64,
    pub(super) vec: i64,
}
