use super::*;

fn attrs(_: Body) -> KernelAttrs {
    KernelAttrs {
        regs: 64,
        static_smem: 512,
        max_threads: 1024,
    }
}

fn no_clusters(_: u32) -> u32 {
    0
}

fn problem(backward: bool, elem: u64, rows: u64, cols: u64) -> Problem {
    Problem {
        backward,
        elem,
        acc: 4,
        rows,
        cols,
        vec: true,
        sums: true,
    }
}

#[test]
fn params_match_the_cuda_structs() {
    assert_eq!(std::mem::size_of::<LayerNormParams>(), 17 * 8);
    assert_eq!(std::mem::size_of::<FinalizeParams>(), 5 * 8);
}

#[test]
fn names_are_unique() {
    let mut names = kernel_names();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n);
    assert_eq!(n, 4 * (6 + 5 + 2 + 1) + 4);
    assert!(names.contains(&"graft_ln_bwd_bulk_f16".to_string()));
    assert!(names.contains(&"graft_ln_fwd_staged_bf16".to_string()));
    assert!(names.contains(&"graft_ln_bwd_rows_s2_bf16".to_string()));
}

#[test]
fn plans_by_hidden_size() {
    let lim = DeviceLimits::H100;
    for cols in [4096, 8192] {
        let pl = plan(&problem(false, 4, 8192, cols), &lim, &attrs, &no_clusters);
        assert!(matches!(pl.body, Body::Rows { vec: true, .. }), "{pl:?}");
        let pl = plan(&problem(true, 2, 8192, cols), &lim, &attrs, &no_clusters);
        assert!(matches!(pl.body, Body::Rows { vec: true, .. }), "{pl:?}");
        assert!(pl.grid <= lim.sms * BWD_MAX_BLOCKS_PER_SM);
        assert!(pl.stage, "{pl:?}");
        if let Body::Rows { v, .. } = pl.body {
            assert!(u64::from(pl.smem) >= stage_bytes(pl.rpb, v, pl.tpr));
        }
    }
    // Every hidden size: the block's shared memory, static and dynamic, within the device's
    // opt-in limit when rows are staged, else within the default 48 KiB (hidden 2048 once
    // asked for 48 KiB of dynamic memory on top of the static).
    for cols in (64..=8192).step_by(64) {
        let cases = [2, 4, 8].into_iter().flat_map(|elem| {
            [(false, false), (false, true), (true, false), (true, true)]
                .map(|(backward, vec)| (elem, backward, vec))
        });
        for (elem, backward, vec) in cases {
            let problem = Problem {
                vec,
                ..problem(backward, elem, 8192, cols)
            };
            let pl = plan(&problem, &lim, &attrs, &no_clusters);
            let total = u64::from(pl.smem) + u64::from(attrs(pl.body).static_smem);
            let limit = if pl.stage {
                u64::from(lim.smem_per_block_optin)
            } else {
                BWD_ROWS_SMEM_LIMIT
            };
            assert!(total <= limit, "cols {cols} elem {elem}: {pl:?}");
            let rows = matches!(pl.body, Body::Rows { .. });
            assert_eq!(pl.stage, backward && vec && rows, "{pl:?}");
            if let (true, Body::Rows { v, .. }) = (pl.stage, pl.body) {
                assert!(u64::from(pl.smem) >= stage_bytes(pl.rpb, v, pl.tpr));
            }
            assert!(pl.block <= attrs(pl.body).max_threads);
        }
    }
    // 16-bit forward from 2048 to 16384 columns: staged, one row per block, two units a
    // thread in 128 to 256 threads, four above; not with element access.
    for (cols, block) in [
        (2048, 128),
        (2056, 128),
        (4096, 256),
        (5120, 256),
        (8192, 256),
        (16384, 512),
    ] {
        let pl = plan(&problem(false, 2, 100, cols), &lim, &attrs, &no_clusters);
        assert_eq!(pl.body, Body::Staged, "cols {cols}: {pl:?}");
        assert_eq!((pl.block, pl.grid, pl.smem), (block, 100, cols as u32 * 2));
        let scalar = Problem {
            vec: false,
            ..problem(false, 2, 100, cols)
        };
        assert_ne!(plan(&scalar, &lim, &attrs, &no_clusters).body, Body::Staged);
    }
    for cols in [2040, 16392] {
        let pl = plan(&problem(false, 2, 100, cols), &lim, &attrs, &no_clusters);
        assert_ne!(pl.body, Body::Staged, "cols {cols}: {pl:?}");
    }
    // Forward rows kernels: one row per block from 64 threads a row (hidden 2048 in f32,
    // V = 4 in bf16), two warps' worth of rows below.
    for (cols, rpb) in [(1024, 2), (512, 4), (64, 32)] {
        let pl = plan(&problem(false, 2, 8192, cols), &lim, &attrs, &no_clusters);
        assert_eq!(
            (pl.rpb, pl.block),
            (rpb, 64.max(pl.tpr)),
            "cols {cols}: {pl:?}"
        );
    }
    // Beyond the registers: the loop kernels.
    let pl = plan(&problem(true, 2, 10, 20000), &lim, &attrs, &no_clusters);
    assert_eq!(pl.body, Body::Loop);
    assert!(pl.grid <= 10);
}

#[test]
fn the_bulk_backward_takes_16_bit_rows_from_7168_columns_where_clusters_fit() {
    let lim = DeviceLimits::H100;
    let fit = |_: u32| 100;
    for cols in [7168, 8192] {
        let pl = plan(&problem(true, 2, 1000, cols), &lim, &attrs, &fit);
        assert_eq!(pl.body, Body::Bulk, "cols {cols}: {pl:?}");
        assert_eq!((pl.grid, pl.block), (400, 128));
        // Two buffers of x and dy of a quarter of the row.
        assert_eq!(u64::from(pl.smem), 4 * (cols / 8).div_ceil(4) * 16);
    }
    // Fewer rows than resident clusters; more clusters than the workspace's grid.
    let pl = plan(&problem(true, 2, 10, 8192), &lim, &attrs, &fit);
    assert_eq!(pl.grid, 40);
    let pl = plan(&problem(true, 2, 10_000, 8192), &lim, &attrs, &|_| 1000);
    assert_eq!(pl.grid, lim.sms * BWD_MAX_BLOCKS_PER_SM * 4);
    // Not: narrower or wider rows, f32, element access, no clusters, no answer.
    for (elem, cols) in [(2, 7160), (2, 8200), (4, 4096)] {
        let pl = plan(&problem(true, elem, 1000, cols), &lim, &attrs, &fit);
        assert_ne!(pl.body, Body::Bulk, "elem {elem} cols {cols}");
    }
    let scalar = Problem {
        vec: false,
        ..problem(true, 2, 1000, 8192)
    };
    assert_ne!(plan(&scalar, &lim, &attrs, &fit).body, Body::Bulk);
    let a100 = DeviceLimits {
        clusters: false,
        ..lim
    };
    assert_ne!(
        plan(&problem(true, 2, 1000, 8192), &a100, &attrs, &fit).body,
        Body::Bulk
    );
    let pl = plan(&problem(true, 2, 1000, 8192), &lim, &attrs, &no_clusters);
    assert!(matches!(pl.body, Body::Rows { .. }));
}
