//! Launch-configuration arithmetic: pure functions of the problem, the device's limits and
//! the kernels' compiled attributes (unit-tested without a GPU).

/// What a device offers (queried once per device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Resident threads per SM.
    pub max_threads_per_sm: u32,
    /// 32-bit registers per SM.
    pub regs_per_sm: u32,
    /// Resident blocks per SM.
    pub max_blocks_per_sm: u32,
    /// Shared memory per SM (bytes).
    pub smem_per_sm: u32,
    /// Shared memory a block may opt in to (bytes).
    pub smem_per_block_optin: u32,
    /// Shared memory the driver reserves per block (bytes).
    pub reserved_smem_per_block: u32,
    /// Thread-block clusters (compute capability 9.0 or newer).
    pub clusters: bool,
}

impl DeviceLimits {
    /// An H100 SXM (132 SMs), for tests and examples.
    pub const H100: DeviceLimits = DeviceLimits {
        sms: 132,
        max_threads_per_sm: 2048,
        regs_per_sm: 65536,
        max_blocks_per_sm: 32,
        smem_per_sm: 233_472,
        smem_per_block_optin: 232_448,
        reserved_smem_per_block: 1024,
        clusters: true,
    };
}

/// A compiled kernel's attributes (queried once when the module is loaded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelAttrs {
    /// Registers per thread.
    pub regs: u32,
    /// Static shared memory (bytes).
    pub static_smem: u32,
    /// Largest block the kernel can be launched with.
    pub max_threads: u32,
}

/// Backward grids hold at most this many blocks per SM, so the dw workspace (one partial
/// row per block) has a bound that does not depend on the kernel chosen.
pub const BWD_MAX_BLOCKS_PER_SM: u32 = 4;
/// Largest grid.x the kernels are launched with.
pub const MAX_GRID: u64 = i32::MAX as u64;
/// Shared memory the backward rows kernels may use for their row-group reduction.
pub const BWD_ROWS_SMEM_LIMIT: u64 = 48 * 1024;

pub(crate) fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

pub(crate) fn round_up(a: u64, b: u64) -> u64 {
    div_ceil(a, b) * b
}

/// Threads of a row group covering `need` threads' worth of units: a power of two up to
/// 32 (sub-warp groups stay inside one warp), else a multiple of 32.
pub fn group_threads(need: u64) -> u64 {
    if need <= 32 {
        need.max(1).next_power_of_two()
    } else {
        round_up(need, 32)
    }
}

/// A rows-kernel shape: V units per thread and `tpr` threads per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsShape {
    /// 16-byte units per thread.
    pub v: u32,
    /// Threads per row group.
    pub tpr: u32,
    /// The kernel's maximum block size.
    pub max_threads: u32,
}

/// Chooses V (from `table`: (V, max threads)) and the row group size for rows of
/// `nunits` units. Least padding first (idle lanes in 1/16ths of the group's units), then
/// the V closest to `pref_v`. `only_v` restricts the choice. `None`: no V covers the row.
pub fn choose_rows(
    nunits: u64,
    table: &[(u32, u32)],
    pref_v: u32,
    only_v: Option<u32>,
) -> Option<RowsShape> {
    let mut best: Option<((u64, u32), RowsShape)> = None;
    for &(v, maxt) in table {
        if only_v.is_some_and(|o| o != v) {
            continue;
        }
        let tpr = group_threads(div_ceil(nunits, u64::from(v)));
        if tpr > u64::from(maxt) {
            continue;
        }
        let covered = tpr * u64::from(v);
        let waste = (covered - nunits) * 16 / covered;
        let dist = v.max(pref_v) / v.min(pref_v).max(1);
        let key = (waste, dist);
        let shape = RowsShape {
            v,
            tpr: tpr as u32,
            max_threads: maxt,
        };
        if best.is_none_or(|(k, _)| key < k) {
            best = Some((key, shape));
        }
    }
    best.map(|(_, s)| s)
}

/// Row groups per block: about `target_threads` per block, no more than the rows need
/// (rounded so that a block is whole warps) nor than `max_threads` allows.
pub fn rows_per_block(tpr: u32, target_threads: u32, max_threads: u32, rows: u64) -> u32 {
    let tpr = u64::from(tpr);
    let per_warp = if tpr < 32 { 32 / tpr } else { 1 };
    let mut rpb = (u64::from(target_threads) / tpr).max(1);
    rpb = rpb.min(round_up(rows, per_warp));
    rpb = round_up(rpb, per_warp);
    while rpb > per_warp && rpb * tpr > u64::from(max_threads) {
        rpb -= per_warp;
    }
    rpb as u32
}

/// Dynamic shared memory of a backward rows block: row groups 1.. park their dw
/// accumulators (`v * ve` values of `acc_bytes` per thread) for group 0 to add.
pub fn bwd_rows_smem(rpb: u32, tpr: u32, v: u32, ve: u32, acc_bytes: u32) -> u64 {
    u64::from(rpb.saturating_sub(1)) * u64::from(tpr) * u64::from(v * ve) * u64::from(acc_bytes)
}

/// Resident blocks per SM for a kernel launched with `threads` per block and `dyn_smem`
/// bytes of dynamic shared memory (registers are allocated per warp in units of 256).
pub fn blocks_per_sm(lim: &DeviceLimits, k: &KernelAttrs, threads: u32, dyn_smem: u64) -> u32 {
    let warps = u64::from(threads.div_ceil(32));
    let regs_per_warp = round_up(u64::from(k.regs.max(1)) * 32, 256);
    let by_regs = (u64::from(lim.regs_per_sm) / regs_per_warp) / warps;
    let by_threads = u64::from(lim.max_threads_per_sm) / (warps * 32);
    let smem = u64::from(k.static_smem) + dyn_smem;
    let by_smem = if smem == 0 {
        u64::MAX
    } else {
        u64::from(lim.smem_per_sm) / (smem + u64::from(lim.reserved_smem_per_block))
    };
    by_regs
        .min(by_threads)
        .min(by_smem)
        .min(u64::from(lim.max_blocks_per_sm)) as u32
}

/// Grid of a persistent backward launch: enough blocks to fill the SMs (at most
/// [`BWD_MAX_BLOCKS_PER_SM`] each), never more than there are row sets.
pub fn bwd_grid(sms: u32, blocks_per_sm: u32, sets: u64) -> u32 {
    let per_sm = blocks_per_sm.clamp(1, BWD_MAX_BLOCKS_PER_SM);
    (u64::from(sms) * u64::from(per_sm)).min(sets).max(1) as u32
}

/// Bytes of the dw workspace for `grid` partial rows of `cols` values of `acc_bytes`.
pub fn workspace_bytes(grid: u64, cols: u64, acc_bytes: u64) -> Option<u64> {
    grid.checked_mul(cols)?.checked_mul(acc_bytes)
}

/// Workspace bound for any dtype and kernel: one partial row of 8-byte values per block
/// of the largest backward grid.
pub fn workspace_bound(sms: u32, rows: u64, cols: u64) -> Option<u64> {
    let grid = (u64::from(sms) * u64::from(BWD_MAX_BLOCKS_PER_SM)).min(rows);
    workspace_bytes(grid, cols, 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    // (V, max threads) tables as RMSNorm's (ops/rms_norm/kernels.rs).
    const FWD_VEC: &[(u32, u32)] = &[(1, 512), (2, 512), (4, 512), (8, 512), (16, 256)];
    const FWD_SCALAR: &[(u32, u32)] = &[(1, 512), (4, 512)];
    const BWD_VEC: &[(u32, u32)] = &[(1, 512), (2, 512), (4, 512), (8, 256)];

    #[test]
    fn group_threads_rounds_to_pow2_then_warps() {
        assert_eq!(group_threads(0), 1);
        assert_eq!(group_threads(1), 1);
        assert_eq!(group_threads(3), 4);
        assert_eq!(group_threads(17), 32);
        assert_eq!(group_threads(32), 32);
        assert_eq!(group_threads(33), 64);
        assert_eq!(group_threads(160), 160);
        assert_eq!(group_threads(161), 192);
    }

    #[test]
    fn choose_rows_prefers_exact_fits_then_preferred_v() {
        // 4096 bf16 = 512 units: every V fits exactly; the preferred one wins.
        let s = choose_rows(512, FWD_VEC, 8, None).unwrap();
        assert_eq!((s.v, s.tpr), (8, 64));
        let s = choose_rows(512, FWD_VEC, 4, None).unwrap();
        assert_eq!((s.v, s.tpr), (4, 128));
        // 5120 bf16 = 640 units: V=8 would pad 80 threads to 96; V=4 fits exactly.
        let s = choose_rows(640, FWD_VEC, 8, None).unwrap();
        assert_eq!((s.v, s.tpr), (4, 160));
        // 7168 bf16 = 896 units: V=8 -> 112 threads (not a warp multiple) pads; 4 -> 224.
        let s = choose_rows(896, FWD_VEC, 8, None).unwrap();
        assert_eq!((s.v, s.tpr), (4, 224));
        // One unit (cols <= 8 bf16): a single thread per row.
        let s = choose_rows(1, FWD_VEC, 8, None).unwrap();
        assert_eq!(s.tpr, 1);
        // A forced V is honoured, and an impossible one refused.
        let s = choose_rows(512, FWD_VEC, 8, Some(16)).unwrap();
        assert_eq!((s.v, s.tpr), (16, 32));
        assert_eq!(choose_rows(512, FWD_VEC, 8, Some(3)), None);
    }

    #[test]
    fn choose_rows_gives_up_beyond_register_capacity() {
        // Forward vector kernels cover at most 16 * 256 = 8 * 512 = 4096 units.
        assert!(choose_rows(4096, FWD_VEC, 8, None).is_some());
        assert_eq!(choose_rows(4097, FWD_VEC, 8, None), None);
        // Scalar forward: V=4 x 512 threads.
        assert!(choose_rows(2048, FWD_SCALAR, 8, None).is_some());
        assert_eq!(choose_rows(2049, FWD_SCALAR, 8, None), None);
        // Backward vector: 8 x 256 = 4 x 512 = 2048 units (16384 bf16).
        assert!(choose_rows(2048, BWD_VEC, 4, None).is_some());
        assert_eq!(choose_rows(2049, BWD_VEC, 4, None), None);
    }

    #[test]
    fn rows_per_block_fills_whole_warps() {
        // Sub-warp groups: a block is whole warps even for 1 row.
        assert_eq!(rows_per_block(8, 256, 512, 1), 4);
        assert_eq!(rows_per_block(8, 256, 512, 1000), 32);
        assert_eq!(rows_per_block(1, 256, 512, 3), 32);
        // Multi-warp groups.
        assert_eq!(rows_per_block(64, 256, 512, 1000), 4);
        assert_eq!(rows_per_block(64, 256, 512, 3), 3);
        assert_eq!(rows_per_block(512, 256, 512, 1000), 1);
        assert_eq!(rows_per_block(160, 256, 512, 1000), 1);
        // The kernel's maximum block size caps it.
        assert_eq!(rows_per_block(128, 1024, 256, 1000), 2);
        for tpr in [1u32, 2, 4, 8, 16, 32, 64, 96, 160, 512] {
            for rows in [1u64, 2, 3, 7, 100, 100_000] {
                let rpb = rows_per_block(tpr, 256, 512, rows);
                assert!(rpb >= 1);
                assert_eq!((rpb * tpr) % 32, 0, "tpr {tpr} rows {rows}");
                assert!(rpb * tpr <= 512);
            }
        }
    }

    #[test]
    fn occupancy_matches_hand_counts() {
        let lim = DeviceLimits::H100;
        let k = |regs, static_smem| KernelAttrs {
            regs,
            static_smem,
            max_threads: 1024,
        };
        // 32 regs, 256 threads: 2048 threads/SM -> 8 blocks.
        assert_eq!(blocks_per_sm(&lim, &k(32, 0), 256, 0), 8);
        // 128 regs, 256 threads: 65536 / (128 * 256) = 2 blocks.
        assert_eq!(blocks_per_sm(&lim, &k(128, 256), 256, 0), 2);
        // 72 regs round to 72*32 = 2304 per warp -> 28 warps -> 3 blocks of 8 warps.
        assert_eq!(blocks_per_sm(&lim, &k(72, 256), 256, 0), 3);
        // Shared memory bound: 100 KB dynamic -> 2 blocks.
        assert_eq!(blocks_per_sm(&lim, &k(32, 256), 128, 100 * 1024), 2);
        // Tiny blocks hit the 32-block limit.
        assert_eq!(blocks_per_sm(&lim, &k(16, 0), 32, 0), 32);
    }

    #[test]
    fn backward_smem_and_grid() {
        // bf16, V=4, 128 threads per row, 2 row groups: group 1 parks 128*32 floats.
        assert_eq!(bwd_rows_smem(2, 128, 4, 8, 4), 16384);
        assert_eq!(bwd_rows_smem(1, 128, 4, 8, 4), 0);
        assert_eq!(bwd_grid(132, 2, 1_000_000), 264);
        assert_eq!(bwd_grid(132, 9, 1_000_000), 528);
        assert_eq!(bwd_grid(132, 0, 1_000_000), 132);
        assert_eq!(bwd_grid(132, 2, 5), 5);
    }

    #[test]
    fn workspace_bound_covers_every_grid() {
        for rows in [1u64, 3, 100, 527, 528, 529, 1 << 20] {
            let bound = workspace_bound(132, rows, 4096).unwrap();
            for bps in 0..8 {
                // Any backward grid over `rows` row sets (sets <= rows), 8-byte partials.
                let grid = u64::from(bwd_grid(132, bps, rows));
                assert!(workspace_bytes(grid, 4096, 8).unwrap() <= bound);
            }
        }
        assert_eq!(workspace_bound(132, 1 << 20, 4096), Some(528 * 4096 * 8));
        assert_eq!(workspace_bytes(u64::MAX, 2, 1), None);
    }
}
