//! Runs every kernel of ops/softmax/softmax.cu on the CPU through emu/ (needs `sh` and a C++20
//! `g++`) and compares the outputs with a float64 reference: every type pair, rows kernels at
//! every V (vector and scalar), loop kernels staged and not, cols kernels, softmax and
//! log-softmax, forward and backward, and rows of special values (NaN, +inf, -inf).

mod emu_harness;

#[test]
fn every_softmax_kernel_matches_the_reference_on_the_cpu_emulator() {
    let s = emu_harness::run("run_softmax.sh", &[]);
    assert!(
        s.launches >= 4000 && s.checks >= 4000,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}
