//! Cross-entropy rows (loss and gradient in one kernel), the count of rows not ignored, the
//! reduction of the per-row losses, and scaling a gradient by the upstream gradient: launched
//! from kernels/cross_entropy.cu.
//!
//! A loss is computed by [`cross_entropy_count`] (always first: it also checks the targets),
//! then [`cross_entropy_rows`], then, for `sum` / `mean`, [`cross_entropy_reduce`], all on one
//! stream; nothing waits for the host.
//!
//! The vocabulary-blocked fused linear cross-entropy runs [`cross_entropy_block_stats`] over
//! each block of classes (after the count), then, for its gradient, [`cross_entropy_block_grad`]
//! over each block again; [`accumulate_f32`] adds its f32 partial products.

use std::sync::OnceLock;

use crate::error::CudaError;
use crate::launch::{grid_covering, launch_named, NamedLaunch};
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

/// `graft_ce::CeBlockStatsParams` of kernels/cross_entropy.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BlockStatsParams {
    logits: u64,
    target: u64,
    max: u64,
    sum: u64,
    target_logit: u64,
    loss: u64,
    rows: i64,
    cols: i64,
    first_col: i64,
    ignore_index: i64,
    first: i64,
}

/// `graft_ce::CeBlockGradParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct BlockGradParams {
    logits: u64,
    target: u64,
    lse: u64,
    count: u64,
    row_scale: u64,
    rows: i64,
    cols: i64,
    first_col: i64,
    ignore_index: i64,
}

/// `graft_ce::CeAccumulateParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AccumulateParams {
    acc: u64,
    src: u64,
    n: i64,
    vec: i64,
}

/// `graft_ce::CeRowsParams` of kernels/cross_entropy.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct RowsParams {
    logits: u64,
    target: u64,
    grad: u64,
    loss: u64,
    count: u64,
    row_scale: u64,
    rows: i64,
    cols: i64,
    ignore_index: i64,
    on_target: f64,
    per_class: f64,
    smoothing: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CountParams {
    target: u64,
    count: u64,
    rows: i64,
    cols: i64,
    ignore_index: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ReduceParams {
    loss_rows: u64,
    count: u64,
    out: u64,
    rows: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ScaleParams {
    src: u64,
    dst: u64,
    factor: u64,
    n: i64,
    cols: i64,
    per_row: i64,
    vec: i64,
}

const ALL_DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
/// Threads of the one-block kernels (count, reduce).
const ONE_BLOCK: u32 = 1024;
/// Threads per block of the scale kernel.
const SCALE_BLOCK: u32 = 256;
/// Most blocks per SM of the scale kernel's grid-stride grid. An in-place scale by exactly 1
/// returns at once in every block, so a grid covering every element (half a million blocks
/// at 8192 x 128256) cost 0.35 ms of nothing (H100, bf16): two waves of resident blocks instead.
const SCALE_BLOCKS_PER_SM: u32 = 16;
/// Threads resident per SM that the vocabulary-block kernels aim for: their rows are a block
/// of classes (a few thousand), so several blocks share an SM.
const BLOCK_KERNEL_THREADS_PER_SM: u32 = 2048;
/// The vocabulary-block kernels' `__launch_bounds__` (`BLOCKT`).
const BLOCK_KERNEL_MAX_THREADS: u32 = 512;

/// The rows kernel's launch shape: at most `threads` per block (a multiple of 32, at most
/// 1024), `blocks_per_sm` resident blocks per SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsTuning {
    /// Threads per block, at most (fewer for short rows).
    pub threads: u32,
    /// Blocks per SM in the grid (the grid strides over the remaining rows).
    pub blocks_per_sm: u32,
}

impl RowsTuning {
    /// Four 256-thread blocks per SM. H100, bf16, 8192 x 128256, kernel alone (one, two, four
    /// blocks per SM): loss alone 1.26 / 0.98 / 0.89 ms, loss and gradient 2.37 / 2.36 / 2.34
    /// (bench/kernel_lab/cross_entropy_sweep.py; `TORCHGRAFT_CE_ROWS_TUNING` sweeps the op).
    /// The rows in flight (528 x 256 KB) outgrow L2, yet pass 2 is not slower for it.
    pub const DEFAULT: RowsTuning = RowsTuning {
        threads: 256,
        blocks_per_sm: 4,
    };

    /// [`RowsTuning::DEFAULT`], or `TORCHGRAFT_CE_ROWS_TUNING="threads,blocks_per_sm"` (read
    /// once; for benchmark sweeps).
    pub fn current() -> RowsTuning {
        static TUNING: OnceLock<RowsTuning> = OnceLock::new();
        *TUNING.get_or_init(|| {
            std::env::var("TORCHGRAFT_CE_ROWS_TUNING")
                .ok()
                .and_then(|v| RowsTuning::parse(&v))
                .unwrap_or(RowsTuning::DEFAULT)
        })
    }

    fn parse(v: &str) -> Option<RowsTuning> {
        let (t, b) = v.split_once(',')?;
        let threads: u32 = t.trim().parse().ok()?;
        let blocks_per_sm: u32 = b.trim().parse().ok()?;
        let ok = (32..=1024).contains(&threads) && threads.is_multiple_of(32) && blocks_per_sm >= 1;
        ok.then_some(RowsTuning {
            threads,
            blocks_per_sm,
        })
    }

    /// Threads for rows of `cols` elements of `dtype`: enough for one 16-byte pack each, in
    /// whole warps, at most `self.threads` and the kernel's bound (512 for F64, else 1024).
    fn threads_for(self, cols: usize, dtype: DType) -> u32 {
        let bound = if dtype == DType::F64 { 512 } else { 1024 };
        let packs = cols.div_ceil(16 / dtype.size()) as u64;
        let warps = packs.div_ceil(32).max(1);
        (warps * 32).min(u64::from(self.threads.min(bound))) as u32
    }
}

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
    }
}

/// Entry points of kernels/cross_entropy.cu, for the kernel table.
pub(crate) fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for dtype in ALL_DTYPES {
        out.push(format!("graft_ce_rows_{}", dtype_tag(dtype)));
        out.push(format!("graft_ce_scale_{}", dtype_tag(dtype)));
        out.push(format!("graft_ce_block_stats_{}", dtype_tag(dtype)));
        out.push(format!("graft_ce_block_grad_{}", dtype_tag(dtype)));
    }
    out.push("graft_ce_accumulate_f32".to_string());
    out.push("graft_ce_count".to_string());
    out.push("graft_ce_reduce_f32".to_string());
    out.push("graft_ce_reduce_f64".to_string());
    out
}

fn check_ptr(name: &str, p: u64, align: usize) -> Result<(), CudaError> {
    if p == 0 || !p.is_multiple_of(align as u64) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: cross_entropy: {name} (0x{p:x}) is null or not aligned to {align} bytes"
        )));
    }
    Ok(())
}

fn check_size(what: &str, elems: usize, elem_size: usize) -> Result<(), CudaError> {
    if (elems as u64)
        .checked_mul(elem_size as u64)
        .is_none_or(|b| b > i64::MAX as u64)
    {
        return Err(CudaError::invalid(format!(
            "graft-cuda: cross_entropy: {what} of {elems} elements is too large"
        )));
    }
    Ok(())
}

/// Per-row losses of `a.logits` and, when `a.grad` is given, the gradient, on `a.stream`.
/// Nothing is launched for `rows == 0`.
pub fn cross_entropy_rows(a: &CrossEntropyRows) -> Result<(), CudaError> {
    cross_entropy_rows_with(a, RowsTuning::current())
}

/// [`cross_entropy_rows`] with an explicit launch shape.
pub fn cross_entropy_rows_with(a: &CrossEntropyRows, tuning: RowsTuning) -> Result<(), CudaError> {
    if a.cols == 0 {
        return Err(CudaError::invalid(
            "graft-cuda: cross_entropy: rows need at least one class",
        ));
    }
    if !(0.0..=1.0).contains(&a.smoothing) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: cross_entropy: label smoothing {} is not in [0, 1]",
            a.smoothing
        )));
    }
    if a.rows == 0 {
        return Ok(());
    }
    let size = a.dtype.size();
    let acc = a.dtype.acc().size();
    let elems = a
        .rows
        .checked_mul(a.cols)
        .ok_or_else(|| CudaError::invalid("graft-cuda: cross_entropy: rows * cols overflows"))?;
    check_size("logits", elems, size)?;
    check_ptr("logits", a.logits, size)?;
    check_ptr("target", a.target, 8)?;
    check_ptr("loss", a.loss, acc)?;
    if let Some(g) = a.grad {
        check_ptr("grad", g, size)?;
    }
    if let Some(c) = a.count {
        check_ptr("count", c, 8)?;
    }
    if let Some(r) = a.row_scale {
        check_ptr("row_scale", r, acc)?;
    }
    let threads = tuning.threads_for(a.cols, a.dtype);
    let st = crate::device::state(a.device)?;
    let grid = (a.rows as u64).min(u64::from(
        st.limits.sms.max(1) * tuning.blocks_per_sm.max(1),
    ));
    let mut params = RowsParams {
        logits: a.logits,
        target: a.target,
        grad: a.grad.unwrap_or(0),
        loss: a.loss,
        count: a.count.unwrap_or(0),
        row_scale: a.row_scale.unwrap_or(0),
        rows: a.rows as i64,
        cols: a.cols as i64,
        ignore_index: a.ignore_index,
        on_target: 1.0 - a.smoothing,
        per_class: a.smoothing / a.cols as f64,
        smoothing: i64::from(a.smoothing > 0.0),
    };
    let name = format!("graft_ce_rows_{}", dtype_tag(a.dtype));
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &name,
        grid: grid as u32,
        block: threads,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

/// 16-byte packs per thread of a vocabulary-block kernel. A block's row is short (a few
/// thousand classes) and each row ends in a block-wide reduction, so fewer threads per row and
/// more rows in flight keep more loads going than one pack per thread (H100, bf16, blocks of
/// 1024 x 8192 logits: the stats kernel took 24.6 us a block with 512 threads per row, 1.5x
/// the time of the gradient kernel, which reads and writes the block).
const BLOCK_KERNEL_PACKS_PER_THREAD: usize = 8;

/// Block and grid of a vocabulary-block kernel: threads for [`BLOCK_KERNEL_PACKS_PER_THREAD`]
/// 16-byte packs per thread of a row of `cols` (whole warps, at most
/// [`BLOCK_KERNEL_MAX_THREADS`]), as many blocks as fill [`BLOCK_KERNEL_THREADS_PER_SM`] per SM,
/// at most one per row.
fn block_kernel_shape(
    device: i32,
    rows: usize,
    cols: usize,
    dtype: DType,
) -> Result<(u32, u32), CudaError> {
    let shape = RowsTuning {
        threads: BLOCK_KERNEL_MAX_THREADS,
        blocks_per_sm: 1,
    };
    let threads = shape.threads_for(cols.div_ceil(BLOCK_KERNEL_PACKS_PER_THREAD), dtype);
    let st = crate::device::state(device)?;
    let per_sm = (BLOCK_KERNEL_THREADS_PER_SM / threads).max(1);
    let grid = (rows as u64).min(u64::from(st.limits.sms.max(1) * per_sm));
    Ok((threads, grid as u32))
}

fn check_block(rows: usize, cols: usize, dtype: DType) -> Result<(), CudaError> {
    if cols == 0 {
        return Err(CudaError::invalid(
            "graft-cuda: cross_entropy: a vocabulary block needs at least one class",
        ));
    }
    let elems = rows
        .checked_mul(cols)
        .ok_or_else(|| CudaError::invalid("graft-cuda: cross_entropy: rows * cols overflows"))?;
    check_size("block logits", elems, dtype.size())
}

/// Merges one block of classes into each row's running maximum and sum of exponentials, records
/// the target's logit, and after the last block (`a.loss` given) writes the losses and the
/// log-sum-exp (over `a.max`), on `a.stream`. Nothing is launched for `rows == 0`.
pub fn cross_entropy_block_stats(a: &CrossEntropyBlockStats) -> Result<(), CudaError> {
    check_block(a.rows, a.cols, a.dtype)?;
    if a.rows == 0 {
        return Ok(());
    }
    let (size, acc) = (a.dtype.size(), a.dtype.acc().size());
    check_ptr("logits", a.logits, size)?;
    check_ptr("target", a.target, 8)?;
    check_ptr("max", a.max, acc)?;
    check_ptr("sum", a.sum, acc)?;
    check_ptr("target_logit", a.target_logit, acc)?;
    if let Some(l) = a.loss {
        check_ptr("loss", l, acc)?;
    }
    let (threads, grid) = block_kernel_shape(a.device, a.rows, a.cols, a.dtype)?;
    let mut params = BlockStatsParams {
        logits: a.logits,
        target: a.target,
        max: a.max,
        sum: a.sum,
        target_logit: a.target_logit,
        loss: a.loss.unwrap_or(0),
        rows: a.rows as i64,
        cols: a.cols as i64,
        first_col: a.first_col as i64,
        ignore_index: a.ignore_index,
        first: i64::from(a.first),
    };
    let name = format!("graft_ce_block_stats_{}", dtype_tag(a.dtype));
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &name,
        grid,
        block: threads,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

/// Replaces one block of logits by the loss's gradient over them, on `a.stream`. Nothing is
/// launched for `rows == 0`.
pub fn cross_entropy_block_grad(a: &CrossEntropyBlockGrad) -> Result<(), CudaError> {
    check_block(a.rows, a.cols, a.dtype)?;
    if a.rows == 0 {
        return Ok(());
    }
    let (size, acc) = (a.dtype.size(), a.dtype.acc().size());
    check_ptr("logits", a.logits, size)?;
    check_ptr("target", a.target, 8)?;
    check_ptr("lse", a.lse, acc)?;
    if let Some(c) = a.count {
        check_ptr("count", c, 8)?;
    }
    if let Some(r) = a.row_scale {
        check_ptr("row_scale", r, acc)?;
    }
    let (threads, grid) = block_kernel_shape(a.device, a.rows, a.cols, a.dtype)?;
    let mut params = BlockGradParams {
        logits: a.logits,
        target: a.target,
        lse: a.lse,
        count: a.count.unwrap_or(0),
        row_scale: a.row_scale.unwrap_or(0),
        rows: a.rows as i64,
        cols: a.cols as i64,
        first_col: a.first_col as i64,
        ignore_index: a.ignore_index,
    };
    let name = format!("graft_ce_block_grad_{}", dtype_tag(a.dtype));
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &name,
        grid,
        block: threads,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

/// `acc += src` (`n` f32 each) on `a.stream`; nothing is launched for `n == 0`.
pub fn accumulate_f32(a: &AccumulateF32) -> Result<(), CudaError> {
    if a.n == 0 {
        return Ok(());
    }
    check_size("accumulator", a.n, 4)?;
    check_ptr("acc", a.acc, 4)?;
    check_ptr("src", a.src, 4)?;
    let vec = a.n.is_multiple_of(4) && a.acc.is_multiple_of(16) && a.src.is_multiple_of(16);
    let work = if vec { a.n / 4 } else { a.n } as u64;
    let mut params = AccumulateParams {
        acc: a.acc,
        src: a.src,
        n: a.n as i64,
        vec: i64::from(vec),
    };
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: "graft_ce_accumulate_f32",
        grid: grid_covering(work, SCALE_BLOCK),
        block: SCALE_BLOCK,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

/// Counts the rows whose target is not `ignore_index` into `a.count` (one f64), and fails a
/// device-side assertion at any other target outside `0..cols`. Launched even for `rows == 0`
/// (it writes 0).
pub fn cross_entropy_count(a: &CrossEntropyCount) -> Result<(), CudaError> {
    check_ptr("count", a.count, 8)?;
    if a.rows > 0 {
        check_ptr("target", a.target, 8)?;
    }
    let mut params = CountParams {
        target: a.target,
        count: a.count,
        rows: a.rows as i64,
        cols: a.cols as i64,
        ignore_index: a.ignore_index,
    };
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: "graft_ce_count",
        grid: 1,
        block: ONE_BLOCK,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

/// Sums the per-row losses into `a.out` (divided by the count for a mean). Launched even for
/// `rows == 0`.
pub fn cross_entropy_reduce(a: &CrossEntropyReduce) -> Result<(), CudaError> {
    let tag = match a.dtype {
        DType::F32 => "f32",
        DType::F64 => "f64",
        other => {
            return Err(CudaError::invalid(format!(
                "graft-cuda: cross_entropy: losses are f32 or f64, not {other:?}"
            )))
        }
    };
    let size = a.dtype.size();
    check_ptr("out", a.out, size)?;
    if a.rows > 0 {
        check_ptr("loss_rows", a.loss_rows, size)?;
    }
    if let Some(c) = a.count {
        check_ptr("count", c, 8)?;
    }
    let mut params = ReduceParams {
        loss_rows: a.loss_rows,
        count: a.count.unwrap_or(0),
        out: a.out,
        rows: a.rows as i64,
    };
    let name = format!("graft_ce_reduce_{tag}");
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &name,
        grid: 1,
        block: ONE_BLOCK,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

/// `dst = src * factor` on `a.stream`; nothing is launched for `n == 0`.
pub fn scale_grad(a: &ScaleGrad) -> Result<(), CudaError> {
    if a.n == 0 {
        return Ok(());
    }
    let size = a.dtype.size();
    check_size("gradient", a.n, size)?;
    check_ptr("src", a.src, size)?;
    check_ptr("dst", a.dst, size)?;
    check_ptr("factor", a.factor, a.dtype.acc().size())?;
    let cols = if a.per_row { a.cols } else { a.n };
    if cols == 0 || (a.per_row && !a.n.is_multiple_of(cols)) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: cross_entropy: {} elements are not rows of {cols}",
            a.n
        )));
    }
    let pack = 16 / size;
    let vec = a.n.is_multiple_of(pack)
        && (!a.per_row || cols.is_multiple_of(pack))
        && a.src.is_multiple_of(16)
        && a.dst.is_multiple_of(16);
    let work = if vec { a.n / pack } else { a.n } as u64;
    let mut params = ScaleParams {
        src: a.src,
        dst: a.dst,
        factor: a.factor,
        n: a.n as i64,
        cols: cols as i64,
        per_row: i64::from(a.per_row),
        vec: i64::from(vec),
    };
    let name = format!("graft_ce_scale_{}", dtype_tag(a.dtype));
    let sms = crate::device::state(a.device)?.limits.sms;
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &name,
        grid: grid_covering(work, SCALE_BLOCK).min(sms.max(1) * SCALE_BLOCKS_PER_SM),
        block: SCALE_BLOCK,
        smem: 0,
    };
    launch_named(&launch, &mut params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_match_the_cuda_structs() {
        assert_eq!(std::mem::size_of::<RowsParams>(), 12 * 8);
        assert_eq!(std::mem::size_of::<CountParams>(), 5 * 8);
        assert_eq!(std::mem::size_of::<ReduceParams>(), 4 * 8);
        assert_eq!(std::mem::size_of::<ScaleParams>(), 7 * 8);
        assert_eq!(std::mem::size_of::<BlockStatsParams>(), 11 * 8);
        assert_eq!(std::mem::size_of::<BlockGradParams>(), 9 * 8);
        assert_eq!(std::mem::size_of::<AccumulateParams>(), 4 * 8);
    }

    #[test]
    fn names_cover_every_dtype() {
        let names = kernel_names();
        assert_eq!(names.len(), 4 * 4 + 4);
        assert!(names.contains(&"graft_ce_block_stats_f16".to_string()));
        assert!(names.contains(&"graft_ce_block_grad_bf16".to_string()));
        assert!(names.contains(&"graft_ce_accumulate_f32".to_string()));
        assert!(names.contains(&"graft_ce_rows_bf16".to_string()));
        assert!(names.contains(&"graft_ce_scale_f64".to_string()));
    }

    #[test]
    fn rows_blocks_fit_the_row() {
        let t = RowsTuning::DEFAULT;
        assert_eq!(t.threads_for(128_256, DType::BF16), 256);
        assert_eq!(t.threads_for(1000, DType::BF16), 128);
        assert_eq!(t.threads_for(1, DType::F32), 32);
        assert_eq!(t.threads_for(33, DType::F64), 32);
        let wide = RowsTuning {
            threads: 1024,
            blocks_per_sm: 1,
        };
        assert_eq!(wide.threads_for(128_256, DType::BF16), 1024);
        // float64's kernel bound.
        assert_eq!(wide.threads_for(100_000, DType::F64), 512);
    }

    #[test]
    fn tuning_parses_only_valid_shapes() {
        assert_eq!(
            RowsTuning::parse("512, 2"),
            Some(RowsTuning {
                threads: 512,
                blocks_per_sm: 2
            })
        );
        assert_eq!(RowsTuning::parse("500,2"), None);
        assert_eq!(RowsTuning::parse("2048,1"), None);
        assert_eq!(RowsTuning::parse("512,0"), None);
        assert_eq!(RowsTuning::parse("512"), None);
    }

    #[test]
    fn bad_arguments_are_rejected_before_launching() {
        let rows = CrossEntropyRows {
            device: 0,
            stream: 0,
            dtype: DType::BF16,
            logits: 256,
            target: 512,
            grad: None,
            loss: 1024,
            count: None,
            row_scale: None,
            rows: 4,
            cols: 0,
            ignore_index: -100,
            smoothing: 0.0,
        };
        assert!(cross_entropy_rows(&rows).is_err());
        let odd = CrossEntropyRows {
            cols: 10,
            logits: 257,
            ..rows
        };
        assert!(cross_entropy_rows(&odd)
            .unwrap_err()
            .message()
            .contains("logits"));
        let smooth = CrossEntropyRows {
            cols: 10,
            smoothing: 1.5,
            ..rows
        };
        assert!(cross_entropy_rows(&smooth).is_err());
        let reduce = CrossEntropyReduce {
            device: 0,
            stream: 0,
            dtype: DType::BF16,
            loss_rows: 256,
            count: None,
            out: 512,
            rows: 1,
        };
        assert!(cross_entropy_reduce(&reduce).is_err());
    }
}
