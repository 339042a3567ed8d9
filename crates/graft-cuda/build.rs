//! Compiles every op's kernels (src/ops/<op>/<op>.cu, sharing src/ops/common.cuh) with nvcc into one fatbin (SASS for sm_80, sm_90 and, when this
//! nvcc supports it, sm_100, plus compute_90 PTX) that src/fatbin.rs embeds.
//!
//! nvcc is `$NVCC`, else `nvcc` on PATH, else `$CUDA_HOME/bin/nvcc`. Without nvcc, or when
//! it fails, the crate still builds, without kernels (`kernels_built()` is then false), and
//! a cargo warning says why. ptxas's resource report (`-Xptxas -v`) is written to
//! `$OUT_DIR/graft_cuda_ptxas.txt`; a warning names every kernel that spills.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const FATBIN: &str = "graft_cuda.fatbin";
const PTXAS_REPORT: &str = "graft_cuda_ptxas.txt";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(graft_cuda_kernels)");
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");

    // Lets the tests insist on kernels when the build was given an nvcc.
    let requested = env::var_os("NVCC").is_some_and(|v| !v.is_empty());
    println!(
        "cargo::rustc-env=GRAFT_CUDA_NVCC_REQUESTED={}",
        if requested { "1" } else { "0" }
    );
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ops_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"))
        .join("src")
        .join("ops");
    let sources = cuda_sources(&ops_dir);
    // Not the whole src/ops (its Rust files would rebuild the kernels): the sources, the shared
    // header, and ops/mod.rs, which a new op's folder comes with.
    for src in &sources {
        println!("cargo::rerun-if-changed={}", src.display());
    }
    println!(
        "cargo::rerun-if-changed={}",
        ops_dir.join("common.cuh").display()
    );
    println!(
        "cargo::rerun-if-changed={}",
        ops_dir.join("mod.rs").display()
    );
    // A stale fatbin from an earlier build must not be embedded if this one fails.
    let _ = fs::remove_file(out_dir.join(FATBIN));

    match build(&out_dir, &ops_dir, &sources) {
        Ok(spills) => {
            println!("cargo::rustc-cfg=graft_cuda_kernels");
            for name in spills {
                println!("cargo::warning=graft-cuda: kernel {name} spills registers (see {PTXAS_REPORT})");
            }
        }
        Err(why) => {
            println!("cargo::warning=graft-cuda: building without CUDA kernels: {why}");
        }
    }
}

/// Every op's kernel source, `<ops>/<op>/<op>.cu` (sorted, so the build is reproducible).
fn cuda_sources(ops_dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(ops_dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter_map(|dir| {
                    let op = dir.file_name()?.to_str()?.to_owned();
                    let src = dir.join(format!("{op}.cu"));
                    src.is_file().then_some(src)
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn find_nvcc() -> Result<PathBuf, String> {
    if let Some(p) = env::var_os("NVCC").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("NVCC={} is not a file", p.display()))
        };
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    if let Some(home) = env::var_os("CUDA_HOME").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(home).join("bin").join("nvcc");
        if p.is_file() {
            return Ok(p);
        }
    }
    Err("no nvcc found (set NVCC, put nvcc on PATH, or set CUDA_HOME)".into())
}

/// Builds the fatbin; returns the names of kernels that spill.
fn build(out_dir: &Path, ops_dir: &Path, sources: &[PathBuf]) -> Result<Vec<String>, String> {
    if sources.is_empty() {
        return Err("no src/ops/<op>/<op>.cu sources".into());
    }
    let nvcc = find_nvcc()?;

    // One translation unit that includes every source, so one nvcc call makes one fatbin.
    let unity = out_dir.join("graft_cuda_all.cu");
    let body: String = sources
        .iter()
        .map(|s| format!("#include \"{}\"\n", s.display()))
        .collect();
    fs::write(&unity, body).map_err(|e| format!("writing {}: {e}", unity.display()))?;

    let codes = Command::new(&nvcc)
        .arg("--list-gpu-code")
        .output()
        .map_err(|e| format!("running {} --list-gpu-code: {e}", nvcc.display()))?;
    let codes = String::from_utf8_lossy(&codes.stdout).into_owned();
    let mut archs = vec!["80", "90"];
    if codes.lines().any(|l| l.trim() == "sm_100") {
        archs.push("100");
    }

    let fatbin = out_dir.join(FATBIN);
    let mut cmd = Command::new(&nvcc);
    cmd.arg("-fatbin")
        .args(["-O3", "-std=c++17", "-lineinfo", "-Xptxas", "-v"])
        // zstd-compressed device code: 3 MB instead of 25 MB (line info included).
        .arg("--compress-mode=size")
        .args(["--threads", "0"])
        // common.cuh, shared by the ops' sources.
        .arg("-I")
        .arg(ops_dir);
    for a in &archs {
        cmd.arg(format!("-gencode=arch=compute_{a},code=sm_{a}"));
    }
    cmd.arg("-gencode=arch=compute_90,code=compute_90")
        .arg("-o")
        .arg(&fatbin)
        .arg(&unity);
    let out = cmd
        .output()
        .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    fs::write(out_dir.join(PTXAS_REPORT), &report)
        .map_err(|e| format!("writing the ptxas report: {e}"))?;
    if !out.status.success() {
        let tail: Vec<&str> = report
            .lines()
            .filter(|l| !l.starts_with("ptxas info") && !l.trim_start().starts_with("0 bytes"))
            .take(20)
            .collect();
        return Err(format!(
            "{} failed ({}): {}",
            nvcc.display(),
            out.status,
            tail.join(" | ")
        ));
    }
    if !fatbin.is_file() {
        return Err(format!("{} produced no fatbin", nvcc.display()));
    }
    Ok(spilling_kernels(&report))
}

/// Kernels whose ptxas report shows spill stores or loads.
fn spilling_kernels(report: &str) -> Vec<String> {
    let mut current = String::new();
    let mut out = Vec::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = rest.trim().to_string();
        } else if line.contains("bytes spill stores") {
            let spills = line
                .split(',')
                .filter(|part| part.contains("spill"))
                .any(|part| !part.trim().starts_with("0 "));
            if spills && !out.contains(&current) {
                out.push(current.clone());
            }
        }
    }
    out
}
