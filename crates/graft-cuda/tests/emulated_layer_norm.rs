//! Runs every kernel of kernels/layer_norm.cu on the CPU through emu/ (needs `sh` and a C++20
//! `g++`) and compares the outputs with a float64 reference: every dtype, rows kernels at every
//! V (vector and scalar), loop kernels, weight and bias present or not, dx / dw / db through
//! the finalize kernel.

use std::path::Path;
use std::process::Command;

#[test]
fn every_layer_norm_kernel_matches_the_reference_on_the_cpu_emulator() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("emu")
        .join("run_layer_norm.sh");
    let out = Command::new("sh")
        .arg(&script)
        .output()
        .expect("could not run emu/run_layer_norm.sh (needs sh and g++)");
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
        nums[0] >= 1500 && nums[1] >= 2900,
        "too few cases ran: {summary}"
    );
    assert_eq!(nums[2], 0, "{stdout}");
}
