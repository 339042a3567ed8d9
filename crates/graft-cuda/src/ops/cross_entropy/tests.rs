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
