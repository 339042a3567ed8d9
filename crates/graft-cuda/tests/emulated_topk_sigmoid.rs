//! Runs every kernel of ops/topk_sigmoid/topk_sigmoid.cu on the CPU through emu/ (needs `sh`
//! and a C++20 `g++`) and compares the outputs with a float64 reference: every dtype, the
//! forward's register kernels at every V and its loop kernel, with and without a bias, groups
//! 1, 4 and 8, several topk_groups, k = 1 to topk_groups * experts / groups, renormalization,
//! scale, ties of experts and of groups, special values; the backward with repeated indices
//! and indices outside the row. CI runs `--quick` (the forward in float32, every kernel
//! variant; the backward in every dtype: ~30 s on two cores); `emu/run_topk_sigmoid.sh`
//! without it runs every dtype's forward too (~80 s).

mod emu_harness;

#[test]
fn every_topk_sigmoid_kernel_matches_the_reference_on_the_cpu_emulator() {
    let s = emu_harness::run("run_topk_sigmoid.sh", &["--quick"]);
    assert!(
        s.launches >= 1000 && s.checks >= 1000,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}
