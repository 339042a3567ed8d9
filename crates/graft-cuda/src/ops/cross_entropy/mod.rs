//! Cross-entropy rows (loss and gradient in one kernel), the count of rows not ignored, the
//! reduction of the per-row losses, and scaling a gradient by the upstream gradient: launched
//! from cross_entropy.cu.
//!
//! A loss is computed by [`cross_entropy_count`] (always first: it also checks the targets),
//! then [`cross_entropy_rows`], then, for `sum` / `mean`, [`cross_entropy_reduce`], all on one
//! stream; nothing waits for the host.
//!
//! The vocabulary-blocked fused linear cross-entropy runs [`cross_entropy_block_stats`] over
//! each block of classes (after the count), then, for its gradient, [`cross_entropy_block_grad`]
//! over each block again; [`accumulate_f32`] adds its f32 partial products.

use crate::runtime::error::CudaError;
use crate::runtime::kernels::Kernel;
use crate::runtime::launch::{grid_covering, launch_named, NamedLaunch};
use crate::DType;

mod args;

pub use args::{
    AccumulateF32, CrossEntropyBlockGrad, CrossEntropyBlockStats, CrossEntropyCount,
    CrossEntropyReduce, CrossEntropyRows, ScaleGrad,
};
use args::{
    AccumulateParams, BlockGradParams, BlockStatsParams, CountParams, ReduceParams, RowsParams,
    ScaleParams,
};

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
    /// (bench/kernel_lab/cross_entropy_sweep.py; a sweep of the op passes its own shape to
    /// [`cross_entropy_rows_with`]).
    /// The rows in flight (528 x 256 KB) outgrow L2, yet pass 2 is not slower for it.
    pub const DEFAULT: RowsTuning = RowsTuning {
        threads: 256,
        blocks_per_sm: 4,
    };

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

/// cross_entropy's kernel table: its kernels need no attribute set at load time.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names().into_iter().map(Kernel::plain).collect()
}

/// Entry points of cross_entropy.cu.
fn kernel_names() -> Vec<String> {
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
    cross_entropy_rows_with(a, RowsTuning::DEFAULT)
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
    let st = crate::runtime::device::state(a.device)?;
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
    let st = crate::runtime::device::state(device)?;
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
    let sms = crate::runtime::device::state(a.device)?.limits.sms;
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
mod tests;
