//! graft-cuda self-test for a GPU machine: no Rust or PyTorch needed there.
//!
//! 1. Correctness sweep of forward and backward against a float64 CPU reference (fresh
//!    random inputs, never zeros; outputs poisoned with NaN and followed by guard bytes),
//!    over dtypes, weight kinds, shapes, unaligned pointers and forced kernel variants;
//!    dw (and dx) must be bit-identical across two runs; NaN/Inf must propagate.
//! 2. Timings (CUDA events, warm-up, median of many reps, rotating buffer sets) of forward
//!    and backward at (32768, 4096) and (8192, 4096) bf16 next to a device-to-device copy
//!    of the same bytes, with launch-parameter variants; a short table is printed last.
//!
//! Usage: selftest [--small] [--no-timing] [--timing-smoke] [--device N] [--out DIR]
//!   --small         a handful of small cases, no timing (for compute-sanitizer)
//!   --timing-smoke  time tiny shapes with few reps (checks the timing code, e.g. on emu/)
//!   --out DIR    also write DIR/selftest.json and DIR/selftest.log (default: $OUT if set)
//! Exit status: 0 when every check passed, 1 on any mismatch or error.

use std::fmt::Write as _;
use std::time::Instant;

use graft_cuda::tools::{self, DeviceBuffer, Event, Stream};
use graft_cuda::{
    CudaError, DType, ErrorKind, Plan, RmsNormBackward, RmsNormForward, Tuning, Weight, WeightMode,
};
use half::{bf16, f16};

mod reference;
mod sweep;
mod timing;
mod util;

use reference::*;
use sweep::*;
use timing::*;
use util::*;

// ---------------------------------------------------------------------------------------
// Options and logging (random numbers and dtype encoding: util.rs).

struct Options {
    small: bool,
    timing: bool,
    /// Tiny timing shapes and few reps: exercises the timing code (e.g. on emu/).
    timing_smoke: bool,
    device: i32,
    out: Option<String>,
}

fn parse_args() -> Options {
    let mut o = Options {
        small: false,
        timing: true,
        timing_smoke: false,
        device: 0,
        out: std::env::var("OUT").ok().filter(|s| !s.is_empty()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--small" => o.small = true,
            "--no-timing" => o.timing = false,
            "--timing-smoke" => o.timing_smoke = true,
            "--device" => o.device = it.next().and_then(|v| v.parse().ok()).unwrap_or(0),
            "--out" => o.out = it.next(),
            "-h" | "--help" => {
                println!("usage: selftest [--small] [--no-timing] [--device N] [--out DIR]");
                std::process::exit(0);
            }
            other => {
                eprintln!("selftest: unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    // --small times nothing unless asked for the smoke timing.
    o.timing = o.timing_smoke || (o.timing && !o.small);
    o
}

/// Everything printed also goes to the log file.
struct Log {
    text: String,
}

impl Log {
    fn line(&mut self, s: impl AsRef<str>) {
        println!("{}", s.as_ref());
        self.text.push_str(s.as_ref());
        self.text.push('\n');
    }
}

fn main() {
    let opts = parse_args();
    let mut log = Log {
        text: String::new(),
    };
    let code = match run(&opts, &mut log) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            log.line(format!("ERROR: {e}"));
            1
        }
    };
    log.line(if code == 0 {
        "selftest: PASS"
    } else {
        "selftest: FAIL"
    });
    if let Some(dir) = &opts.out {
        let _ = std::fs::create_dir_all(dir);
        let _ = std::fs::write(format!("{dir}/selftest.log"), &log.text);
    }
    std::process::exit(code);
}

fn run(opts: &Options, log: &mut Log) -> Result<bool, CudaError> {
    let t0 = Instant::now();
    if !graft_cuda::kernels_built() {
        log.line("graft-cuda was built without kernels (no nvcc at build time)");
        return Ok(false);
    }
    let n = graft_cuda::device_count()?;
    if n == 0 {
        log.line("no CUDA device");
        return Ok(false);
    }
    let dev = opts.device;
    let info = tools::device_info(dev)?;
    log.line(format!(
        "device {dev}: {} (sm_{}{}), {} SMs, L2 {} MB, driver {}.{}",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.limits.sms,
        info.l2_bytes >> 20,
        info.driver_version / 1000,
        info.driver_version % 1000 / 10
    ));
    let loaded = tools::loaded_kernels(dev)?;
    let spilling: Vec<&str> = loaded
        .iter()
        .filter(|k| k.local_bytes > 0)
        .map(|k| k.name.as_str())
        .collect();
    let max_regs = loaded.iter().map(|k| k.attrs.regs).max().unwrap_or(0);
    log.line(format!(
        "kernels: {} loaded, max {} registers, {} with local memory{}",
        loaded.len(),
        max_regs,
        spilling.len(),
        if spilling.is_empty() {
            String::new()
        } else {
            format!(": {spilling:?}")
        }
    ));
    for k in loaded.iter().filter(|k| {
        k.name.contains("bf16_same_v")
            || k.name.contains("loop_bf16_same")
            || k.name.contains("finalize")
    }) {
        log.line(format!(
            "  {:<40} {:>3} regs {:>5} B smem",
            k.name, k.attrs.regs, k.attrs.static_smem
        ));
    }

    let sweep = correctness(dev, opts.small, log)?;
    let mut ok = sweep.failures.is_empty() && spilling.is_empty();
    let mut t = Vec::new();
    if opts.timing {
        let shapes: &[(usize, usize)] = if opts.timing_smoke {
            &[(256, 4096), (64, 4096)]
        } else {
            &[(32768, 4096), (8192, 4096)]
        };
        let misses = timings(dev, shapes, opts.timing_smoke, log, &mut t)?;
        ok &= misses == 0;
        let names: Vec<String> = shapes.iter().map(|(r, c)| format!("{r}x{c}")).collect();
        print_table(log, &t, &names);
    }
    log.line(format!("total {:.1} s", t0.elapsed().as_secs_f64()));
    if let Some(dir) = &opts.out {
        write_outputs(dir, log, Some(&sweep), &t);
    }
    Ok(ok)
}
