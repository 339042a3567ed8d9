//! Timings against a device copy, the table, the output files.

use super::*;

// Timing.

pub(super) const SETS: usize = 3;

pub(super) struct TimedSets {
    pub(super) x: Vec<DeviceBuffer>,
    pub(super) y: Vec<DeviceBuffer>,
    pub(super) dy: Vec<DeviceBuffer>,
    pub(super) dx: Vec<DeviceBuffer>,
    pub(super) rstd: Vec<DeviceBuffer>,
    pub(super) w: DeviceBuffer,
    pub(super) dw: DeviceBuffer,
    pub(super) ws: DeviceBuffer,
}

#[derive(Clone, Debug)]
pub(super) struct Timing {
    pub(super) shape: String,
    pub(super) op: String,
    pub(super) config: String,
    pub(super) median_us: f64,
    pub(super) min_us: f64,
    pub(super) bytes: f64,
}

/// Median and minimum microseconds of `reps` timed calls of `f(i)` after `warmup`.
pub(super) fn time_it(
    dev: i32,
    stream: &Stream,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut(usize) -> Result<(), CudaError>,
) -> Result<(f64, f64), CudaError> {
    for i in 0..warmup {
        f(i)?;
    }
    let events: Vec<(Event, Event)> = (0..reps)
        .map(|_| Ok((Event::new(dev)?, Event::new(dev)?)))
        .collect::<Result<_, CudaError>>()?;
    for (i, (a, b)) in events.iter().enumerate() {
        a.record(stream)?;
        f(warmup + i)?;
        b.record(stream)?;
    }
    stream.synchronize()?;
    let mut us: Vec<f64> = events
        .iter()
        .map(|(a, b)| a.elapsed_ms(b).map(|ms| f64::from(ms) * 1e3))
        .collect::<Result<_, _>>()?;
    us.sort_by(|a, b| a.total_cmp(b));
    Ok((us[us.len() / 2], us[0]))
}

pub(super) fn fill_random(rng: &mut Rng, n: usize) -> Vec<u8> {
    // bf16 of |v| in [0.25, 2) with random signs, generated in parallel chunks.
    let mut out = vec![0u8; n * 2];
    let chunk = (n / threads()).max(1 << 16) * 2;
    let seeds: Vec<u64> = (0..out.len().div_ceil(chunk))
        .map(|_| rng.next_u64())
        .collect();
    std::thread::scope(|s| {
        for (c, seed) in out.chunks_mut(chunk).zip(seeds) {
            s.spawn(move || {
                let mut r = Rng(seed);
                for e in c.chunks_exact_mut(2) {
                    e.copy_from_slice(&bf16::from_f64(r.signed()).to_bits().to_le_bytes());
                }
            });
        }
    });
    out
}

pub(super) fn plan_text(p: &Plan) -> String {
    let k = p.kernel_name();
    let short = k.trim_start_matches("graft_rms_");
    format!(
        "{short} tpr{} rpb{} blk{} grid{}",
        p.threads_per_row, p.rows_per_block, p.block, p.grid
    )
}

pub(super) fn timings(
    dev: i32,
    shapes: &[(usize, usize)],
    smoke: bool,
    log: &mut Log,
    out: &mut Vec<Timing>,
) -> Result<usize, CudaError> {
    let mut failures = 0;
    let stream = Stream::new(dev)?;
    let mut rng = Rng(0x7157);
    for &(rows, cols) in shapes {
        let n = rows * cols;
        let bytes = n * 2;
        let shape = format!("{rows}x{cols}");
        let data = fill_random(&mut rng, n);
        let mk = |k: usize| -> Result<Vec<DeviceBuffer>, CudaError> {
            (0..SETS).map(|_| DeviceBuffer::new(dev, k)).collect()
        };
        let ts = TimedSets {
            x: mk(bytes)?,
            y: mk(bytes)?,
            dy: mk(bytes)?,
            dx: mk(bytes)?,
            rstd: mk(rows * 4)?,
            w: DeviceBuffer::new(dev, cols * 2)?,
            dw: DeviceBuffer::new(dev, cols * 2)?,
            ws: DeviceBuffer::new(
                dev,
                graft_cuda::rms_norm_backward_workspace_bytes(dev, rows, cols, true)?,
            )?,
        };
        for i in 0..SETS {
            ts.x[i].upload(0, &data)?;
            // dy: the same values shifted, so x and dy differ.
            ts.dy[i].upload(0, &data[2 * 977..])?;
            ts.dy[i].upload(bytes - 2 * 977, &data[..2 * 977])?;
        }
        drop(data);
        ts.w.upload(0, &fill_random(&mut rng, cols))?;
        let fwd = |i: usize| RmsNormForward {
            device: dev,
            stream: stream.handle(),
            dtype: DType::BF16,
            x: ts.x[i % SETS].ptr(),
            weight: Weight::Same(ts.w.ptr()),
            y: ts.y[i % SETS].ptr(),
            rstd: ts.rstd[i % SETS].ptr(),
            rows,
            cols,
            eps: 1e-6,
            mode: WeightMode::default(),
        };
        let bwd = |i: usize, dw: bool| RmsNormBackward {
            device: dev,
            stream: stream.handle(),
            dtype: DType::BF16,
            dy: ts.dy[i % SETS].ptr(),
            x: ts.x[i % SETS].ptr(),
            rstd: ts.rstd[i % SETS].ptr(),
            weight: Weight::Same(ts.w.ptr()),
            dx: Some(ts.dx[i % SETS].ptr()),
            dw: dw.then(|| ts.dw.ptr()),
            workspace: ts.ws.ptr(),
            workspace_bytes: ts.ws.len(),
            rows,
            cols,
            mode: WeightMode::default(),
        };
        // rstd for the backward comes from a forward of each set.
        for i in 0..SETS {
            graft_cuda::rms_norm_forward(&fwd(i))?;
        }
        stream.synchronize()?;
        let reps = if smoke {
            3
        } else if rows >= 32768 {
            40
        } else {
            100
        };
        let warm = if smoke { 1 } else { 5 };

        let (med, min) = time_it(dev, &stream, warm, reps, |i| {
            // SAFETY: both buffers hold `bytes` bytes and outlive the synchronised timing.
            unsafe {
                tools::copy_dtod_async(
                    dev,
                    ts.y[i % SETS].ptr(),
                    ts.x[i % SETS].ptr(),
                    bytes,
                    &stream,
                )
            }
        })?;
        let copy_us = med;
        out.push(Timing {
            shape: shape.clone(),
            op: "copy".into(),
            config: "cuMemcpyDtoDAsync".into(),
            median_us: med,
            min_us: min,
            bytes: 2.0 * bytes as f64,
        });

        // Forward variants (the default first).
        let mut fwd_tunings = vec![Tuning::default()];
        for v in [2u32, 4, 8, 16] {
            for b in [128u32, 256, 512] {
                fwd_tunings.push(Tuning {
                    units_per_thread: Some(v),
                    block_threads: Some(b),
                    ..Tuning::default()
                });
            }
        }
        for bps in [4u32, 8, 16] {
            fwd_tunings.push(Tuning {
                blocks_per_sm: Some(bps),
                ..Tuning::default()
            });
        }
        fwd_tunings.push(Tuning {
            force_loop: true,
            ..Tuning::default()
        });
        let mut seen = Vec::new();
        for (ti, t) in fwd_tunings.iter().enumerate() {
            let Ok(plan) = graft_cuda::plan_forward(&fwd(0), t) else {
                continue;
            };
            if seen.contains(&plan) {
                continue;
            }
            seen.push(plan);
            let (med, min) = time_it(dev, &stream, warm, reps, |i| {
                graft_cuda::rms_norm_forward_with(&fwd(i), t)
            })?;
            out.push(Timing {
                shape: shape.clone(),
                op: if ti == 0 { "fwd" } else { "fwd-variant" }.into(),
                config: plan_text(&plan),
                median_us: med,
                min_us: min,
                bytes: 2.0 * bytes as f64,
            });
        }
        // Restore rstd from the default forward for the backward timings.
        for i in 0..SETS {
            graft_cuda::rms_norm_forward(&fwd(i))?;
        }

        let mut bwd_tunings = vec![Tuning::default()];
        for v in [1u32, 2, 4, 8] {
            for b in [128u32, 256, 512] {
                bwd_tunings.push(Tuning {
                    units_per_thread: Some(v),
                    block_threads: Some(b),
                    ..Tuning::default()
                });
            }
        }
        for bps in [1u32, 2, 3, 4] {
            bwd_tunings.push(Tuning {
                blocks_per_sm: Some(bps),
                ..Tuning::default()
            });
        }
        bwd_tunings.push(Tuning {
            force_loop: true,
            ..Tuning::default()
        });
        let mut seen = Vec::new();
        for (ti, t) in bwd_tunings.iter().enumerate() {
            let Ok(plan) = graft_cuda::plan_backward(&bwd(0, true), t) else {
                continue;
            };
            if seen.contains(&plan) {
                continue;
            }
            seen.push(plan);
            let (med, min) = time_it(dev, &stream, warm, reps, |i| {
                graft_cuda::rms_norm_backward_with(&bwd(i, true), t)
            })?;
            out.push(Timing {
                shape: shape.clone(),
                op: if ti == 0 { "bwd" } else { "bwd-variant" }.into(),
                config: plan_text(&plan),
                median_us: med,
                min_us: min,
                bytes: 3.0 * bytes as f64,
            });
        }
        let (med, min) = time_it(dev, &stream, warm, reps, |i| {
            graft_cuda::rms_norm_backward(&bwd(i, false))
        })?;
        let plan = graft_cuda::plan_backward(&bwd(0, false), &Tuning::default())?;
        out.push(Timing {
            shape: shape.clone(),
            op: "bwd-dx-only".into(),
            config: plan_text(&plan),
            median_us: med,
            min_us: min,
            bytes: 3.0 * bytes as f64,
        });

        // The default configurations against the targets.
        let get = |op: &str| {
            out.iter()
                .find(|t| t.shape == shape && t.op == op)
                .map(|t| t.median_us)
        };
        let f = get("fwd").unwrap_or(f64::NAN);
        let b = get("bwd").unwrap_or(f64::NAN);
        let fr = f / copy_us;
        let br = b / (1.5 * copy_us);
        log.line(format!(
            "{shape}: fwd/copy {fr:.3} (target <= 1.05: {}), bwd/(1.5 copy) {br:.3} (target <= \
             1.15: {})",
            if fr <= 1.05 { "met" } else { "MISSED" },
            if br <= 1.15 { "met" } else { "MISSED" }
        ));
        if !(fr.is_finite() && br.is_finite()) {
            failures += 1;
        }
    }
    Ok(failures)
}

/// Time over the copy's time scaled to the op's bytes: fwd/copy, bwd/(1.5 copy).
pub(super) fn copy_ratio(t: &[Timing], r: &Timing) -> f64 {
    let copy = t.iter().find(|c| c.shape == r.shape && c.op == "copy");
    copy.map_or(f64::NAN, |c| {
        r.median_us / (c.median_us * r.bytes / c.bytes)
    })
}

pub(super) fn print_table(log: &mut Log, t: &[Timing], shapes: &[String]) {
    let line = |log: &mut Log, r: &Timing, op: &str| {
        log.line(format!(
            "{:<11} {:<11} {:<52} {:>9.1} {:>9.1} {:>6.0} {:>6.3}",
            r.shape,
            op,
            r.config,
            r.median_us,
            r.min_us,
            r.bytes / r.median_us / 1e3,
            copy_ratio(t, r)
        ));
    };
    let header = |log: &mut Log| {
        log.line(format!(
            "{:<11} {:<11} {:<52} {:>9} {:>9} {:>6} {:>6}",
            "shape", "op", "config", "med us", "min us", "GB/s", "xcopy"
        ))
    };
    // All variants, fastest first within each op.
    log.line(String::new());
    log.line("all configurations (xcopy: time / copy time of the same bytes; bwd moves 1.5x):");
    header(log);
    let mut all: Vec<&Timing> = t.iter().collect();
    all.sort_by(|a, b| {
        (a.shape.as_str(), a.op.trim_end_matches("-variant"))
            .cmp(&(b.shape.as_str(), b.op.trim_end_matches("-variant")))
            .then(a.median_us.total_cmp(&b.median_us))
    });
    for r in all {
        line(log, r, &r.op.replace("-variant", "*"));
    }
    // Summary: the defaults and the best variant per op.
    log.line(String::new());
    log.line("summary (targets: fwd xcopy <= 1.05, bwd xcopy <= 1.15):");
    header(log);
    for shape in shapes.iter().map(String::as_str) {
        for op in ["copy", "fwd", "bwd", "bwd-dx-only"] {
            if let Some(r) = t.iter().find(|r| r.shape == shape && r.op == op) {
                line(log, r, op);
            }
        }
        for op in ["fwd", "bwd"] {
            let best = t
                .iter()
                .filter(|r| r.shape == shape && r.op.trim_end_matches("-variant") == op)
                .min_by(|a, b| a.median_us.total_cmp(&b.median_us));
            if let Some(r) = best {
                line(log, r, &format!("best {op}"));
            }
        }
    }
}

pub(super) fn json_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

pub(super) fn write_outputs(dir: &str, log: &Log, sweep: Option<&Sweep>, t: &[Timing]) {
    let mut j = String::from("{\n");
    if let Some(s) = sweep {
        let _ = writeln!(j, "  \"checks\": {},\n  \"failures\": [", s.checks);
        for (i, f) in s.failures.iter().enumerate() {
            let sep = if i + 1 < s.failures.len() { "," } else { "" };
            let _ = writeln!(j, "    \"{}\"{sep}", json_escape(f));
        }
        j.push_str("  ],\n  \"worst_rel_err\": {\n");
        for (i, (k, e, tol, _)) in s.worst.iter().enumerate() {
            let sep = if i + 1 < s.worst.len() { "," } else { "" };
            let _ = writeln!(j, "    \"{}\": [{e:e}, {tol:e}]{sep}", json_escape(k));
        }
        j.push_str("  },\n");
    }
    j.push_str("  \"timings\": [\n");
    for (i, r) in t.iter().enumerate() {
        let sep = if i + 1 < t.len() { "," } else { "" };
        let _ = writeln!(
            j,
            "    {{\"shape\": \"{}\", \"op\": \"{}\", \"config\": \"{}\", \"median_us\": {:.3}, \
             \"min_us\": {:.3}, \"bytes\": {}}}{sep}",
            r.shape,
            r.op,
            json_escape(&r.config),
            r.median_us,
            r.min_us,
            r.bytes
        );
    }
    j.push_str("  ]\n}\n");
    let _ = std::fs::create_dir_all(dir);
    let _ = std::fs::write(format!("{dir}/selftest.json"), j);
    let _ = std::fs::write(format!("{dir}/selftest.log"), &log.text);
}
