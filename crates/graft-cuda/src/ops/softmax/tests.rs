use super::*;

/// A loop kernel that fits twice per SM, once with more than 100 KB of staging.
fn view(room: u64) -> impl Fn(u64) -> (u32, u64) {
    move |smem| (if smem > 100_000 { 1 } else { 2 }, room)
}

/// A device whose driver cannot say how many bulk clusters are resident.
fn no_bulk(_: u32, _: u32, _: u64) -> (u32, u64) {
    (0, 227 * 1024)
}

fn problem(backward: bool, elem: u64, outer: u64, dim: u64, inner: u64) -> Problem {
    Problem {
        backward,
        elem,
        outer,
        dim,
        inner,
        vec: true,
        fast_exp: elem == 2,
        log: false,
    }
}

#[test]
fn params_match_the_cuda_struct() {
    assert_eq!(std::mem::size_of::<SoftmaxParams>(), 11 * 8);
}

#[test]
fn names_cover_every_variant() {
    let names = kernel_names();
    // Forward: 4 vector + 2 scalar rows kernels, loop, 3 split, cols for 5 type pairs;
    // backward the same, less V = 8 for the two 16-bit pairs.
    // Bulk kernels for the two 16-bit pairs: three forward, two backward.
    assert_eq!(names.len(), 5 * 11 + 5 * 11 - 2 + 2 * 5);
    assert!(wants_large_cluster("graft_softmax_bwd_bulk16_bf16"));
    assert!(!wants_large_cluster("graft_softmax_bwd_bulk8_bf16"));
    assert!(names.contains(&"graft_softmax_fwd_bulk4_f16".to_string()));
    assert!(names.contains(&"graft_softmax_bwd_bulk8_bf16".to_string()));
    assert!(wants_large_smem("graft_softmax_bwd_bulk8_f16"));
    assert!(names.contains(&"graft_softmax_bwd_split8_f32_f16".to_string()));
    assert!(wants_large_smem("graft_softmax_fwd_split2_bf16"));
    assert!(names.contains(&"graft_softmax_fwd_rows_v8_f16_f32".to_string()));
    assert!(names.contains(&"graft_softmax_bwd_rows_s2_f32_f16".to_string()));
    assert!(!names.contains(&"graft_softmax_bwd_rows_v8_bf16".to_string()));
    assert!(names.contains(&"graft_softmax_bwd_cols_f32_f16".to_string()));
    assert!(wants_large_smem("graft_softmax_bwd_loop_bf16"));
    assert!(!wants_large_smem("graft_softmax_bwd_rows_v1_bf16"));
}

#[test]
fn rows_up_to_the_register_capacity_then_the_loop_kernel() {
    let fit = view(227 * 1024);
    let dev = DeviceView {
        sms: 132,
        clusters: true,
        loop_fit: &fit,
        bulk_fit: &no_bulk,
    };
    // 4096 bf16 = 512 units: V=4, 128 threads per row, two rows per block.
    let pl = plan(&problem(false, 2, 1000, 4096, 1), &dev);
    let rows4 = Body::Rows { v: 4, vec: true };
    assert_eq!((pl.body, pl.tpr, pl.rpb), (rows4, 128, 2));
    // 8192 bf16 = 1024 units: V=4 x 256 threads.
    let pl = plan(&problem(false, 2, 10, 8192, 1), &dev);
    assert_eq!((pl.body, pl.tpr, pl.block), (rows4, 256, 256));
    // float32 (the library's exp) keeps rows kernels up to 2048 units: 8192 wide, V=4 x
    // 512 threads; 16384 wide takes the loop kernel.
    let pl = plan(&problem(false, 4, 10, 8192, 1), &dev);
    assert_eq!((pl.body, pl.tpr), (rows4, 512));
    assert_eq!(
        plan(&problem(false, 4, 10, 16384, 1), &dev).body,
        Body::Loop
    );
    // Beyond: the loop kernel, a row of up to 64 KB staged by a block of 256 threads.
    let pl = plan(&problem(false, 2, 10, 16384, 1), &dev);
    assert_eq!((pl.body, pl.smem, pl.block), (Body::Loop, 32768, 256));
    let pl = plan(&problem(false, 2, 10, 32768, 1), &dev);
    assert_eq!((pl.body, pl.stage, pl.smem), (Body::Loop, true, 65536));
    assert_eq!((pl.block, pl.grid), (256, 10));
    // Wider: split over a cluster so that each block stages at most 64 KB.
    let pl = plan(&problem(false, 2, 10, 65536, 1), &dev);
    let split = |c| Body::Split { c };
    assert_eq!((pl.body, pl.smem, pl.grid), (split(2), 65536, 20));
    let pl = plan(&problem(false, 4, 1000, 131072, 1), &dev);
    assert_eq!((pl.body, pl.smem, pl.block), (split(8), 65536, 256));
    // 1 MB rows: 128 KB slices by 512-thread blocks of 8-block clusters.
    let pl = plan(&problem(false, 4, 1000, 262144, 1), &dev);
    assert_eq!((pl.body, pl.smem, pl.block), (split(8), 131072, 512));
    // 4 MB rows fit no cluster: read twice, 6 rows in flight would fit the L2 budget;
    // half the SMs at least.
    let pl = plan(&problem(false, 4, 1000, 1 << 20, 1), &dev);
    assert_eq!(
        (pl.body, pl.stage, pl.grid, pl.block),
        (Body::Loop, false, 66, 512)
    );
    // Without clusters (before sm_90) a block stages whatever fits.
    let no_clusters = DeviceView {
        clusters: false,
        ..dev
    };
    let pl = plan(&problem(false, 2, 10, 65536, 1), &no_clusters);
    assert_eq!((pl.body, pl.smem, pl.block), (Body::Loop, 131072, 512));
    // Backward holds two rows: 16384 bf16 is its register limit.
    let pl = plan(&problem(true, 2, 10, 16384, 1), &dev);
    assert!(matches!(pl.body, Body::Rows { .. }));
    let pl = plan(&problem(true, 2, 10, 16392, 1), &dev);
    assert_eq!(pl.body, Body::Loop);
    // It keeps rows of up to 128 KB (dy and y) on one block, then splits them.
    let pl = plan(&problem(true, 2, 10, 32768, 1), &dev);
    assert_eq!((pl.body, pl.smem, pl.block), (Body::Loop, 131072, 512));
    let pl = plan(&problem(true, 2, 10, 65536, 1), &dev);
    assert_eq!((pl.body, pl.smem, pl.block), (split(4), 65536, 256));
    // Scalar accesses (an odd width): fewer units per thread, the loop kernel sooner
    // (float32: 1024 units where 16-byte accesses reach 2048).
    let mut odd = problem(false, 4, 10, 4095, 1);
    odd.vec = false;
    odd.fast_exp = false;
    let pl = plan(&odd, &dev);
    assert_eq!(pl.body, Body::Rows { v: 2, vec: false });
    odd.dim = 4097;
    assert_eq!(plan(&odd, &dev).body, Body::Loop);
    assert!(matches!(
        plan(&problem(false, 4, 10, 4100, 1), &dev).body,
        Body::Rows { .. }
    ));
    // Scalar rows split too.
    let mut odd = problem(false, 2, 10, 65537, 1);
    odd.vec = false;
    assert_eq!(plan(&odd, &dev).body, split(4));
}

#[test]
fn wide_16_bit_rows_take_the_bulk_kernels() {
    let fit = view(227 * 1024);
    // Clusters resident by each block's shared memory, as an H100 reported them for
    // clusters of 8.
    let bulk_fit = |_, _, smem: u64| (if smem > 100_000 { 15 } else { 45 }, 227 * 1024);
    let dev = DeviceView {
        sms: 132,
        clusters: true,
        loop_fit: &fit,
        bulk_fit: &bulk_fit,
    };
    let bulk = Body::Bulk { c: 8 };
    // 65536 bf16: 16 KB of dy and y a block, two buffers: 64 KB; 45 clusters of 8.
    let pl = plan(&problem(true, 2, 1000, 65536, 1), &dev);
    assert_eq!(
        (pl.body, pl.smem, pl.block, pl.grid),
        (bulk, 65536, 256, 360)
    );
    // Fewer rows than resident clusters: a cluster per row.
    let pl = plan(&problem(true, 2, 3, 65536, 1), &dev);
    assert_eq!((pl.body, pl.grid), (bulk, 24));
    // 131072: 128 KB of buffers, 15 clusters.
    let pl = plan(&problem(true, 2, 1000, 131072, 1), &dev);
    assert_eq!((pl.body, pl.smem, pl.grid), (bulk, 131072, 120));
    // 262144: clusters of 8 would need 256 KB of buffers; clusters of 16, 128 KB.
    let pl = plan(&problem(true, 2, 1000, 262144, 1), &dev);
    let sixteen = Body::Bulk { c: 16 };
    assert_eq!((pl.body, pl.smem, pl.grid), (sixteen, 131072, 240));
    // 524288: not even those (nor a split block's share): read twice by the loop kernel.
    let pl = plan(&problem(true, 2, 1000, 524288, 1), &dev);
    assert_eq!((pl.body, pl.stage), (Body::Loop, false));
    // Rows one block keeps whole, float32, odd widths, and devices without clusters or
    // an answer from the driver keep their kernels.
    assert_eq!(plan(&problem(true, 2, 10, 32768, 1), &dev).body, Body::Loop);
    let mut f32_rows = problem(true, 4, 10, 65536, 1);
    f32_rows.fast_exp = false;
    assert_eq!(plan(&f32_rows, &dev).body, Body::Split { c: 8 });
    // The forward: clusters of the split kernels' size, 512 threads (256 for
    // log-softmax).
    let pl = plan(&problem(false, 2, 1000, 65536, 1), &dev);
    let (two, four, eight) = (
        Body::Bulk { c: 2 },
        Body::Bulk { c: 4 },
        Body::Bulk { c: 8 },
    );
    assert_eq!(
        (pl.body, pl.smem, pl.block, pl.grid),
        (two, 131072, 512, 30)
    );
    let mut wide = problem(false, 2, 1000, 131072, 1);
    assert_eq!(
        (plan(&wide, &dev).body, plan(&wide, &dev).block),
        (four, 512)
    );
    wide.log = true;
    assert_eq!(
        (plan(&wide, &dev).body, plan(&wide, &dev).block),
        (four, 256)
    );
    let mut log_pairs = problem(false, 2, 1000, 65536, 1);
    log_pairs.log = true;
    assert_eq!(plan(&log_pairs, &dev).block, 256);
    let pl = plan(&problem(false, 2, 1000, 262144, 1), &dev);
    assert_eq!(
        (pl.body, pl.smem, pl.block, pl.grid),
        (eight, 131072, 512, 120)
    );
    assert_eq!(
        plan(&problem(false, 2, 10, 32768, 1), &dev).body,
        Body::Loop
    );
    let mut f32_rows = problem(false, 4, 10, 65536, 1);
    f32_rows.fast_exp = false;
    assert_eq!(plan(&f32_rows, &dev).body, Body::Split { c: 4 });
    let mut odd = problem(true, 2, 10, 65537, 1);
    odd.vec = false;
    assert_eq!(plan(&odd, &dev).body, Body::Split { c: 8 });
    let no_clusters = DeviceView {
        clusters: false,
        ..dev
    };
    assert_eq!(
        plan(&problem(true, 2, 10, 65536, 1), &no_clusters).body,
        Body::Loop
    );
    let unknown = DeviceView {
        bulk_fit: &no_bulk,
        ..dev
    };
    assert_eq!(
        plan(&problem(true, 2, 10, 65536, 1), &unknown).body,
        Body::Split { c: 4 }
    );
}

#[test]
fn small_widths_share_warps() {
    let fit = view(227 * 1024);
    let dev = DeviceView {
        sms: 132,
        clusters: true,
        loop_fit: &fit,
        bulk_fit: &no_bulk,
    };
    let pl = plan(&problem(false, 4, 5000, 10, 1), &dev);
    assert!(matches!(pl.body, Body::Rows { .. }));
    assert!(pl.tpr <= 4 && pl.block.is_multiple_of(32));
    assert_eq!(pl.grid as u64, 5000u64.div_ceil(u64::from(pl.rpb)));
}

#[test]
fn columns_cover_inner_with_a_warp_and_slice_dim() {
    let fit = view(227 * 1024);
    let dev = DeviceView {
        sms: 132,
        clusters: true,
        loop_fit: &fit,
        bulk_fit: &no_bulk,
    };
    let pl = plan(&problem(false, 4, 8, 1000, 4096), &dev);
    assert_eq!(
        (pl.body, pl.tpr, pl.rpb, pl.block),
        (Body::Cols, 32, 8, 256)
    );
    let pl = plan(&problem(false, 4, 3, 3, 5), &dev);
    assert_eq!((pl.tpr, pl.rpb), (8, 4));
    assert_eq!(pl.grid, 3);
}
