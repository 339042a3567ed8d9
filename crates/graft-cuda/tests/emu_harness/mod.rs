//! Running a kernel file's emulator test (emu/run_*.sh: the kernels compiled for the CPU
//! against emu/'s fiber-based stand-in for the CUDA features they use; needs `sh` and a C++20
//! `g++`) and reading its summary line.

use std::path::Path;
use std::process::Command;

/// What one emulator run did, from its summary line `emu: N launches, M checks, 0 failures`.
pub struct Summary {
    /// Kernel launches.
    pub launches: u64,
    /// Outputs compared with the reference.
    pub checks: u64,
}

/// Runs `emu/<script>` with `args`, asserts that it succeeded with no failed check, and
/// returns its summary.
pub fn run(script: &str, args: &[&str]) -> Summary {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("emu")
        .join(script);
    let out = Command::new("sh")
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("could not run emu/{script} (needs sh and g++): {e}"));
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
    assert_eq!(nums[2], 0, "{stdout}");
    Summary {
        launches: nums[0],
        checks: nums[1],
    }
}
