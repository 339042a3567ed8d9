//! Runs the kernels of ops/cross_entropy/cross_entropy.cu on the CPU through emu/ (needs `sh` and a C++20
//! `g++`): every dtype, row shapes and alignments, gradient modes, ignored and masked rows,
//! block shapes, the count / reduce / scale kernels, checked against float64 without a GPU.

mod emu_harness;

#[test]
fn cross_entropy_kernels_match_float64_on_the_cpu_emulator() {
    let s = emu_harness::run("run_cross_entropy.sh", &["--quick"]);
    assert!(
        s.launches > 1000 && s.checks > 1000,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}
