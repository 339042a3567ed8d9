//! Runs every kernel of kernels/rms_norm.cu on the CPU through emu/ (a fiber-based stand-in
//! for the CUDA features the kernels use; needs `sh` and a C++20 `g++`): indexing,
//! coverage, reductions and numerics of every kernel variant, checked against float64,
//! without a GPU.

use std::path::Path;
use std::process::Command;

#[test]
fn every_kernel_variant_matches_float64_on_the_cpu_emulator() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("emu")
        .join("run.sh");
    let out = Command::new("sh")
        .arg(&script)
        .arg("--quick")
        .output()
        .expect("could not run emu/run.sh (needs sh and g++)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "emu failed:\n{stdout}\n{stderr}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("emu: "))
        .unwrap_or_else(|| panic!("no summary line:\n{stdout}"));
    // "emu: N launches, M checks, 0 failures"
    let nums: Vec<u64> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|t| t.parse().ok())
        .collect();
    assert_eq!(nums.len(), 3, "{summary}");
    assert!(
        nums[0] > 1000 && nums[1] > 1000,
        "too few cases ran: {summary}"
    );
    assert_eq!(nums[2], 0, "{stdout}");
}

/// kernels/glu.cu and kernels/rope.cu on the emulator (emu/glu_rope_test.cpp): every
/// activation, dtype and direction of the gated linear units, packed and one-element paths,
/// in-place backward; RoPE over strided GQA operands with broadcast and partial tables.
#[test]
fn glu_and_rope_kernels_match_float64_on_the_cpu_emulator() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("emu")
        .join("run_glu_rope.sh");
    let out = Command::new("sh")
        .arg(&script)
        .output()
        .expect("could not run emu/run_glu_rope.sh (needs sh and g++)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "emu failed:\n{stdout}\n{stderr}");
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("emu: "))
        .unwrap_or_else(|| panic!("no summary line:\n{stdout}"));
    let nums: Vec<u64> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|t| t.parse().ok())
        .collect();
    assert_eq!(nums.len(), 3, "{summary}");
    assert!(
        nums[0] > 400 && nums[1] > 800,
        "too few cases ran: {summary}"
    );
    assert_eq!(nums[2], 0, "{stdout}");
}
