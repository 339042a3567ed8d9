//! Runs every kernel of kernels/adam.cu on the CPU through emu/ (needs `sh` and a C++20 `g++`)
//! and compares every output to the bit with a host transcription of ATen's CUDA arithmetic:
//! indexing, chunking across tensors, vector and scalar paths, and the rounding of each step.

use std::path::Path;
use std::process::Command;

#[test]
fn every_adam_kernel_matches_atens_arithmetic_on_the_cpu_emulator() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("emu")
        .join("run_adam.sh");
    let out = Command::new("sh")
        .arg(&script)
        .output()
        .expect("could not run emu/run_adam.sh (needs sh and g++)");
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
        nums[0] >= 144 && nums[1] > 500_000,
        "too few cases ran: {summary}"
    );
    assert_eq!(nums[2], 0, "{stdout}");
}
