//! Runs every kernel of ops/topk_softmax/topk_softmax.cu on the CPU through emu/ (needs `sh`
//! and a C++20 `g++`) and compares the outputs with a float64 reference: every dtype, the
//! forward's register kernels at every V and its loop kernel, the backward, with and without
//! renormalization, k = 1 to experts, ties, special values, indices outside the row.

mod emu_harness;

#[test]
fn every_topk_softmax_kernel_matches_the_reference_on_the_cpu_emulator() {
    let s = emu_harness::run("run_topk_softmax.sh", &[]);
    assert!(
        s.launches >= 500 && s.checks >= 500,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}
