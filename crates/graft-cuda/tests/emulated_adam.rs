//! Runs every kernel of ops/adam/adam.cu on the CPU through emu/ (needs `sh` and a C++20 `g++`)
//! and compares every output to the bit with a host transcription of ATen's CUDA arithmetic:
//! indexing, chunking across tensors, vector and scalar paths, and the rounding of each step.

mod emu_harness;

#[test]
fn every_adam_kernel_matches_atens_arithmetic_on_the_cpu_emulator() {
    let s = emu_harness::run("run_adam.sh", &[]);
    assert!(
        s.launches >= 144 && s.checks > 500_000,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}
