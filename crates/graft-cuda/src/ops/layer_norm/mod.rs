//! LayerNorm launches (layer_norm.cu): validation, the choice of kernel and launch
//! shape, the launches.
//!
//! Rows that fit a row group's registers take the rows kernels (forward up to 4096 units of
//! 16 bytes, backward up to 2048 (f32) or 1024 (16-bit)); wider rows the loop kernels. The
//! forward of 16-bit rows of 2048 to 16384 columns takes the staged kernel instead (the row in
//! shared memory: more rows in flight per SM than registers allow). The backward runs a
//! persistent grid of at most [`BWD_MAX_BLOCKS_PER_SM`] blocks per SM, each writing one
//! partial row of dw and db to the workspace, and the finalize kernel sums them in block
//! order. With 16-byte access its rows kernels stage the next set's x and dy rows in shared
//! memory (cp.async) while a set computes, opting in to more than the default 48 KB. The
//! backward of 16-bit rows of 7168 to 8192 columns runs the bulk kernel instead where the
//! device has clusters: clusters of four blocks, each a slice of every row, one partial row per
//! cluster.

use crate::runtime::config::{
    blocks_per_sm, choose_rows, rows_per_block, DeviceLimits, KernelAttrs, MAX_GRID,
};
use crate::runtime::device;
use crate::runtime::error::CudaError;
use crate::runtime::kernels::{Kernel, LoadAttrs};
use crate::runtime::launch::{index_of, launch_named, NamedLaunch};
use crate::DType;

mod args;

use args::{FinalizeParams, LayerNormParams};
pub use args::{LayerNormBackward, LayerNormForward};

/// Backward grids hold at most this many blocks per SM (bounding the workspace). Fewer blocks
/// write fewer partial rows for the finalize kernel to read (H100, bf16, 32768 x 4096, staged
/// rows kernel + finalize: 0.309 ms with 2 blocks per SM, 0.336 with 4;
/// bench/kernel_lab/layer_norm_sweep.py).
pub const BWD_MAX_BLOCKS_PER_SM: u32 = 2;
/// Block size of the loop kernels (`kLoopThreads`).
const LOOP_THREADS: u32 = 512;
/// Threads per block the forward rows kernels aim for: one row per block from 64 threads a row
/// (a row's reduction then waits for no other row's): H100, bf16, 128 M elements, time
/// against a copy with 1 / 2 / 4 rows per block: hidden 2048 1.023x / 1.027x / 1.063x, 4096
/// 1.055x / 1.087x / 1.139x; hidden 1024 (32 threads a row) 1.013x / 1.012x / 1.017x
/// (bench/kernel_lab/layer_norm_fwd_sweep.py; 256 threads, 1.088x-1.108x, before).
const FWD_TARGET_BLOCK: u32 = 64;
/// Threads per block the backward rows kernels aim for: H100, bf16, staged, against the
/// three-pass floor, V = 2: hidden 4096 1 row per block 1.146x, 2 rows 1.150x; hidden 2048 2
/// rows (256 threads) 1.146x, 4 rows 1.169x (bench/kernel_lab/layer_norm_sweep.py).
const BWD_TARGET_BLOCK: u32 = 256;
/// Units of 16 bytes (16-bit rows with 16-byte access) the staged forward takes. H100, bf16,
/// 128 M elements, kernel alone against a copy, the rows kernels at the planner's shape / the
/// staged kernel (bench/kernel_lab/layer_norm_fwd_sweep.py, three runs): hidden 1024
/// 1.017x-1.025x / 1.023x (not taken), 2048 1.019x-1.029x / 1.016x-1.018x, 4096
/// 1.035x-1.036x / 1.019x-1.022x, 8192 1.068x-1.075x / 1.016x-1.022x, 16384 1.126x-1.127x /
/// 1.025x-1.026x. At 32768 (64 KB of shared memory a row, beyond the rows kernels) it ran at
/// 1.053x-1.055x; the loop kernel it would replace there was not measured.
const FWD_STAGED_UNITS: std::ops::RangeInclusive<u64> = 256..=2048;
/// Units of 16 bytes (16-bit rows with 16-byte access) the bulk backward takes: H100, bf16,
/// 128 M elements, with the finalize kernel, against the three-pass floor, bulk / the rows
/// kernels' best shape in the same run (bench/kernel_lab/layer_norm_sweep.py): hidden 8192
/// 1.125x-1.131x (two runs) / 1.175x-1.213x (three), 7168 1.148x / 1.211x. At 6208 (776
/// units) the bulk kernel ran at 1.201x, its slices too short to hide a row's fixed costs, and
/// the rows kernels were not measured there: not taken.
const BWD_BULK_UNITS: std::ops::RangeInclusive<u64> = 896..=1024;
/// The bulk backward's cluster size, block size and units a thread (`kBulkCluster`,
/// `kBulkThreads`, `kBulkUnits` in layer_norm.cu).
const BULK_CLUSTER: u32 = 4;
const BULK_THREADS: u32 = 128;
/// Shared memory the backward rows kernels may use to add their row groups when they do not
/// stage rows (then they do not opt in to more than the default).
const BWD_ROWS_SMEM_LIMIT: u64 = 48 * 1024;

/// Dynamic shared memory of a staged backward rows block: two buffers of its groups' x and dy
/// rows (`v * tpr` units of 16 bytes each).
fn stage_bytes(rpb: u32, v: u32, tpr: u32) -> u64 {
    4 * u64::from(rpb) * u64::from(v) * u64::from(tpr) * 16
}

/// (V, maximum threads per block) of the rows kernels: the launch bounds of
/// layer_norm.cu (`RowsBounds`).
fn rows_table(backward: bool, elem: u64, vec: bool) -> &'static [(u32, u32)] {
    match (backward, elem, vec) {
        (false, 4, true) => &[(1, 1024), (2, 1024), (4, 1024), (8, 256)],
        (false, _, true) => &[(1, 1024), (2, 1024), (4, 512), (8, 256)],
        (false, _, false) => &[(1, 1024), (2, 512)],
        (true, 2, true) => &[(1, 512), (2, 512), (4, 256)],
        (true, 2, false) => &[(1, 512), (2, 256)],
        (true, 4, false) => &[(1, 1024), (2, 256)],
        (true, _, true) => &[(1, 1024), (2, 512), (4, 256)],
        (true, _, false) => &[(1, 1024), (2, 512)],
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

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

/// Which kernel a launch uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    Rows {
        v: u32,
        vec: bool,
    },
    Loop,
    /// The staged forward (16-bit).
    Staged,
    /// The bulk backward (16-bit, clusters).
    Bulk,
}

fn name(dir: &str, body: Body, dtype: DType) -> String {
    let dt = dtype_tag(dtype);
    match body {
        Body::Rows { v, vec } => {
            let kind = if vec { 'v' } else { 's' };
            format!("graft_ln_{dir}_rows_{kind}{v}_{dt}")
        }
        Body::Loop => format!("graft_ln_{dir}_loop_{dt}"),
        Body::Staged => format!("graft_ln_{dir}_staged_{dt}"),
        Body::Bulk => format!("graft_ln_{dir}_bulk_{dt}"),
    }
}

/// layer_norm's kernel table: the backward rows kernels opt in to large shared
/// memory.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names()
        .into_iter()
        .map(|name| {
            let attrs = LoadAttrs {
                large_smem: wants_large_smem(&name),
                ..LoadAttrs::default()
            };
            Kernel { name, attrs }
        })
        .collect()
}

/// Entry points of layer_norm.cu.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for dtype in DTYPES {
        for (dir, backward) in [("fwd", false), ("bwd", true)] {
            for vec in [true, false] {
                // The kernels are instantiated for every dtype with the same V sets.
                for &(v, _) in rows_table(backward, 4, vec) {
                    out.push(name(dir, Body::Rows { v, vec }, dtype));
                }
            }
            out.push(name(dir, Body::Loop, dtype));
        }
        if dtype.size() == 2 {
            out.push(name("fwd", Body::Staged, dtype));
            out.push(name("bwd", Body::Bulk, dtype));
        }
        out.push(format!("graft_ln_finalize_{}", dtype_tag(dtype)));
    }
    out
}

/// Whether kernel `name` may take more than the default 48 KB of dynamic shared memory: the
/// backward rows kernels with vector access, which stage rows there.
fn wants_large_smem(name: &str) -> bool {
    name.starts_with("graft_ln_bwd_rows_v")
}

/// The problem as the planner sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    pub backward: bool,
    pub elem: u64,
    /// Bytes of the accumulation type.
    pub acc: u64,
    pub rows: u64,
    pub cols: u64,
    pub vec: bool,
    /// Backward: dw or db wanted.
    pub sums: bool,
}

/// A launch's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub body: Body,
    pub grid: u32,
    pub block: u32,
    pub smem: u32,
    pub tpr: u32,
    pub rpb: u32,
    /// Backward rows kernels: the next x and dy rows staged in shared memory.
    pub stage: bool,
}

/// The launch for `p`; `attrs(body)` gives the chosen kernel's compiled attributes and
/// `clusters(smem)` how many clusters of the bulk backward with `smem` bytes of dynamic shared
/// memory can be resident (0: none, or the driver cannot say).
pub(crate) fn plan(
    p: &Problem,
    lim: &DeviceLimits,
    attrs: &dyn Fn(Body) -> KernelAttrs,
    clusters: &dyn Fn(u32) -> u32,
) -> Plan {
    let nunits = p.cols.div_ceil(16 / p.elem);
    if p.backward && p.elem == 2 && p.vec && lim.clusters && BWD_BULK_UNITS.contains(&nunits) {
        // Two buffers of the block's slice of x and dy.
        let smem = (4 * nunits.div_ceil(u64::from(BULK_CLUSTER)) * 16) as u32;
        // As many clusters as can be resident (a row's blocks wait for each other), at most
        // one per BWD_MAX_BLOCKS_PER_SM blocks of the grid the workspace was sized for.
        let most = lim.sms * BWD_MAX_BLOCKS_PER_SM;
        let n = u64::from(clusters(smem).min(most)).min(p.rows);
        if n > 0 {
            return Plan {
                body: Body::Bulk,
                grid: (n * u64::from(BULK_CLUSTER)) as u32,
                block: BULK_THREADS,
                smem,
                tpr: BULK_THREADS,
                rpb: 1,
                stage: false,
            };
        }
    }
    if !p.backward && p.elem == 2 && p.vec && FWD_STAGED_UNITS.contains(&nunits) {
        // One row per block, as many blocks as rows (finished blocks are replaced at once).
        // Two units a thread in 128 to 256 threads, four above (the same sweep: hidden 2048
        // 128 threads 1.016x-1.018x, 64 1.028x; 4096 256 1.019x-1.022x, 128 1.021x-1.022x;
        // 8192 256 1.016x-1.022x, 512 1.057x; 16384 512 1.025x, 256 1.036x).
        let block = (nunits / 2)
            .clamp(128, 256)
            .max(nunits / 4)
            .next_multiple_of(32) as u32;
        return Plan {
            body: Body::Staged,
            grid: p.rows.clamp(1, MAX_GRID) as u32,
            block,
            smem: (nunits * 16) as u32,
            tpr: block,
            rpb: 1,
            stage: false,
        };
    }
    let table = rows_table(p.backward, p.elem, p.vec);
    let pref = if p.backward { 2 } else { 4 };
    let target = if p.backward {
        BWD_TARGET_BLOCK
    } else {
        FWD_TARGET_BLOCK
    };
    let mut plan = match choose_rows(nunits, table, pref, None) {
        Some(s) => {
            let mut rpb = rows_per_block(s.tpr, target, s.max_threads, p.rows);
            let partial_bytes = |rpb: u32| {
                let units = u64::from(rpb - 1) * u64::from(s.v) * (16 / p.elem) * u64::from(s.tpr);
                units * 2 * p.acc
            };
            let per_warp = if s.tpr < 32 { 32 / s.tpr } else { 1 };
            let body = Body::Rows { v: s.v, vec: p.vec };
            let static_smem = u64::from(attrs(body).static_smem);
            // Staging (vector access) opts in to the device's shared memory; without it, static
            // and dynamic shared memory stay within the default limit.
            let optin = u64::from(lim.smem_per_block_optin).saturating_sub(static_smem);
            let stage = p.backward && p.vec && stage_bytes(per_warp, s.v, s.tpr) <= optin;
            let need = |rpb: u32| {
                let partial = if p.backward && p.sums {
                    partial_bytes(rpb)
                } else {
                    0
                };
                if stage {
                    partial.max(stage_bytes(rpb, s.v, s.tpr))
                } else {
                    partial
                }
            };
            let limit = if stage {
                optin
            } else {
                BWD_ROWS_SMEM_LIMIT.saturating_sub(static_smem)
            };
            while rpb > per_warp && need(rpb) > limit {
                rpb -= per_warp;
            }
            let bytes = need(rpb);
            Plan {
                body,
                grid: p.rows.div_ceil(u64::from(rpb)).clamp(1, MAX_GRID) as u32,
                block: s.tpr * rpb,
                smem: bytes as u32,
                tpr: s.tpr,
                rpb,
                stage,
            }
        }
        None => Plan {
            body: Body::Loop,
            grid: p.rows.clamp(1, MAX_GRID) as u32,
            block: LOOP_THREADS,
            smem: 0,
            tpr: LOOP_THREADS,
            rpb: 1,
            stage: false,
        },
    };
    let per_sm = blocks_per_sm(lim, &attrs(plan.body), plan.block, u64::from(plan.smem));
    let cap = if p.backward {
        // Persistent: as many blocks as fit at once, at most BWD_MAX_BLOCKS_PER_SM per SM.
        per_sm.clamp(1, BWD_MAX_BLOCKS_PER_SM)
    } else if plan.body == Body::Loop {
        per_sm.max(1) * 4
    } else {
        u32::MAX / lim.sms.max(1)
    };
    let max_grid = u64::from(lim.sms) * u64::from(cap);
    plan.grid = u64::from(plan.grid).min(max_grid).clamp(1, MAX_GRID) as u32;
    plan
}

fn check_ptr(name: &str, p: u64, align: usize) -> Result<(), CudaError> {
    if p == 0 || !p.is_multiple_of(align as u64) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: layer_norm: {name} (0x{p:x}) is null or not aligned to {align} bytes"
        )));
    }
    Ok(())
}

fn check_shape(rows: usize, cols: usize, dtype: DType) -> Result<(), CudaError> {
    let bytes = (rows as u64)
        .checked_mul(cols as u64)
        .and_then(|n| n.checked_mul(dtype.size() as u64));
    if rows == 0 || cols == 0 || bytes.is_none_or(|b| b > i64::MAX as u64) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: layer_norm needs 1 <= rows x cols of addressable size (got {rows} x {cols})"
        )));
    }
    Ok(())
}

fn vectorizable(ptrs: &[u64], cols: usize, dtype: DType) -> bool {
    (cols * dtype.size()).is_multiple_of(16) && ptrs.iter().all(|p| p.is_multiple_of(16))
}

fn attrs_for<'a>(
    st: &'a device::DeviceState,
    dir: &'a str,
    dtype: DType,
) -> impl Fn(Body) -> KernelAttrs + 'a {
    move |body| {
        index_of(&name(dir, body, dtype))
            .map(|i| st.attrs[i])
            .unwrap_or(KernelAttrs {
                regs: 255,
                static_smem: 0,
                max_threads: 256,
            })
    }
}

/// LayerNorm forward: writes `y`, `mean` and `rstd`.
pub fn layer_norm_forward(a: &LayerNormForward) -> Result<(), CudaError> {
    check_shape(a.rows, a.cols, a.dtype)?;
    let size = a.dtype.size();
    check_ptr("x", a.x, size)?;
    check_ptr("y", a.y, size)?;
    check_ptr("mean", a.mean, a.dtype.acc().size())?;
    check_ptr("rstd", a.rstd, a.dtype.acc().size())?;
    for (n, p) in [("weight", a.weight), ("bias", a.bias)] {
        if p != 0 {
            check_ptr(n, p, size)?;
        }
    }
    let ptrs = [a.x, a.y, a.weight, a.bias];
    let st = device::state(a.device)?;
    let problem = Problem {
        backward: false,
        elem: size as u64,
        acc: a.dtype.acc().size() as u64,
        rows: a.rows as u64,
        cols: a.cols as u64,
        vec: vectorizable(&ptrs, a.cols, a.dtype),
        sums: false,
    };
    let pl = plan(&problem, &st.limits, &attrs_for(st, "fwd", a.dtype), &|_| 0);
    let mut params = LayerNormParams {
        x: a.x,
        w: a.weight,
        b: a.bias,
        y: a.y,
        mean: a.mean,
        rstd: a.rstd,
        rows: a.rows as i64,
        cols: a.cols as i64,
        tpr: i64::from(pl.tpr),
        rpb: i64::from(pl.rpb),
        vec: i64::from(problem.vec),
        eps: a.eps,
        inv_cols: 1.0 / a.cols as f64,
        ..LayerNormParams::default()
    };
    let kernel = name("fwd", pl.body, a.dtype);
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &kernel,
        grid: pl.grid,
        block: pl.block,
        smem: pl.smem,
    };
    launch_named(&launch, &mut params)
}

/// Bytes of device scratch [`layer_norm_backward`] needs for dw and db (0 without them): one
/// partial row of `2 * cols` accumulation-type values per block of the largest grid.
pub fn layer_norm_backward_workspace_bytes(
    device: i32,
    dtype: DType,
    rows: usize,
    cols: usize,
    sums: bool,
) -> Result<usize, CudaError> {
    if !sums {
        return Ok(0);
    }
    let sms = device::state(device)?.limits.sms;
    let grid = (u64::from(sms) * u64::from(BWD_MAX_BLOCKS_PER_SM)).min(rows as u64);
    grid.checked_mul(2 * cols as u64)
        .and_then(|n| n.checked_mul(dtype.acc().size() as u64))
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| CudaError::invalid("graft-cuda: layer_norm workspace size overflows"))
}

/// LayerNorm backward: writes whichever of `dx`, `dw` and `db` are given.
pub fn layer_norm_backward(a: &LayerNormBackward) -> Result<(), CudaError> {
    check_shape(a.rows, a.cols, a.dtype)?;
    let size = a.dtype.size();
    check_ptr("dy", a.dy, size)?;
    check_ptr("x", a.x, size)?;
    check_ptr("mean", a.mean, a.dtype.acc().size())?;
    check_ptr("rstd", a.rstd, a.dtype.acc().size())?;
    for (n, p) in [
        ("weight", Some(a.weight).filter(|&w| w != 0)),
        ("dx", a.dx),
        ("dw", a.dw),
        ("db", a.db),
    ] {
        if let Some(p) = p {
            check_ptr(n, p, size)?;
        }
    }
    let sums = a.dw.is_some() || a.db.is_some();
    if a.dx.is_none() && !sums {
        return Ok(());
    }
    let needed = layer_norm_backward_workspace_bytes(a.device, a.dtype, a.rows, a.cols, sums)?;
    if sums {
        check_ptr("workspace", a.workspace, 16)?;
        if a.workspace_bytes < needed {
            return Err(CudaError::invalid(format!(
                "graft-cuda: layer_norm workspace of {} bytes, {needed} needed",
                a.workspace_bytes
            )));
        }
    }
    let ptrs = [a.dy, a.x, a.dx.unwrap_or(0), a.weight];
    let st = device::state(a.device)?;
    let problem = Problem {
        backward: true,
        elem: size as u64,
        acc: a.dtype.acc().size() as u64,
        rows: a.rows as u64,
        cols: a.cols as u64,
        vec: vectorizable(&ptrs, a.cols, a.dtype),
        sums,
    };
    // A failed query (as an old driver's) leaves the rows to the other kernels.
    let clusters = |smem: u32| {
        index_of(&name("bwd", Body::Bulk, a.dtype))
            .and_then(|k| device::resident_clusters(a.device, k, BULK_CLUSTER, BULK_THREADS, smem))
            .unwrap_or(0)
    };
    let pl = plan(
        &problem,
        &st.limits,
        &attrs_for(st, "bwd", a.dtype),
        &clusters,
    );
    let partial = if sums { a.workspace } else { 0 };
    let mut params = LayerNormParams {
        x: a.x,
        w: a.weight,
        mean: a.mean,
        rstd: a.rstd,
        dy: a.dy,
        dx: a.dx.unwrap_or(0),
        partial,
        rows: a.rows as i64,
        cols: a.cols as i64,
        tpr: i64::from(pl.tpr),
        rpb: i64::from(pl.rpb),
        vec: i64::from(problem.vec),
        stage: i64::from(pl.stage),
        inv_cols: 1.0 / a.cols as f64,
        ..LayerNormParams::default()
    };
    let kernel = name("bwd", pl.body, a.dtype);
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &kernel,
        grid: pl.grid,
        block: pl.block,
        smem: pl.smem,
    };
    launch_named(&launch, &mut params)?;
    if !sums {
        return Ok(());
    }
    let mut fin = FinalizeParams {
        partial,
        dw: a.dw.unwrap_or(0),
        db: a.db.unwrap_or(0),
        // One partial row per block, or per cluster of the bulk kernel.
        nparts: i64::from(match pl.body {
            Body::Bulk => pl.grid / BULK_CLUSTER,
            _ => pl.grid,
        }),
        cols: a.cols as i64,
    };
    let fname = format!("graft_ln_finalize_{}", dtype_tag(a.dtype));
    let launch = NamedLaunch {
        device: a.device,
        stream: a.stream,
        name: &fname,
        grid: (a.cols as u64).div_ceil(32).min(MAX_GRID) as u32,
        block: 256,
        smem: 0,
    };
    launch_named(&launch, &mut fin)
}

#[cfg(test)]
mod tests;
