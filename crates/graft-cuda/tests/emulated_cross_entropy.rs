//! Runs the kernels of kernels/cross_entropy.cu on the CPU through emu/ (needs `sh` and a C++20
//! `g++`): every dtype, row shapes and alignments, gradient modes, ignored and masked rows,
//! block shapes, the count / reduce / scale kernels, checked against float64 without a GPU.

use std::path::Path;
use std::process::Command;

#[test]
fn cross_entropy_kernels_match_float64_on_the_cpu_emulator() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("emu")
        .join("run_cross_entropy.sh");
    let out = Command::new("sh")
        .arg(&script)
        .arg("--quick")
        .output()
        .expect("could not run emu/run_cross_entropy.sh (needs sh and g++)");
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
