//! Softmax and log-softmax launches (softmax.cu): validation, the choice of kernel
//! and launch shape, the launch.
//!
//! `inner == 1` (the reduced dim is the last of the contiguous tensor): the rows kernels when a
//! row fits in a row group's registers (forward up to 1024 units of 16 bytes with 16-bit
//! input and output, else 2048; backward 2048), else the loop kernel, which stages the row in
//! shared memory (one read from memory). Rows too wide for one block's share of an SM are
//! split over a cluster of 2 to 8 blocks (the split kernels, sm_90+), each staging its part;
//! such rows in 16-bit types run the bulk kernels instead, a persistent grid of clusters that
//! fetches each block's next slice while it writes the current one. Rows that do not fit even
//! so are read twice, with the grid sized so that the second read finds the row in L2.
//! `inner > 1`: the cols kernels.

use crate::runtime::config::{blocks_per_sm, choose_rows, rows_per_block, MAX_GRID};
use crate::runtime::device;
use crate::runtime::error::CudaError;
use crate::runtime::kernels::{Kernel, LoadAttrs};
use crate::runtime::launch::{index_of, launch_named, NamedLaunch};
use crate::DType;

mod args;

use args::SoftmaxParams;
pub use args::{SoftmaxBackward, SoftmaxForward};

/// (V, maximum threads per block) of the rows kernels by direction, input element size and
/// vector (16-byte) or scalar access: the launch bounds of softmax.cu (`RowsBounds`).
fn rows_table(backward: bool, elem: u64, vec: bool) -> &'static [(u32, u32)] {
    match (backward, elem, vec) {
        (false, 2, false) => &[(1, 1024), (2, 1024)],
        (false, _, true) => &[(1, 1024), (2, 1024), (4, 1024), (8, 256)],
        (false, _, false) => &[(1, 1024), (2, 512)],
        (true, 4, true) => &[(1, 1024), (2, 512), (4, 1024), (8, 256)],
        (true, 4, false) => &[(1, 512), (2, 1024)],
        (true, 2, true) => &[(1, 512), (2, 1024), (4, 256)],
        (true, 2, false) => &[(1, 1024), (2, 256)],
        (true, _, true) => &[(1, 1024), (2, 256), (4, 256), (8, 256)],
        (true, _, false) => &[(1, 1024), (2, 256)],
    }
}
/// The forward's rows kernels take rows up to this many units; wider rows run faster staged
/// by the loop kernel, from half as wide with its base-2 exponentials (16-bit input and
/// output). H100, bench/kernel_lab/softmax_split_sweep.py, bf16 softmax, fraction of copy:
/// 8192 wide rows 0.99 / loop 0.90, 16384 0.93 / 0.98, 32768 0.77 / 0.95.
const FWD_ROWS_MAX_UNITS: u64 = 2048;
const FWD_ROWS_MAX_UNITS_FAST_EXP: u64 = 1024;
/// Bytes a loop kernel's block stages, up to which it runs `SLICE_THREADS` threads with
/// several blocks per SM; wider rows are split over clusters so that each block's slice
/// fits. The backward keeps rows of up to `BWD_WHOLE_ROW_BYTES` on one block of
/// `LOOP_THREADS` (H100, bf16: 32768 wide 0.995 of copy whole against 0.88-0.93 split in two).
const SLICE_BYTES: u64 = 64 << 10;
const BWD_WHOLE_ROW_BYTES: u64 = 128 << 10;
/// Cluster sizes of the split kernels.
const SPLITS: [u64; 3] = [2, 4, 8];
/// The backward bulk kernels' (cluster, block) sizes, the first whose buffers fit (H100, bf16
/// softmax backward, bench/kernel_lab/softmax_bulk_sweep.py, fraction of copy: 65536 wide 0.93
/// with 8 blocks of 256 threads, 0.93 with 4 of 512; 131072 wide 0.92 with 8 of 256, against
/// 0.89 and 0.84 for the split kernels; 262144 wide, whose buffers need clusters of 16, a
/// non-portable size of which an H100 fits 7: 0.98-0.99 against 0.73-0.76). The forward's
/// take the split kernels' cluster sizes (slices of at most 64 KB; same lab, forward softmax /
/// log-softmax: 65536 wide 0.91 / 0.92 in two blocks, 131072 0.93 / 0.92 in four, 262144
/// 0.93 / 0.93 in eight, against 0.85 / 0.89, 0.81 / 0.84 and 0.78 / 0.81 split) and
/// `fwd_bulk_threads`.
const BWD_BULK_SHAPES: [(u64, u32); 2] = [(8, 256), (16, 256)];
/// The forward bulk kernels' block size: 256 threads for log-softmax, 512 for softmax, whose
/// writing pass takes an exponential an element (H100, bf16, fraction of copy, 256 / 512
/// threads, three runs each: log-softmax 65536 wide 0.93 / 0.92, 131072 0.92 / 0.90, 262144
/// 0.94 / 0.93; softmax 0.88 / 0.93, 0.88 / 0.91, 0.90 / 0.93;
/// bench/kernel_lab/softmax_fwd_store_sweep.py).
fn fwd_bulk_threads(log: bool) -> u32 {
    if log {
        SLICE_THREADS
    } else {
        LOOP_THREADS
    }
}
/// Preferred units per thread of the rows kernels.
const PREF_V: u32 = 4;
/// Threads per block the rows kernels aim for.
const TARGET_BLOCK: u32 = 256;
/// Block sizes of the loop kernels (the most, `kFwdLoopThreads` = `kBwdLoopThreads`, and the
/// one for slices of at most `SLICE_BYTES`) and the most of the cols kernels (`kColsThreads`).
const LOOP_THREADS: u32 = 512;
const SLICE_THREADS: u32 = 256;
const COLS_THREADS: u32 = 256;
/// Bytes of rows the unstaged loop kernel keeps in flight between its two reads, so that the
/// second finds them in L2 (half of an A100's or H100's L2 or less).
const L2_BUDGET: u64 = 24 << 20;

/// Which kernel a launch uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Body {
    /// Row in registers, `v` units per thread, 16-byte (`vec`) or scalar accesses.
    Rows { v: u32, vec: bool },
    /// One row per block, two passes.
    Loop,
    /// One row per cluster of `c` blocks, two passes.
    Split { c: u32 },
    /// A persistent grid of clusters of `c` blocks, the next row's slices fetched by bulk
    /// copies.
    Bulk { c: u32 },
    /// inner > 1.
    Cols,
}

/// (direction, [(tag, input element size)]) of every kernel family.
const DIRS: [(&str, &[(&str, u64)]); 2] = [
    (
        "fwd",
        &[
            ("f32", 4),
            ("f64", 8),
            ("f16", 2),
            ("bf16", 2),
            ("f16_f32", 2),
        ],
    ),
    (
        "bwd",
        &[
            ("f32", 4),
            ("f64", 8),
            ("f16", 2),
            ("bf16", 2),
            ("f32_f16", 4),
        ],
    ),
];

fn tag(a: DType, b: DType) -> Option<&'static str> {
    Some(match (a, b) {
        (DType::F32, DType::F32) => "f32",
        (DType::F64, DType::F64) => "f64",
        (DType::F16, DType::F16) => "f16",
        (DType::BF16, DType::BF16) => "bf16",
        (DType::F16, DType::F32) => "f16_f32",
        (DType::F32, DType::F16) => "f32_f16",
        _ => return None,
    })
}

fn name(dir: &str, body: Body, tag: &str) -> String {
    match body {
        Body::Rows { v, vec } => {
            let kind = if vec { 'v' } else { 's' };
            format!("graft_softmax_{dir}_rows_{kind}{v}_{tag}")
        }
        Body::Loop => format!("graft_softmax_{dir}_loop_{tag}"),
        Body::Split { c } => format!("graft_softmax_{dir}_split{c}_{tag}"),
        Body::Bulk { c } => format!("graft_softmax_{dir}_bulk{c}_{tag}"),
        Body::Cols => format!("graft_softmax_{dir}_cols_{tag}"),
    }
}

/// softmax's kernel table: the loop, split and bulk kernels opt in to large
/// shared memory, the backward bulk kernels of 16 to large clusters.
pub(crate) fn kernel_table() -> Vec<Kernel> {
    kernel_names()
        .into_iter()
        .map(|name| {
            let attrs = LoadAttrs {
                large_smem: wants_large_smem(&name),
                large_cluster: wants_large_cluster(&name),
            };
            Kernel { name, attrs }
        })
        .collect()
}

/// Entry points of softmax.cu.
fn kernel_names() -> Vec<String> {
    let mut out = Vec::new();
    for (dir, tags) in DIRS {
        for &(t, elem) in tags {
            for vec in [true, false] {
                for &(v, _) in rows_table(dir == "bwd", elem, vec) {
                    out.push(name(dir, Body::Rows { v, vec }, t));
                }
            }
            out.push(name(dir, Body::Loop, t));
            for c in SPLITS {
                out.push(name(dir, Body::Split { c: c as u32 }, t));
            }
            out.push(name(dir, Body::Cols, t));
            if t == "f16" || t == "bf16" {
                let sizes: Vec<u64> = if dir == "bwd" {
                    BWD_BULK_SHAPES.iter().map(|&(c, _)| c).collect()
                } else {
                    SPLITS.to_vec()
                };
                for c in sizes {
                    out.push(name(dir, Body::Bulk { c: c as u32 }, t));
                }
            }
        }
    }
    out
}

/// Whether kernel `name` runs in clusters of more than 8 blocks, a size the driver allows
/// only when asked (the backward bulk kernels of 16).
fn wants_large_cluster(name: &str) -> bool {
    name.starts_with("graft_softmax_bwd_bulk16_")
}

/// Whether kernel `name` may be given the device's whole shared memory (the loop, split and
/// bulk kernels stage rows there).
fn wants_large_smem(name: &str) -> bool {
    [
        "fwd_loop_",
        "bwd_loop_",
        "fwd_split",
        "bwd_split",
        "fwd_bulk",
        "bwd_bulk",
    ]
    .iter()
    .any(|k| {
        name.strip_prefix("graft_softmax_")
            .is_some_and(|n| n.starts_with(k))
    })
}

fn check_ptr(name: &str, p: u64, dtype: DType) -> Result<(), CudaError> {
    if p == 0 || !p.is_multiple_of(dtype.size() as u64) {
        return Err(CudaError::invalid(format!(
            "graft-cuda: softmax: {name} (0x{p:x}) is null or not aligned to its element size"
        )));
    }
    Ok(())
}

fn check_shape(outer: usize, dim: usize, inner: usize, widest: DType) -> Result<u64, CudaError> {
    let n = (outer as u64)
        .checked_mul(dim as u64)
        .and_then(|n| n.checked_mul(inner as u64));
    match n.and_then(|n| n.checked_mul(widest.size() as u64)) {
        Some(bytes) if bytes <= i64::MAX as u64 => Ok(n.unwrap_or(0)),
        _ => Err(CudaError::invalid(format!(
            "graft-cuda: softmax of {outer} x {dim} x {inner} is too large"
        ))),
    }
}

/// The problem as the planner sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    pub backward: bool,
    /// Bytes per element of the input type (forward x, backward dy and y).
    pub elem: u64,
    pub outer: u64,
    pub dim: u64,
    pub inner: u64,
    /// All pointers 16-byte aligned and rows a whole number of 16-byte units.
    pub vec: bool,
    /// 16-bit input and output: the loop kernels' base-2 exponentials (`kFastExp`).
    pub fast_exp: bool,
    /// Log-softmax (its forward bulk kernels' block size differs).
    pub log: bool,
}

/// A launch: the kernel, its shape, and the parameters it reads from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub body: Body,
    pub grid: u32,
    pub block: u32,
    pub smem: u32,
    pub tpr: u32,
    pub rpb: u32,
    pub stage: bool,
}

/// What the planner needs of a device: SMs, clusters, for the loop kernel (whose attributes
/// are looked up by name) the blocks per SM and the shared memory it may stage in, and for
/// the bulk kernel the clusters that can be resident.
pub(crate) struct DeviceView<'a> {
    pub sms: u32,
    pub clusters: bool,
    /// (blocks per SM, bytes of dynamic shared memory available) of the loop kernel, for a
    /// given dynamic shared memory size.
    pub loop_fit: &'a dyn Fn(u64) -> (u32, u64),
    /// (clusters resident at once, 0 if unknown; bytes of dynamic shared memory available)
    /// of the bulk kernel with clusters of the given size, for a given block and dynamic
    /// shared memory size.
    pub bulk_fit: &'a dyn Fn(u32, u32, u64) -> (u32, u64),
}

pub(crate) fn plan(p: &Problem, dev: &DeviceView<'_>) -> Plan {
    if p.inner > 1 {
        let bx = p.inner.next_power_of_two().min(32);
        let by = (u64::from(COLS_THREADS) / bx)
            .min(p.dim.next_power_of_two())
            .max(1);
        let block = (bx * by) as u32;
        let tiles = p.outer * p.inner.div_ceil(bx);
        let per_sm = u64::from((2048 / block).max(1));
        let grid = tiles.min(u64::from(dev.sms) * per_sm).clamp(1, MAX_GRID) as u32;
        return Plan {
            body: Body::Cols,
            grid,
            block,
            smem: 0,
            tpr: bx as u32,
            rpb: by as u32,
            stage: false,
        };
    }
    let nunits = p.dim.div_ceil(16 / p.elem);
    let table = rows_table(p.backward, p.elem, p.vec);
    let rows_max = if p.fast_exp {
        FWD_ROWS_MAX_UNITS_FAST_EXP
    } else {
        FWD_ROWS_MAX_UNITS
    };
    let rows = if p.backward || nunits <= rows_max {
        choose_rows(nunits, table, PREF_V, None)
    } else {
        None
    };
    if let Some(s) = rows {
        let rpb = rows_per_block(s.tpr, TARGET_BLOCK, s.max_threads, p.outer);
        let sets = p.outer.div_ceil(u64::from(rpb));
        return Plan {
            body: Body::Rows { v: s.v, vec: p.vec },
            grid: sets.clamp(1, MAX_GRID) as u32,
            block: s.tpr * rpb,
            smem: 0,
            tpr: s.tpr,
            rpb,
            stage: false,
        };
    }
    let arrays = if p.backward { 2 } else { 1 };
    let (_, room) = (dev.loop_fit)(0);
    // Bytes block `c` of a cluster of `c` stages (the kernel's slices are whole units).
    let slice = |c: u64| nunits.div_ceil(c) * 16 * arrays;
    let whole = if p.backward {
        BWD_WHOLE_ROW_BYTES
    } else {
        SLICE_BYTES
    };
    let whole_row = slice(1) <= whole.min(room);
    let split = SPLITS.iter().copied().find(|&c| slice(c) <= SLICE_BYTES);
    let c = if whole_row || !dev.clusters {
        1
    } else {
        split.unwrap_or(SPLITS[SPLITS.len() - 1])
    };
    if p.fast_exp && p.vec && c > 1 {
        let fwd_shape;
        let shapes: &[(u64, u32)] = match (p.backward, split) {
            (true, _) => &BWD_BULK_SHAPES,
            (false, Some(c)) => {
                fwd_shape = [(c, fwd_bulk_threads(p.log))];
                &fwd_shape
            }
            (false, None) => &[],
        };
        let bulk = shapes
            .iter()
            .find_map(|&(c, t)| plan_bulk(p, c, t, slice(c), dev));
        if let Some(pl) = bulk {
            return pl;
        }
    }
    let stage = slice(c) <= room;
    let (c, smem) = if stage { (c, slice(c)) } else { (1, 0) };
    let threads = if stage && smem <= SLICE_BYTES {
        SLICE_THREADS
    } else {
        LOOP_THREADS
    };
    // Staged: a row per block or cluster, as many as there are rows (blocks that finish
    // are replaced at once). Unstaged: the resident blocks, fewer where their rows would
    // not stay in L2 between the two reads.
    let grid = if stage {
        p.outer.min(MAX_GRID / c) * c
    } else {
        let (per_sm, _) = (dev.loop_fit)(0);
        let row_bytes = p.dim * p.elem * arrays;
        let in_l2 = (L2_BUDGET / row_bytes.max(1)).max(u64::from(dev.sms) / 2);
        (u64::from(dev.sms) * u64::from(per_sm.max(1)))
            .min(p.outer)
            .min(in_l2)
    };
    Plan {
        body: if c == 1 {
            Body::Loop
        } else {
            Body::Split { c: c as u32 }
        },
        grid: grid.clamp(1, MAX_GRID) as u32,
        block: threads,
        smem: smem as u32,
        tpr: threads,
        rpb: 1,
        stage,
    }
}

/// A bulk kernel's launch in clusters of `c` blocks of `threads`, for slices of `slice` bytes
/// (x's, or dy's and y's), where its two buffers fit and the driver says how many of its
/// clusters can be resident: that many, since a row's blocks wait for each other (more
/// clusters than fit would leave some rows to a later wave), or one per row where there are
/// fewer rows.
fn plan_bulk(p: &Problem, c: u64, threads: u32, slice: u64, dev: &DeviceView<'_>) -> Option<Plan> {
    let smem = 2 * slice;
    let (resident, room) = (dev.bulk_fit)(c as u32, threads, smem);
    if smem > room || resident == 0 {
        return None;
    }
    let clusters = u64::from(resident).min(p.outer).min(MAX_GRID / c);
    Some(Plan {
        body: Body::Bulk { c: c as u32 },
        grid: (clusters * c) as u32,
        block: threads,
        smem: smem as u32,
        tpr: threads,
        rpb: 1,
        stage: true,
    })
}

fn run(
    dir: &str,
    (device_id, stream): (i32, usize),
    tag: &str,
    problem: Problem,
    mut params: SoftmaxParams,
) -> Result<(), CudaError> {
    let st = device::state(device_id)?;
    let loop_name = name(dir, Body::Loop, tag);
    let loop_attrs = st.attrs[index_of(&loop_name)?];
    let limits = st.limits;
    let fit = |smem: u64| {
        let per_sm = blocks_per_sm(&limits, &loop_attrs, LOOP_THREADS, smem);
        let room = u64::from(limits.smem_per_block_optin)
            .saturating_sub(u64::from(loop_attrs.static_smem));
        (per_sm, room)
    };
    // A failed query (as an old driver's) leaves the split kernels to the rows.
    let bulk_fit = |c: u32, threads: u32, smem: u64| {
        let Ok(k) = index_of(&name(dir, Body::Bulk { c }, tag)) else {
            return (0, 0);
        };
        let room = u64::from(limits.smem_per_block_optin)
            .saturating_sub(u64::from(st.attrs[k].static_smem));
        let resident = match u32::try_from(smem) {
            Ok(smem) if u64::from(smem) <= room => {
                device::resident_clusters(device_id, k, c, threads, smem).unwrap_or(0)
            }
            _ => 0,
        };
        (resident, room)
    };
    let pl = plan(
        &problem,
        &DeviceView {
            sms: limits.sms,
            clusters: limits.clusters,
            loop_fit: &fit,
            bulk_fit: &bulk_fit,
        },
    );
    params.tpr = i64::from(pl.tpr);
    params.rpb = i64::from(pl.rpb);
    params.vec = i64::from(problem.vec);
    params.stage = i64::from(pl.stage);
    let kernel = name(dir, pl.body, tag);
    let launch = NamedLaunch {
        device: device_id,
        stream,
        name: &kernel,
        grid: pl.grid,
        block: pl.block,
        smem: pl.smem,
    };
    launch_named(&launch, &mut params)
}

fn vectorizable(ptrs: &[u64], dim: usize, elem: usize) -> bool {
    (dim * elem).is_multiple_of(16) && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// Softmax (or log-softmax) of `a.x` into `a.y` on `a.stream`; nothing is launched for an
/// empty tensor.
pub fn softmax_forward(a: &SoftmaxForward) -> Result<(), CudaError> {
    let tag = tag(a.input, a.output)
        .filter(|t| *t != "f32_f16")
        .ok_or_else(|| {
            CudaError::invalid(format!(
                "graft-cuda: softmax from {:?} to {:?} is not supported",
                a.input, a.output
            ))
        })?;
    if check_shape(a.outer, a.dim, a.inner, a.output)? == 0 {
        return Ok(());
    }
    check_ptr("x", a.x, a.input)?;
    check_ptr("y", a.y, a.output)?;
    let problem = Problem {
        backward: false,
        elem: a.input.size() as u64,
        outer: a.outer as u64,
        dim: a.dim as u64,
        inner: a.inner as u64,
        vec: vectorizable(&[a.x, a.y], a.dim, a.input.size()),
        fast_exp: a.input.size() == 2 && a.output.size() == 2,
        log: a.log,
    };
    let params = SoftmaxParams {
        in0: a.x,
        out: a.y,
        outer: a.outer as i64,
        dim: a.dim as i64,
        inner: a.inner as i64,
        log: i64::from(a.log),
        ..SoftmaxParams::default()
    };
    run("fwd", (a.device, a.stream), tag, problem, params)
}

/// The gradient of softmax (or log-softmax) into `a.dx` on `a.stream`; nothing is launched
/// for an empty tensor.
pub fn softmax_backward(a: &SoftmaxBackward) -> Result<(), CudaError> {
    let tag = tag(a.grad, a.grad_input)
        .filter(|t| *t != "f16_f32")
        .ok_or_else(|| {
            CudaError::invalid(format!(
                "graft-cuda: softmax backward from {:?} to {:?} is not supported",
                a.grad, a.grad_input
            ))
        })?;
    if check_shape(a.outer, a.dim, a.inner, a.grad)? == 0 {
        return Ok(());
    }
    check_ptr("dy", a.dy, a.grad)?;
    check_ptr("y", a.y, a.grad)?;
    check_ptr("dx", a.dx, a.grad_input)?;
    let problem = Problem {
        backward: true,
        elem: a.grad.size() as u64,
        outer: a.outer as u64,
        dim: a.dim as u64,
        inner: a.inner as u64,
        vec: vectorizable(&[a.dy, a.y, a.dx], a.dim, a.grad.size()),
        fast_exp: a.grad.size() == 2 && a.grad_input.size() == 2,
        log: a.log,
    };
    let params = SoftmaxParams {
        in0: a.dy,
        in1: a.y,
        out: a.dx,
        outer: a.outer as i64,
        dim: a.dim as i64,
        inner: a.inner as i64,
        log: i64::from(a.log),
        ..SoftmaxParams::default()
    };
    run("bwd", (a.device, a.stream), tag, problem, params)
}

#[cfg(test)]
mod tests;
