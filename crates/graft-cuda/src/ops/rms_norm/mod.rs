//! RMSNorm launches: argument validation, launch planning and the driver calls.
//!
//! RMSNorm's semantics follow PyTorch's reference composite `_fused_rms_norm` /
//! `_fused_rms_norm_backward`: for a row `x` of `cols` elements,
//! `rstd = 1 / sqrt(mean(x^2) + eps)` in the accumulation type (f32, or f64 for F64),
//! `y = (x * rstd) * w` rounded to the dtype; backward `xhat = x * rstd`, `g = dy * w`,
//! `dx = rstd * (g - xhat * mean(g * xhat))`, `dw = sum over rows of dy * xhat`, reduced
//! in a fixed order (the same bits on every run). [`WeightMode`] gives the variants models
//! write by hand (torchgraft::rms_norm): a weight offset and rounding before the weight.

use crate::runtime::config::{
    self, blocks_per_sm, bwd_grid, bwd_rows_smem, choose_rows, div_ceil, rows_per_block,
    DeviceLimits, KernelAttrs, BWD_ROWS_SMEM_LIMIT, MAX_GRID,
};
use crate::runtime::device::{self, DeviceState};
use crate::runtime::driver::{self, ContextGuard};
use crate::runtime::error::CudaError;
use crate::runtime::launch::launch;
use crate::DType;

mod args;
mod kernels;
mod params;

pub use args::{RmsNormBackward, RmsNormForward, Weight, WeightMode};
pub(crate) use kernels::kernel_table;
#[cfg(test)]
pub(crate) use kernels::NUM_KERNELS;
use kernels::{Body, Dir, WeightKind, FINALIZE_THREADS, LOOP_THREADS};
use params::{BwdParams, FinalizeParams, FwdParams};

/// Forward rows kernels: preferred 16-byte units per thread (128 bytes of `x` in flight).
const FWD_PREF_V: u32 = 8;
/// Backward rows kernels: preferred units per thread (64 bytes each of `x` and `dy`).
const BWD_PREF_V: u32 = 4;
/// Default block size target of the rows kernels.
const TARGET_BLOCK: u32 = 256;
/// Backward: 512-thread blocks, one per SM (persistent). Fastest on an H100 at 8192 and 32768
/// rows x 4096 bf16 (282 us vs 296 us for 256-thread blocks two per SM; bench/results/).
const BWD_TARGET_BLOCK: u32 = 512;
const BWD_BLOCKS_PER_SM: u32 = 1;

/// Overrides of the automatic launch configuration, for tuning runs. The default is the
/// configuration [`rms_norm_forward`] and [`rms_norm_backward`] use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tuning {
    /// 16-byte units per thread of the rows kernels (forward 1, 2, 4, 8, 16; backward 1,
    /// 2, 4, 8; scalar paths fewer); `None`: chosen from `cols`.
    pub units_per_thread: Option<u32>,
    /// Target threads per block (a multiple of 32); `None`: 256 (forward rows), 512 (backward
    /// rows, loop).
    pub block_threads: Option<u32>,
    /// Grid = SMs x this. `None`: forward one block per row set, backward one per SM.
    pub blocks_per_sm: Option<u32>,
    /// Use the two-pass loop kernel even when a rows kernel fits.
    pub force_loop: bool,
}

/// A launch configuration (what [`plan_forward`] / [`plan_backward`] chose).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    kernel: usize,
    finalize: Option<usize>,
    /// Blocks of the main kernel.
    pub grid: u32,
    /// Threads per block of the main kernel.
    pub block: u32,
    /// Dynamic shared memory bytes of the main kernel.
    pub smem_bytes: u32,
    /// 16-byte units per thread (0 for the loop kernel).
    pub units_per_thread: u32,
    /// Threads per row (the block, for the loop kernel).
    pub threads_per_row: u32,
    /// Rows per block per step.
    pub rows_per_block: u32,
    /// 16-byte vector accesses (else scalar).
    pub vec: bool,
    /// Backward loop kernel: dw partial row kept in shared memory.
    pub dw_in_smem: bool,
    /// Backward with dw: bytes of workspace this launch uses (one partial row per block).
    pub workspace_bytes: u64,
    /// Backward with dw: blocks of the finalize kernel.
    pub finalize_grid: u32,
}

impl Plan {
    /// Name of the main kernel.
    pub fn kernel_name(&self) -> String {
        kernels::name(self.kernel)
    }

    /// Name of the dw finalize kernel, if the launch has one.
    pub fn finalize_kernel_name(&self) -> Option<String> {
        self.finalize.map(kernels::name)
    }
}

/// Bytes of device scratch that [`rms_norm_backward`] needs at `workspace` for any dtype
/// (one 8-byte partial row per block of the largest backward grid, `min(rows, 4 * SMs)`
/// blocks); 0 when `want_dw` is false.
pub fn rms_norm_backward_workspace_bytes(
    device: i32,
    rows: usize,
    cols: usize,
    want_dw: bool,
) -> Result<usize, CudaError> {
    if !want_dw {
        return Ok(0);
    }
    let st = device::state(device)?;
    config::workspace_bound(st.limits.sms, rows as u64, cols as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| CudaError::invalid("graft-cuda: workspace size overflows"))
}

/// Like [`rms_norm_backward_workspace_bytes`] for one dtype: `min(rows, 4 * SMs)` partial
/// rows of the accumulation dtype (half the bytes for f32/f16/bf16).
pub fn rms_norm_backward_workspace_bytes_for(
    device: i32,
    dtype: DType,
    rows: usize,
    cols: usize,
    want_dw: bool,
) -> Result<usize, CudaError> {
    let bound = rms_norm_backward_workspace_bytes(device, rows, cols, want_dw)?;
    Ok(bound / 8 * dtype.acc().size())
}

// ---------------------------------------------------------------------------------------
// Validation.

fn check_ptr(name: &str, p: u64, align: usize) -> Result<(), CudaError> {
    if p == 0 {
        return Err(CudaError::invalid(format!(
            "graft-cuda: {name} is a null pointer"
        )));
    }
    if !p.is_multiple_of(align as u64) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: {name} (0x{p:x}) is not aligned to {align} bytes"
        )));
    }
    Ok(())
}

fn check_shape(rows: usize, cols: usize, dtype: DType) -> Result<(), CudaError> {
    if rows == 0 || cols == 0 {
        return Err(CudaError::invalid(format!(
            "graft-cuda: rms_norm needs rows >= 1 and cols >= 1 (got rows={rows}, cols={cols})"
        )));
    }
    let bytes = (rows as u64)
        .checked_mul(cols as u64)
        .and_then(|n| n.checked_mul(dtype.size() as u64));
    if bytes.is_none_or(|b| b > i64::MAX as u64) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: rms_norm of {rows} x {cols} is too large"
        )));
    }
    Ok(())
}

fn check_weight(w: Weight, dtype: DType) -> Result<(), CudaError> {
    match w {
        Weight::None => Ok(()),
        Weight::Same(p) => check_ptr("weight", p, dtype.size()),
        Weight::Acc(p) => check_ptr("weight", p, dtype.acc().size()),
    }
}

/// round_first rounds to the input dtype before the weight multiply; with a weight wider than
/// a 16-bit input the model's product is wider than the input, which these kernels do not
/// write (float32 and float64 inputs round to themselves: any weight).
fn check_mode(mode: WeightMode, w: Weight, dtype: DType) -> Result<(), CudaError> {
    if mode.round_first && matches!(w, Weight::Acc(_)) && dtype.acc() != dtype {
        return Err(CudaError::invalid(format!(
            "graft-cuda: round_first needs a weight of the input dtype ({dtype:?}), got one of \
             the accumulation dtype"
        )));
    }
    Ok(())
}

fn validate_forward(a: &RmsNormForward) -> Result<(), CudaError> {
    check_shape(a.rows, a.cols, a.dtype)?;
    check_ptr("x", a.x, a.dtype.size())?;
    check_ptr("y", a.y, a.dtype.size())?;
    check_ptr("rstd", a.rstd, a.dtype.acc().size())?;
    check_weight(a.weight, a.dtype)?;
    check_mode(a.mode, a.weight, a.dtype)
}

fn validate_backward(a: &RmsNormBackward) -> Result<(), CudaError> {
    check_shape(a.rows, a.cols, a.dtype)?;
    check_ptr("dy", a.dy, a.dtype.size())?;
    check_ptr("x", a.x, a.dtype.size())?;
    check_ptr("rstd", a.rstd, a.dtype.acc().size())?;
    check_weight(a.weight, a.dtype)?;
    check_mode(a.mode, a.weight, a.dtype)?;
    if let Some(dx) = a.dx {
        check_ptr("dx", dx, a.dtype.size())?;
    }
    if let Some(dw) = a.dw {
        let wdt = a.weight.dtype(a.dtype).ok_or_else(|| {
            CudaError::invalid("graft-cuda: rms_norm_backward: dw requested without a weight")
        })?;
        check_ptr("dw", dw, wdt.size())?;
        check_ptr("workspace", a.workspace, 16)?;
    }
    Ok(())
}

fn weight_kind(w: Weight) -> WeightKind {
    match w {
        Weight::None => WeightKind::None,
        Weight::Same(_) => WeightKind::Same,
        Weight::Acc(_) => WeightKind::Acc,
    }
}

fn aligned16(ptrs: &[u64]) -> bool {
    ptrs.iter().all(|p| p % 16 == 0)
}

// ---------------------------------------------------------------------------------------
// Planning (pure given the device's limits and kernel attributes).

/// The problem a plan is made for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    pub dir: Dir,
    pub dtype: DType,
    pub weight: WeightKind,
    pub rows: u64,
    pub cols: u64,
    /// All row pointers 16-byte aligned and rows a whole number of 16-byte units.
    pub vec: bool,
    /// Backward only.
    pub has_dw: bool,
}

fn tuning_error(what: String) -> CudaError {
    CudaError::invalid(format!("graft-cuda: tuning: {what}"))
}

pub(crate) fn plan(
    p: &Problem,
    lim: &DeviceLimits,
    attrs: &dyn Fn(usize) -> KernelAttrs,
    t: &Tuning,
) -> Result<Plan, CudaError> {
    let elem = p.dtype.size() as u64;
    let ve = 16 / elem;
    let acc = p.dtype.acc().size() as u64;
    let nunits = div_ceil(p.cols, ve);
    let target = t.block_threads.unwrap_or(if p.dir == Dir::Bwd {
        BWD_TARGET_BLOCK
    } else {
        TARGET_BLOCK
    });
    if target == 0 || !target.is_multiple_of(32) || target > 1024 {
        return Err(tuning_error(format!(
            "block_threads {target} is not a multiple of 32 in 32..=1024"
        )));
    }
    let pref = if p.dir == Dir::Fwd {
        FWD_PREF_V
    } else {
        BWD_PREF_V
    };
    let table = kernels::rows_table(p.dir, p.vec);
    let rows_shape = if t.force_loop {
        None
    } else {
        let s = choose_rows(nunits, table, pref, t.units_per_thread);
        if s.is_none() && t.units_per_thread.is_some() {
            return Err(tuning_error(format!(
                "{} units per thread cannot cover {} columns",
                t.units_per_thread.unwrap_or(0),
                p.cols
            )));
        }
        s
    };

    let mut out = Plan {
        kernel: 0,
        finalize: None,
        grid: 0,
        block: 0,
        smem_bytes: 0,
        units_per_thread: 0,
        threads_per_row: 0,
        rows_per_block: 1,
        vec: p.vec,
        dw_in_smem: false,
        workspace_bytes: 0,
        finalize_grid: 0,
    };
    let sets;
    if let Some(s) = rows_shape {
        let mut rpb = rows_per_block(s.tpr, target, s.max_threads, p.rows);
        if p.dir == Dir::Bwd && p.has_dw {
            let per_warp = if s.tpr < 32 { 32 / s.tpr } else { 1 };
            while rpb > per_warp
                && bwd_rows_smem(rpb, s.tpr, s.v, ve as u32, acc as u32) > BWD_ROWS_SMEM_LIMIT
            {
                rpb -= per_warp;
            }
            out.smem_bytes = bwd_rows_smem(rpb, s.tpr, s.v, ve as u32, acc as u32) as u32;
        }
        out.kernel = kernels::index(p.dir, p.dtype, p.weight, Body::Rows { v: s.v, vec: p.vec })
            .expect("choose_rows picks instantiated V");
        out.units_per_thread = s.v;
        out.threads_per_row = s.tpr;
        out.rows_per_block = rpb;
        out.block = s.tpr * rpb;
        sets = div_ceil(p.rows, u64::from(rpb));
    } else {
        let threads = t.block_threads.unwrap_or(LOOP_THREADS).min(LOOP_THREADS);
        out.kernel = kernels::index(p.dir, p.dtype, p.weight, Body::Loop).expect("loop kernels");
        out.threads_per_row = threads;
        out.block = threads;
        if p.dir == Dir::Bwd && p.has_dw {
            let k = attrs(out.kernel);
            let bytes = p.cols * acc;
            let room = u64::from(lim.smem_per_block_optin).saturating_sub(u64::from(k.static_smem));
            if bytes <= room {
                out.dw_in_smem = true;
                out.smem_bytes = bytes as u32;
            }
        }
        sets = p.rows;
    }

    out.grid = match (p.dir, t.blocks_per_sm) {
        (Dir::Fwd, None) => sets.min(MAX_GRID) as u32,
        (Dir::Fwd, Some(b)) => (u64::from(lim.sms) * u64::from(b.max(1)))
            .min(sets)
            .min(MAX_GRID) as u32,
        (Dir::Bwd, b) => {
            // As many blocks per SM as fit; rows kernels default to one (measured fastest).
            let fit = blocks_per_sm(
                lim,
                &attrs(out.kernel),
                out.block,
                u64::from(out.smem_bytes),
            );
            let default = if rows_shape.is_some() {
                BWD_BLOCKS_PER_SM
            } else {
                fit
            };
            bwd_grid(lim.sms, b.unwrap_or(default).min(fit.max(1)), sets)
        }
    };

    if p.dir == Dir::Bwd && p.has_dw {
        let wdt = match p.weight {
            WeightKind::Same => p.dtype,
            _ => p.dtype.acc(),
        };
        out.finalize = kernels::finalize_index(p.dtype.acc(), wdt);
        out.finalize_grid = div_ceil(p.cols, 32).min(MAX_GRID) as u32;
        out.workspace_bytes = config::workspace_bytes(u64::from(out.grid), p.cols, acc)
            .ok_or_else(|| CudaError::invalid("graft-cuda: workspace size overflows"))?;
    }
    Ok(out)
}

fn forward_problem(a: &RmsNormForward) -> Problem {
    let row_bytes_ok = (a.cols * a.dtype.size()).is_multiple_of(16);
    Problem {
        dir: Dir::Fwd,
        dtype: a.dtype,
        weight: weight_kind(a.weight),
        rows: a.rows as u64,
        cols: a.cols as u64,
        vec: row_bytes_ok && aligned16(&[a.x, a.y, a.weight.ptr()]),
        has_dw: false,
    }
}

fn backward_problem(a: &RmsNormBackward) -> Problem {
    let row_bytes_ok = (a.cols * a.dtype.size()).is_multiple_of(16);
    Problem {
        dir: Dir::Bwd,
        dtype: a.dtype,
        weight: weight_kind(a.weight),
        rows: a.rows as u64,
        cols: a.cols as u64,
        vec: row_bytes_ok && aligned16(&[a.dy, a.x, a.dx.unwrap_or(0), a.weight.ptr()]),
        has_dw: a.dw.is_some(),
    }
}

fn attrs_of(st: &DeviceState) -> impl Fn(usize) -> KernelAttrs + '_ {
    move |i| st.attrs[i]
}

/// The configuration [`rms_norm_forward_with`] would launch (validates the arguments and
/// loads the device's kernels, launches nothing).
pub fn plan_forward(a: &RmsNormForward, t: &Tuning) -> Result<Plan, CudaError> {
    validate_forward(a)?;
    let st = device::state(a.device)?;
    plan(&forward_problem(a), &st.limits, &attrs_of(st), t)
}

/// The configuration [`rms_norm_backward_with`] would launch.
pub fn plan_backward(a: &RmsNormBackward, t: &Tuning) -> Result<Plan, CudaError> {
    validate_backward(a)?;
    let st = device::state(a.device)?;
    plan(&backward_problem(a), &st.limits, &attrs_of(st), t)
}

// ---------------------------------------------------------------------------------------
// Launching.

/// RMSNorm forward with the automatic configuration: writes `y` and `rstd`.
pub fn rms_norm_forward(a: &RmsNormForward) -> Result<(), CudaError> {
    rms_norm_forward_with(a, &Tuning::default())
}

/// RMSNorm forward with a tuned configuration.
pub fn rms_norm_forward_with(a: &RmsNormForward, t: &Tuning) -> Result<(), CudaError> {
    validate_forward(a)?;
    let api = driver::api()?;
    let st = device::state(a.device)?;
    let pl = plan(&forward_problem(a), &st.limits, &attrs_of(st), t)?;
    let mut p = FwdParams {
        x: a.x,
        w: a.weight.ptr(),
        y: a.y,
        rstd: a.rstd,
        rows: a.rows as i64,
        cols: a.cols as i64,
        tpr: i64::from(pl.threads_per_row),
        rpb: i64::from(pl.rows_per_block),
        vec: i64::from(pl.vec),
        eps: a.eps,
        inv_cols: 1.0 / a.cols as f64,
        offset: a.mode.kernel_offset(),
        round_first: i64::from(a.mode.round_first),
    };
    let _ctx = ContextGuard::enter(api, st.ctx)?;
    launch(
        api,
        st,
        pl.kernel,
        pl.grid,
        pl.block,
        pl.smem_bytes,
        a.stream,
        &mut p,
    )
}

/// RMSNorm backward with the automatic configuration: writes `dx` and/or `dw`.
pub fn rms_norm_backward(a: &RmsNormBackward) -> Result<(), CudaError> {
    rms_norm_backward_with(a, &Tuning::default())
}

/// RMSNorm backward with a tuned configuration.
pub fn rms_norm_backward_with(a: &RmsNormBackward, t: &Tuning) -> Result<(), CudaError> {
    validate_backward(a)?;
    if a.dx.is_none() && a.dw.is_none() {
        return Ok(());
    }
    let api = driver::api()?;
    let st = device::state(a.device)?;
    let pl = plan(&backward_problem(a), &st.limits, &attrs_of(st), t)?;
    if pl.workspace_bytes > a.workspace_bytes as u64 {
        return Err(CudaError::invalid(format!(
            "graft-cuda: rms_norm_backward needs {} bytes of workspace, got {} (see \
             rms_norm_backward_workspace_bytes)",
            pl.workspace_bytes, a.workspace_bytes
        )));
    }
    let mut p = BwdParams {
        dy: a.dy,
        x: a.x,
        rstd: a.rstd,
        w: a.weight.ptr(),
        dx: a.dx.unwrap_or(0),
        partial: if a.dw.is_some() { a.workspace } else { 0 },
        rows: a.rows as i64,
        cols: a.cols as i64,
        tpr: i64::from(pl.threads_per_row),
        rpb: i64::from(pl.rows_per_block),
        vec: i64::from(pl.vec),
        has_dx: i64::from(a.dx.is_some()),
        has_dw: i64::from(a.dw.is_some()),
        dw_smem: i64::from(pl.dw_in_smem),
        inv_cols: 1.0 / a.cols as f64,
        offset: a.mode.kernel_offset(),
        round_first: i64::from(a.mode.round_first),
    };
    let _ctx = ContextGuard::enter(api, st.ctx)?;
    launch(
        api,
        st,
        pl.kernel,
        pl.grid,
        pl.block,
        pl.smem_bytes,
        a.stream,
        &mut p,
    )?;
    if let (Some(dw), Some(fin)) = (a.dw, pl.finalize) {
        let mut f = FinalizeParams {
            partial: a.workspace,
            dw,
            nparts: i64::from(pl.grid),
            cols: a.cols as i64,
        };
        launch(
            api,
            st,
            fin,
            pl.finalize_grid,
            FINALIZE_THREADS,
            0,
            a.stream,
            &mut f,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
