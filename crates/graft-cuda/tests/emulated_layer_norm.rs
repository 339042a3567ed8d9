//! Runs every kernel of ops/layer_norm/layer_norm.cu on the CPU through emu/ (needs `sh` and a C++20
//! `g++`) and compares the outputs with a float64 reference: every dtype, rows kernels at every
//! V (vector and scalar), loop kernels, weight and bias present or not, dx / dw / db through
//! the finalize kernel.

mod emu_harness;

#[test]
fn every_layer_norm_kernel_matches_the_reference_on_the_cpu_emulator() {
    let s = emu_harness::run("run_layer_norm.sh", &[]);
    assert!(
        s.launches >= 1500 && s.checks >= 2900,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}
