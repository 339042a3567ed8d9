use super::*;

fn attrs(regs: u32) -> impl Fn(usize) -> KernelAttrs {
    move |_| KernelAttrs {
        regs,
        static_smem: 256,
        max_threads: 512,
    }
}

fn problem(dir: Dir, dtype: DType, rows: u64, cols: u64, vec: bool) -> Problem {
    Problem {
        dir,
        dtype,
        weight: WeightKind::Same,
        rows,
        cols,
        vec,
        has_dw: dir == Dir::Bwd,
    }
}

const H100: DeviceLimits = DeviceLimits::H100;

#[test]
fn forward_plan_for_hidden_4096_bf16() {
    let p = problem(Dir::Fwd, DType::BF16, 32768, 4096, true);
    let pl = plan(&p, &H100, &attrs(64), &Tuning::default()).unwrap();
    assert_eq!(pl.kernel_name(), "graft_rms_fwd_rows_bf16_same_v8");
    assert_eq!((pl.units_per_thread, pl.threads_per_row), (8, 64));
    assert_eq!((pl.rows_per_block, pl.block), (4, 256));
    assert_eq!(pl.grid, 8192);
    assert_eq!(pl.finalize_kernel_name(), None);
    // Persistent grid and forced V.
    let t = Tuning {
        units_per_thread: Some(16),
        blocks_per_sm: Some(4),
        ..Tuning::default()
    };
    let pl = plan(&p, &H100, &attrs(64), &t).unwrap();
    assert_eq!((pl.units_per_thread, pl.threads_per_row), (16, 32));
    assert_eq!(pl.grid, 528);
}

#[test]
fn backward_plan_for_hidden_4096_bf16() {
    let p = problem(Dir::Bwd, DType::BF16, 32768, 4096, true);
    let pl = plan(&p, &H100, &attrs(128), &Tuning::default()).unwrap();
    assert_eq!(pl.kernel_name(), "graft_rms_bwd_rows_bf16_same_v4");
    assert_eq!(
        (pl.threads_per_row, pl.rows_per_block, pl.block),
        (128, 4, 512)
    );
    // Row groups 1..3 park 128 threads x 32 floats each for group 0.
    assert_eq!(pl.smem_bytes, 3 * 16384);
    // One persistent block per SM.
    assert_eq!(pl.grid, 132);
    assert_eq!(pl.workspace_bytes, 132 * 4096 * 4);
    assert_eq!(
        pl.finalize_kernel_name().as_deref(),
        Some("graft_rms_dw_finalize_f32_bf16")
    );
    assert_eq!(pl.finalize_grid, 128);
}

#[test]
fn odd_and_huge_rows_use_scalar_and_loop_kernels() {
    let p = problem(Dir::Fwd, DType::BF16, 10, 4097, false);
    let pl = plan(&p, &H100, &attrs(64), &Tuning::default()).unwrap();
    assert!(pl
        .kernel_name()
        .starts_with("graft_rms_fwd_rows_bf16_same_s"));
    assert!(pl.units_per_thread * pl.threads_per_row * 8 >= 4097);

    let p = problem(Dir::Fwd, DType::BF16, 10, 65536, true);
    let pl = plan(&p, &H100, &attrs(64), &Tuning::default()).unwrap();
    assert_eq!(pl.kernel_name(), "graft_rms_fwd_loop_bf16_same");
    assert_eq!((pl.block, pl.grid), (512, 10));

    // Backward loop: a 64 Ki-column fp32 partial row (256 KB) does not fit in shared
    // memory; 16 Ki columns (64 KB) do.
    let p = problem(Dir::Bwd, DType::BF16, 1000, 65536, true);
    let pl = plan(&p, &H100, &attrs(64), &Tuning::default()).unwrap();
    assert_eq!(pl.kernel_name(), "graft_rms_bwd_loop_bf16_same");
    assert!(!pl.dw_in_smem);
    let t = Tuning {
        force_loop: true,
        ..Tuning::default()
    };
    let p = problem(Dir::Bwd, DType::BF16, 1000, 16384, true);
    let pl = plan(&p, &H100, &attrs(32), &t).unwrap();
    assert!(pl.dw_in_smem);
    assert_eq!(pl.smem_bytes, 65536);
    // 64 KB + 1 KB reserved per block: 3 blocks fit in 228 KB (registers allow 4).
    assert_eq!(pl.grid, 3 * 132);
    // With 64 registers per thread, registers allow only 2 blocks of 512.
    let pl = plan(&p, &H100, &attrs(64), &t).unwrap();
    assert_eq!(pl.grid, 2 * 132);
}

#[test]
fn small_rows_pack_many_rows_per_block() {
    let p = problem(Dir::Fwd, DType::F32, 4096, 7, false);
    let pl = plan(&p, &H100, &attrs(32), &Tuning::default()).unwrap();
    // 7 floats = 2 units of 4: one unit per thread, 2 threads per row.
    assert_eq!((pl.units_per_thread, pl.threads_per_row), (1, 2));
    assert_eq!(pl.block, 256);
    assert_eq!(pl.grid, 32);
    let p = problem(Dir::Fwd, DType::F64, 1, 1, false);
    let pl = plan(&p, &H100, &attrs(32), &Tuning::default()).unwrap();
    assert_eq!((pl.threads_per_row, pl.block, pl.grid), (1, 32, 1));
}

#[test]
fn backward_grid_never_exceeds_the_workspace_bound() {
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for cols in [1u64, 7, 64, 1000, 4096, 4097, 16384, 65536] {
            for rows in [1u64, 3, 128, 4096, 1 << 20] {
                for regs in [24, 64, 128, 255] {
                    for vec in [true, false] {
                        let p = problem(Dir::Bwd, dtype, rows, cols, vec);
                        let pl = plan(&p, &H100, &attrs(regs), &Tuning::default()).unwrap();
                        let bound = config::workspace_bound(132, rows, cols).unwrap();
                        assert!(pl.workspace_bytes <= bound, "{dtype:?} {rows}x{cols}");
                        assert!(u64::from(pl.smem_bytes) <= 232_448);
                        assert!(pl.block <= 1024 && pl.block.is_multiple_of(32));
                        assert!(pl.grid >= 1);
                    }
                }
            }
        }
    }
}

#[test]
fn bad_tuning_is_an_error() {
    let p = problem(Dir::Fwd, DType::BF16, 8, 4096, true);
    let t = Tuning {
        units_per_thread: Some(3),
        ..Tuning::default()
    };
    assert!(plan(&p, &H100, &attrs(32), &t).is_err());
    let t = Tuning {
        block_threads: Some(100),
        ..Tuning::default()
    };
    assert!(plan(&p, &H100, &attrs(32), &t).is_err());
}

fn fwd_args() -> RmsNormForward {
    RmsNormForward {
        device: 0,
        stream: 0,
        dtype: DType::BF16,
        x: 0x1000,
        weight: Weight::Same(0x2000),
        y: 0x3000,
        rstd: 0x4000,
        rows: 4,
        cols: 64,
        eps: 1e-6,
        mode: WeightMode::default(),
    }
}

fn bwd_args() -> RmsNormBackward {
    RmsNormBackward {
        device: 0,
        stream: 0,
        dtype: DType::F32,
        dy: 0x1000,
        x: 0x2000,
        rstd: 0x3000,
        weight: Weight::Acc(0x4000),
        dx: Some(0x5000),
        dw: Some(0x6000),
        workspace: 0x7000,
        workspace_bytes: 1 << 20,
        rows: 4,
        cols: 64,
        mode: WeightMode::default(),
    }
}

fn assert_invalid(r: Result<(), CudaError>, needle: &str) {
    let e = r.expect_err("must be rejected");
    assert_eq!(
        e.kind(),
        crate::runtime::error::ErrorKind::InvalidArgument,
        "{e}"
    );
    assert!(
        e.to_string().contains(needle),
        "{e} should mention {needle}"
    );
}

#[test]
fn forward_validation_rejects_bad_arguments() {
    assert!(validate_forward(&fwd_args()).is_ok());
    let mut a = fwd_args();
    a.rows = 0;
    assert_invalid(validate_forward(&a), "rows >= 1");
    let mut a = fwd_args();
    a.cols = 0;
    assert_invalid(validate_forward(&a), "cols >= 1");
    let mut a = fwd_args();
    a.x = 0;
    assert_invalid(validate_forward(&a), "x is a null pointer");
    let mut a = fwd_args();
    a.y = 0x3001;
    assert_invalid(validate_forward(&a), "y (0x3001) is not aligned to 2");
    let mut a = fwd_args();
    a.rstd = 0x4002;
    assert_invalid(validate_forward(&a), "rstd");
    let mut a = fwd_args();
    a.weight = Weight::Acc(0x2002);
    assert_invalid(validate_forward(&a), "weight");
    let mut a = fwd_args();
    a.weight = Weight::Same(0);
    assert_invalid(validate_forward(&a), "weight is a null pointer");
    let mut a = fwd_args();
    a.rows = usize::MAX / 2;
    assert_invalid(validate_forward(&a), "too large");
    // round_first: a weight of the input dtype, or any weight for float32 / float64 inputs.
    let mut a = fwd_args();
    a.mode.round_first = true;
    assert!(validate_forward(&a).is_ok());
    a.weight = Weight::Acc(0x2000);
    assert_invalid(
        validate_forward(&a),
        "round_first needs a weight of the input dtype",
    );
    a.dtype = DType::F32;
    assert!(validate_forward(&a).is_ok());
    // The public entry points reject before touching the driver.
    let mut a = fwd_args();
    a.rows = 0;
    assert_invalid(rms_norm_forward(&a), "rows >= 1");
}

#[test]
fn backward_validation_rejects_bad_arguments() {
    assert!(validate_backward(&bwd_args()).is_ok());
    let mut a = bwd_args();
    a.dy = 0;
    assert_invalid(validate_backward(&a), "dy is a null pointer");
    let mut a = bwd_args();
    a.dx = Some(0);
    assert_invalid(validate_backward(&a), "dx is a null pointer");
    let mut a = bwd_args();
    a.dw = Some(0x6002);
    assert_invalid(validate_backward(&a), "dw");
    let mut a = bwd_args();
    a.weight = Weight::None;
    assert_invalid(validate_backward(&a), "without a weight");
    let mut a = bwd_args();
    a.workspace = 0;
    assert_invalid(validate_backward(&a), "workspace is a null pointer");
    let mut a = bwd_args();
    a.workspace = 0x7008;
    assert_invalid(validate_backward(&a), "not aligned to 16");
    // Without dw the workspace is not looked at.
    let mut a = bwd_args();
    a.dw = None;
    a.workspace = 0;
    assert!(validate_backward(&a).is_ok());
    let mut a = bwd_args();
    a.cols = 0;
    assert_invalid(rms_norm_backward(&a), "cols >= 1");
    let mut a = bwd_args();
    a.mode.round_first = true;
    assert!(validate_backward(&a).is_ok()); // f32 with an f32 weight
    a.dtype = DType::BF16;
    assert_invalid(validate_backward(&a), "round_first");
}
