//! Runs every kernel of ops/rms_norm/rms_norm.cu on the CPU through emu/ (a fiber-based stand-in
//! for the CUDA features the kernels use; needs `sh` and a C++20 `g++`): indexing,
//! coverage, reductions and numerics of every kernel variant, checked against float64,
//! without a GPU.

mod emu_harness;

#[test]
fn every_kernel_variant_matches_float64_on_the_cpu_emulator() {
    let s = emu_harness::run("run.sh", &["--quick"]);
    assert!(
        s.launches > 1000 && s.checks > 1000,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}

/// ops/glu/glu.cu and ops/rope/rope.cu on the emulator (emu/glu_rope_test.cpp): every
/// activation, dtype and direction of the gated linear units, packed and one-element paths,
/// in-place backward; RoPE over strided GQA operands with broadcast and partial tables.
#[test]
fn glu_and_rope_kernels_match_float64_on_the_cpu_emulator() {
    let s = emu_harness::run("run_glu_rope.sh", &[]);
    assert!(
        s.launches > 400 && s.checks > 800,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}

/// ops/moe_permute/moe_permute.cu on the emulator (emu/moe_permute_test.cpp): the sort by
/// expert against a stable sort; every dtype and weight kind, packed and one-element paths,
/// sentinel slots with an int32 or int64 `valid` (also out of range: clamped), out-of-range
/// indices read as sentinels, grid-stride loops.
#[test]
fn moe_permute_kernels_match_float64_on_the_cpu_emulator() {
    let s = emu_harness::run("run_moe_permute.sh", &[]);
    assert!(
        s.launches > 2000 && s.checks > 2500,
        "too few cases ran: {} launches, {} checks",
        s.launches,
        s.checks
    );
}
