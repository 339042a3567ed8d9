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

// ---------------------------------------------------------------------------------------
// Small utilities: options, logging, random numbers, dtype encoding.

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

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// |v| in [0.25, 2), random sign: never zero.
    fn signed(&mut self) -> f64 {
        let m = 0.25 + 1.75 * self.unit();
        if self.next_u64() & 1 == 0 {
            m
        } else {
            -m
        }
    }
}

fn encode(dtype: DType, v: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dtype.size());
    for &x in v {
        match dtype {
            DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&x.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(x).to_bits().to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(x).to_bits().to_le_bytes()),
        }
    }
    out
}

fn decode(dtype: DType, b: &[u8]) -> Vec<f64> {
    b.chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F32 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            DType::F16 => f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64(),
            DType::BF16 => bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f64(),
        })
        .collect()
}

/// Values rounded to `dtype` (so the reference sees exactly what the kernel reads).
fn rounded(dtype: DType, v: Vec<f64>) -> Vec<f64> {
    decode(dtype, &encode(dtype, &v))
}

/// One quiet NaN of `dtype`.
fn nan_bytes(dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => 0x7FC0_0000u32.to_le_bytes().to_vec(),
        DType::F64 => 0x7FF8_0000_0000_0000u64.to_le_bytes().to_vec(),
        DType::F16 => 0x7E00u16.to_le_bytes().to_vec(),
        DType::BF16 => 0x7FC0u16.to_le_bytes().to_vec(),
    }
}

/// ||out - ref|| / max(||ref||, scale) over the finite reference values; infinite when a
/// non-finite reference value is not matched (NaN by NaN, +-Inf by the same Inf) or `out`
/// has a non-finite value where the reference is finite. `scale` is the size the output
/// has when its terms do not cancel (dx: ||rstd * g||; dw: the typical size of a sum of
/// random-sign terms): where they do cancel (cols == 1: dx ~ eps; a dw column summing to
/// nearly 0) the relative error grows in any precision, and is measured against that size
/// instead. For ordinary data ||ref|| is about `scale` and this is the plain relative
/// error. 0: plain relative error.
fn rel_err(out: &[f64], reference: &[f64], scale: f64) -> f64 {
    assert_eq!(out.len(), reference.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&o, &r) in out.iter().zip(reference) {
        if r.is_nan() {
            if !o.is_nan() {
                return f64::INFINITY;
            }
        } else if r.is_infinite() {
            if o != r {
                return f64::INFINITY;
            }
        } else if !o.is_finite() {
            return f64::INFINITY;
        } else {
            num += (o - r) * (o - r);
            den += r * r;
        }
    }
    let den = den.sqrt().max(scale);
    if den == 0.0 {
        num.sqrt()
    } else {
        num.sqrt() / den
    }
}

/// Relative-norm tolerance for outputs of `dtype`.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-6,
        DType::F16 => 2e-3,
        DType::BF16 => 1e-2,
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::F64 => "f64",
    }
}

// ---------------------------------------------------------------------------------------
// The float64 reference (threads over row blocks).

fn threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}

struct FwdRef {
    y: Vec<f64>,
    rstd: Vec<f64>,
}

fn forward_ref(x: &[f64], w: Option<&[f64]>, rows: usize, cols: usize, eps: f64) -> FwdRef {
    let mut y = vec![0.0; rows * cols];
    let mut rstd = vec![0.0; rows];
    let chunk = rows.div_ceil(threads()).max(1);
    std::thread::scope(|s| {
        for (ci, (yc, rc)) in y
            .chunks_mut(chunk * cols)
            .zip(rstd.chunks_mut(chunk))
            .enumerate()
        {
            s.spawn(move || {
                for (i, r_out) in rc.iter_mut().enumerate() {
                    let row = ci * chunk + i;
                    let xr = &x[row * cols..(row + 1) * cols];
                    let ms = xr.iter().map(|v| v * v).sum::<f64>() / cols as f64;
                    let r = 1.0 / (ms + eps).sqrt();
                    *r_out = r;
                    for (j, out) in yc[i * cols..(i + 1) * cols].iter_mut().enumerate() {
                        *out = xr[j] * r * w.map_or(1.0, |w| w[j]);
                    }
                }
            });
        }
    });
    FwdRef { y, rstd }
}

struct BwdRef {
    dx: Vec<f64>,
    dw: Vec<f64>,
    /// ||rstd * g||: the scale of dx's terms (see rel_err).
    dx_scale: f64,
    /// ||sum over rows of |dy * xhat||| / sqrt(rows): the size a sum of `rows` random-sign
    /// terms has, so that an unluckily cancelling column (cols == 1) is not misjudged.
    dw_scale: f64,
}

fn backward_ref(
    dy: &[f64],
    x: &[f64],
    rstd: &[f64],
    w: Option<&[f64]>,
    rows: usize,
    cols: usize,
) -> BwdRef {
    let mut dx = vec![0.0; rows * cols];
    let chunk = rows.div_ceil(threads()).max(1);
    let mut partials: Vec<(Vec<f64>, Vec<f64>, f64)> = Vec::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = dx
            .chunks_mut(chunk * cols)
            .enumerate()
            .map(|(ci, dxc)| {
                s.spawn(move || {
                    let mut dw = vec![0.0; cols];
                    let mut dw_abs = vec![0.0; cols];
                    let mut scale2 = 0.0;
                    for i in 0..dxc.len() / cols {
                        let row = ci * chunk + i;
                        let (xr, gr) = (&x[row * cols..][..cols], &dy[row * cols..][..cols]);
                        let r = rstd[row];
                        let g = |j: usize| gr[j] * w.map_or(1.0, |w| w[j]);
                        let dot: f64 = (0..cols).map(|j| g(j) * xr[j] * r).sum();
                        let c = dot / cols as f64;
                        for j in 0..cols {
                            let xh = xr[j] * r;
                            dxc[i * cols + j] = (g(j) - xh * c) * r;
                            dw[j] += gr[j] * xh;
                            dw_abs[j] += (gr[j] * xh).abs();
                            scale2 += (g(j) * r) * (g(j) * r);
                        }
                    }
                    (dw, dw_abs, scale2)
                })
            })
            .collect();
        partials = handles.into_iter().map(|h| h.join().unwrap()).collect();
    });
    let mut dw = vec![0.0; cols];
    let mut dw_abs = vec![0.0; cols];
    let mut scale2 = 0.0;
    for (p, pa, s2) in &partials {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
        for (a, b) in dw_abs.iter_mut().zip(pa) {
            *a += b;
        }
        scale2 += s2;
    }
    let dw_scale = dw_abs.iter().map(|v| v * v).sum::<f64>().sqrt() / (rows as f64).sqrt();
    BwdRef {
        dx,
        dw,
        dx_scale: scale2.sqrt(),
        dw_scale,
    }
}

// ---------------------------------------------------------------------------------------
// Device buffers for the sweep, and one test case.

const GUARD: usize = 256;
const GUARD_BYTE: u8 = 0xA5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WKind {
    None,
    Same,
    Acc,
}

impl WKind {
    fn name(self) -> &'static str {
        match self {
            WKind::None => "none",
            WKind::Same => "same",
            WKind::Acc => "acc",
        }
    }
    fn weight(self, p: u64) -> Weight {
        match self {
            WKind::None => Weight::None,
            WKind::Same => Weight::Same(p),
            WKind::Acc => Weight::Acc(p),
        }
    }
    fn dtype(self, d: DType) -> Option<DType> {
        self.weight(1).dtype(d)
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    dtype: DType,
    w: WKind,
    rows: usize,
    cols: usize,
    /// Offset every pointer by one element (misaligns the 16-byte vectors).
    offset: bool,
    /// Launch overrides of the forward and the backward (their V ranges differ).
    fwd_tuning: Tuning,
    bwd_tuning: Tuning,
    /// Also run the dx-only and dw-only backward.
    partial_modes: bool,
}

impl Case {
    fn label(&self) -> String {
        let mut s = format!(
            "{} w={} {}x{}{}",
            dtype_name(self.dtype),
            self.w.name(),
            self.rows,
            self.cols,
            if self.offset { " +1" } else { "" }
        );
        for (dir, t) in [("fwd", &self.fwd_tuning), ("bwd", &self.bwd_tuning)] {
            if *t != Tuning::default() {
                let _ = write!(s, " {dir}[{}]", tuning_text(t));
            }
        }
        s
    }
}

fn tuning_text(t: &Tuning) -> String {
    let mut parts = Vec::new();
    if let Some(v) = t.units_per_thread {
        parts.push(format!("V={v}"));
    }
    if let Some(b) = t.block_threads {
        parts.push(format!("block={b}"));
    }
    if let Some(b) = t.blocks_per_sm {
        parts.push(format!("blocks/SM={b}"));
    }
    if t.force_loop {
        parts.push("loop".to_string());
    }
    parts.join(" ")
}

struct Bufs {
    x: DeviceBuffer,
    y: DeviceBuffer,
    dy: DeviceBuffer,
    dx: DeviceBuffer,
    w: DeviceBuffer,
    dw: DeviceBuffer,
    rstd: DeviceBuffer,
    ws: DeviceBuffer,
}

struct Sweep {
    device: i32,
    stream: Stream,
    bufs: Bufs,
    rng: Rng,
    eps: f64,
    checks: usize,
    failures: Vec<String>,
    /// (output and dtype, worst error, tolerance, case)
    worst: Vec<(String, f64, f64, String)>,
}

/// Uploads `data` at `off` into `buf`, followed by guard bytes.
fn put(buf: &DeviceBuffer, off: usize, data: &[u8]) -> Result<(), CudaError> {
    let mut v = data.to_vec();
    v.extend(std::iter::repeat_n(GUARD_BYTE, GUARD));
    buf.upload(off, &v)
}

/// Fills `n` elements at `off` with NaN of `dtype`, followed by guard bytes.
fn poison(buf: &DeviceBuffer, off: usize, dtype: DType, n: usize) -> Result<(), CudaError> {
    put(buf, off, &nan_bytes(dtype).repeat(n))
}

/// Downloads `n` elements of `dtype` at `off`; `Err` text if the guard after them changed.
fn get(buf: &DeviceBuffer, off: usize, dtype: DType, n: usize) -> Result<Vec<f64>, String> {
    let mut v = vec![0u8; n * dtype.size() + GUARD];
    buf.download(off, &mut v).map_err(|e| e.to_string())?;
    if v[n * dtype.size()..].iter().any(|&b| b != GUARD_BYTE) {
        return Err("wrote past the end of its output".into());
    }
    v.truncate(n * dtype.size());
    Ok(decode(dtype, &v))
}

impl Sweep {
    fn fail(&mut self, what: String) {
        println!("FAIL {what}");
        self.failures.push(what);
    }

    /// Compares one output; records the worst error per (dtype, output).
    fn check(&mut self, label: &str, what: &str, dtype: DType, out: &[f64], reference: &[f64]) {
        self.check_scaled(label, what, dtype, out, reference, 0.0);
    }

    fn check_scaled(
        &mut self,
        label: &str,
        what: &str,
        dtype: DType,
        out: &[f64],
        reference: &[f64],
        scale: f64,
    ) {
        self.checks += 1;
        let err = rel_err(out, reference, scale);
        let tol = tolerance(dtype);
        let key = format!("{what} ({})", dtype_name(dtype));
        match self.worst.iter_mut().find(|w| w.0 == key) {
            Some(w) if err > w.1 => {
                w.1 = err;
                w.3 = label.to_string();
            }
            Some(_) => {}
            None => self.worst.push((key, err, tol, label.to_string())),
        }
        if err.is_nan() || err > tol {
            self.fail(format!("{label}: {what} rel err {err:.3e} > {tol:.0e}"));
        }
    }

    /// Runs one case; `Err` only for errors after which the context is unusable.
    fn run(&mut self, c: &Case) -> Result<(), CudaError> {
        let label = c.label();
        let (dt, acc) = (c.dtype, c.dtype.acc());
        let wdt = c.w.dtype(dt);
        let n = c.rows * c.cols;
        let el = |d: DType| if c.offset { d.size() } else { 0 };

        let x = rounded(dt, (0..n).map(|_| self.rng.signed()).collect());
        let dy = rounded(dt, (0..n).map(|_| self.rng.signed()).collect());
        let w = wdt.map(|d| rounded(d, (0..c.cols).map(|_| 0.5 + self.rng.unit()).collect()));
        let b = &self.bufs;
        put(&b.x, el(dt), &encode(dt, &x))?;
        put(&b.dy, el(dt), &encode(dt, &dy))?;
        if let (Some(d), Some(w)) = (wdt, &w) {
            put(&b.w, el(d), &encode(d, w))?;
        }
        let wptr = |b: &Bufs| c.w.weight(b.w.ptr() + el(wdt.unwrap_or(dt)) as u64);

        // Forward.
        poison(&b.y, el(dt), dt, n)?;
        poison(&b.rstd, el(acc), acc, c.rows)?;
        let fwd = RmsNormForward {
            device: self.device,
            stream: self.stream.handle(),
            dtype: dt,
            x: b.x.ptr() + el(dt) as u64,
            weight: wptr(b),
            y: b.y.ptr() + el(dt) as u64,
            rstd: b.rstd.ptr() + el(acc) as u64,
            rows: c.rows,
            cols: c.cols,
            eps: self.eps,
            mode: WeightMode::default(),
        };
        let reference = forward_ref(&x, w.as_deref(), c.rows, c.cols, self.eps);
        match graft_cuda::rms_norm_forward_with(&fwd, &c.fwd_tuning) {
            Err(e) => self.fail(format!("{label}: forward refused: {e}")),
            Ok(()) => {
                self.stream.synchronize()?;
                match get(&self.bufs.y, el(dt), dt, n) {
                    Ok(y) => self.check(&label, "fwd y", dt, &y, &reference.y),
                    Err(e) => self.fail(format!("{label}: fwd y {e}")),
                }
                match get(&self.bufs.rstd, el(acc), acc, c.rows) {
                    Ok(r) => self.check(&label, "fwd rstd", acc, &r, &reference.rstd),
                    Err(e) => self.fail(format!("{label}: fwd rstd {e}")),
                }
            }
        }

        // Backward, from the reference rstd rounded to the accumulation dtype.
        let rstd_in = rounded(acc, reference.rstd);
        put(&self.bufs.rstd, el(acc), &encode(acc, &rstd_in))?;
        let bref = backward_ref(&dy, &x, &rstd_in, w.as_deref(), c.rows, c.cols);
        let mut modes = vec![(true, wdt.is_some())];
        if c.partial_modes && wdt.is_some() {
            modes.extend([(true, false), (false, true)]);
        }
        for (want_dx, want_dw) in modes {
            let mode = format!("bwd[dx={want_dx} dw={want_dw}]");
            let ws_need = graft_cuda::rms_norm_backward_workspace_bytes_for(
                self.device,
                dt,
                c.rows,
                c.cols,
                want_dw,
            )?;
            let b = &self.bufs;
            let bwd = RmsNormBackward {
                device: self.device,
                stream: self.stream.handle(),
                dtype: dt,
                dy: b.dy.ptr() + el(dt) as u64,
                x: b.x.ptr() + el(dt) as u64,
                rstd: b.rstd.ptr() + el(acc) as u64,
                weight: wptr(b),
                dx: want_dx.then(|| b.dx.ptr() + el(dt) as u64),
                dw: want_dw.then(|| b.dw.ptr() + el(wdt.unwrap_or(dt)) as u64),
                workspace: b.ws.ptr(),
                workspace_bytes: ws_need.min(b.ws.len()),
                rows: c.rows,
                cols: c.cols,
                mode: WeightMode::default(),
            };
            let mut first: Option<(Vec<f64>, Vec<f64>)> = None;
            for run in 0..2 {
                if want_dx {
                    poison(&self.bufs.dx, el(dt), dt, n)?;
                }
                if let Some(d) = wdt.filter(|_| want_dw) {
                    poison(&self.bufs.dw, el(d), d, c.cols)?;
                }
                if let Err(e) = graft_cuda::rms_norm_backward_with(&bwd, &c.bwd_tuning) {
                    self.fail(format!("{label}: {mode} refused: {e}"));
                    break;
                }
                self.stream.synchronize()?;
                let mut dxv = Vec::new();
                let mut dwv = Vec::new();
                if want_dx {
                    match get(&self.bufs.dx, el(dt), dt, n) {
                        Ok(v) => dxv = v,
                        Err(e) => self.fail(format!("{label}: {mode} dx {e}")),
                    }
                }
                if let Some(d) = wdt.filter(|_| want_dw) {
                    match get(&self.bufs.dw, el(d), d, c.cols) {
                        Ok(v) => dwv = v,
                        Err(e) => self.fail(format!("{label}: {mode} dw {e}")),
                    }
                }
                if run == 0 {
                    if want_dx && !dxv.is_empty() {
                        self.check_scaled(&label, "bwd dx", dt, &dxv, &bref.dx, bref.dx_scale);
                    }
                    if let Some(d) = wdt.filter(|_| want_dw && !dwv.is_empty()) {
                        self.check_scaled(&label, "bwd dw", d, &dwv, &bref.dw, bref.dw_scale);
                    }
                    first = Some((dxv, dwv));
                } else if let Some((dx0, dw0)) = &first {
                    self.checks += 1;
                    let same = |a: &[f64], b: &[f64]| {
                        a.len() == b.len()
                            && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
                    };
                    if !same(dx0, &dxv) || !same(dw0, &dwv) {
                        self.fail(format!("{label}: {mode} is not bit-identical across runs"));
                    }
                }
            }
        }
        Ok(())
    }
}

fn sweep_cases(small: bool) -> Vec<Case> {
    let dtypes = [DType::F32, DType::F16, DType::BF16, DType::F64];
    let base = |dtype, w, rows, cols, offset| Case {
        dtype,
        w,
        rows,
        cols,
        offset,
        fwd_tuning: Tuning::default(),
        bwd_tuning: Tuning::default(),
        partial_modes: false,
    };
    let mut cases = Vec::new();
    let (all_cols, all_rows, max_elems): (&[usize], &[usize], usize) = if small {
        (&[1, 7, 1000, 4097], &[3, 17], 1 << 20)
    } else {
        (
            &[
                1, 7, 64, 1000, 1024, 2048, 4096, 4097, 5120, 8192, 16384, 65536,
            ],
            &[1, 3, 128, 4096],
            1 << 22,
        )
    };
    for &dtype in &dtypes {
        // (For f32/f64, `Acc` names the same dtype as `Same`: both spellings are tested.)
        for w in [WKind::None, WKind::Same, WKind::Acc] {
            for &cols in all_cols {
                for &rows in all_rows {
                    if rows * cols > max_elems {
                        continue;
                    }
                    let mut c = base(dtype, w, rows, cols, false);
                    c.partial_modes = rows <= 128 && (!small || cols == 1000);
                    cases.push(c);
                    if rows <= 128 {
                        cases.push(base(dtype, w, rows, cols, true));
                    }
                }
            }
        }
        // The loop kernels at small and odd sizes, and every rows-kernel V.
        for &(rows, cols) in &[(3usize, 7usize), (17, 1000), (5, 4096)] {
            for offset in [false, true] {
                let mut c = base(dtype, WKind::Same, rows, cols, offset);
                c.fwd_tuning.force_loop = true;
                c.bwd_tuning.force_loop = true;
                c.partial_modes = true;
                cases.push(c);
            }
        }
        if !small {
            // Rows of 512 16-byte units: every V fits (V=1 needs 512 threads per row).
            let cols = 512 * 16 / dtype.size();
            for v in [1u32, 2, 4, 8, 16] {
                for block in [None, Some(128), Some(512)] {
                    let mut c = base(dtype, WKind::Same, 64, cols, false);
                    c.fwd_tuning.units_per_thread = Some(v);
                    c.fwd_tuning.block_threads = block;
                    c.bwd_tuning.units_per_thread = Some(v.min(8));
                    c.bwd_tuning.block_threads = block;
                    cases.push(c);
                }
            }
            for bps in [1u32, 3] {
                let mut c = base(dtype, WKind::Same, 4096, 1024, false);
                c.fwd_tuning.blocks_per_sm = Some(bps);
                c.bwd_tuning.blocks_per_sm = Some(bps);
                cases.push(c);
            }
        }
    }
    if small {
        // A row longer than any rows kernel covers: the loop kernels, vector and scalar.
        for offset in [false, true] {
            cases.push(base(DType::BF16, WKind::Same, 2, 70_000, offset));
        }
    }
    cases
}

/// Inputs with NaN and Inf in some rows: they must propagate exactly as in float64.
fn special_values_case(s: &mut Sweep, dtype: DType, cols: usize) -> Result<(), CudaError> {
    let rows = 4;
    let n = rows * cols;
    let acc = dtype.acc();
    let mut x = rounded(dtype, (0..n).map(|_| s.rng.signed()).collect());
    x[cols + cols / 2] = f64::NAN;
    x[2 * cols + 1] = f64::INFINITY;
    let w = rounded(dtype, (0..cols).map(|_| 0.5 + s.rng.unit()).collect());
    let b = &s.bufs;
    put(&b.x, 0, &encode(dtype, &x))?;
    put(&b.w, 0, &encode(dtype, &w))?;
    poison(&b.y, 0, dtype, n)?;
    poison(&b.rstd, 0, acc, rows)?;
    let a = RmsNormForward {
        device: s.device,
        stream: s.stream.handle(),
        dtype,
        x: b.x.ptr(),
        weight: Weight::Same(b.w.ptr()),
        y: b.y.ptr(),
        rstd: b.rstd.ptr(),
        rows,
        cols,
        eps: s.eps,
        mode: WeightMode::default(),
    };
    let label = format!("{} nan/inf {}x{}", dtype_name(dtype), rows, cols);
    let reference = forward_ref(&x, Some(&w), rows, cols, s.eps);
    graft_cuda::rms_norm_forward(&a)?;
    s.stream.synchronize()?;
    match (get(&s.bufs.y, 0, dtype, n), get(&s.bufs.rstd, 0, acc, rows)) {
        (Ok(y), Ok(r)) => {
            s.check(&label, "fwd y", dtype, &y, &reference.y);
            s.check(&label, "fwd rstd", acc, &r, &reference.rstd);
            if !y[cols..2 * cols].iter().all(|v| v.is_nan()) {
                s.fail(format!("{label}: a NaN input did not make its row NaN"));
            }
        }
        (Err(e), _) | (_, Err(e)) => s.fail(format!("{label}: {e}")),
    }
    Ok(())
}

/// A short workspace is refused before launching.
fn workspace_check(s: &mut Sweep) -> Result<(), CudaError> {
    let (rows, cols) = (4096, 1024);
    let need =
        graft_cuda::rms_norm_backward_workspace_bytes_for(s.device, DType::BF16, rows, cols, true)?;
    let b = &s.bufs;
    let a = RmsNormBackward {
        device: s.device,
        stream: s.stream.handle(),
        dtype: DType::BF16,
        dy: b.dy.ptr(),
        x: b.x.ptr(),
        rstd: b.rstd.ptr(),
        weight: Weight::Same(b.w.ptr()),
        dx: Some(b.dx.ptr()),
        dw: Some(b.dw.ptr()),
        workspace: b.ws.ptr(),
        workspace_bytes: 1024,
        rows,
        cols,
        mode: WeightMode::default(),
    };
    s.checks += 1;
    let plan = graft_cuda::plan_backward(&a, &Tuning::default())?;
    match graft_cuda::rms_norm_backward(&a) {
        Err(e) if e.kind() == ErrorKind::InvalidArgument => {}
        other => s.fail(format!("short workspace not refused: {other:?}")),
    }
    if plan.workspace_bytes as usize > need {
        s.fail(format!(
            "plan needs {} workspace bytes but the _for bound says {need}",
            plan.workspace_bytes
        ));
    }
    Ok(())
}

fn correctness(dev: i32, small: bool, log: &mut Log) -> Result<Sweep, CudaError> {
    let cases = sweep_cases(small);
    let max_n = cases
        .iter()
        .map(|c| c.rows * c.cols)
        .max()
        .unwrap_or(1)
        .max(4096 * 1024);
    let max_cols = cases.iter().map(|c| c.cols).max().unwrap_or(1);
    let max_rows = cases.iter().map(|c| c.rows).max().unwrap_or(1);
    let mut ws = 0usize;
    for c in &cases {
        ws = ws.max(graft_cuda::rms_norm_backward_workspace_bytes(
            dev, c.rows, c.cols, true,
        )?);
    }
    let big = max_n * 8 + 64 + GUARD;
    let bufs = Bufs {
        x: DeviceBuffer::new(dev, big)?,
        y: DeviceBuffer::new(dev, big)?,
        dy: DeviceBuffer::new(dev, big)?,
        dx: DeviceBuffer::new(dev, big)?,
        w: DeviceBuffer::new(dev, max_cols * 8 + 64 + GUARD)?,
        dw: DeviceBuffer::new(dev, max_cols * 8 + 64 + GUARD)?,
        rstd: DeviceBuffer::new(dev, max_rows * 8 + 64 + GUARD)?,
        ws: DeviceBuffer::new(dev, ws.max(16))?,
    };
    let mut s = Sweep {
        device: dev,
        stream: Stream::new(dev)?,
        bufs,
        rng: Rng(0x5EED_6AF7),
        eps: 1e-6,
        checks: 0,
        failures: Vec::new(),
        worst: Vec::new(),
    };
    let t0 = Instant::now();
    log.line(format!("correctness: {} cases", cases.len()));
    for c in &cases {
        s.run(c)?;
    }
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        for cols in [1000, 4097] {
            special_values_case(&mut s, dtype, cols)?;
        }
    }
    workspace_check(&mut s)?;
    log.line(format!(
        "correctness: {} checks, {} failures, {:.1} s",
        s.checks,
        s.failures.len(),
        t0.elapsed().as_secs_f64()
    ));
    for (what, err, tol, case) in &s.worst {
        log.line(format!(
            "  worst {what:<18} rel err {err:.2e} (tol {tol:.0e}) at {case}"
        ));
    }
    for f in &s.failures {
        log.line(format!("  FAIL {f}"));
    }
    Ok(s)
}

// ---------------------------------------------------------------------------------------
// Timing.

const SETS: usize = 3;

struct TimedSets {
    x: Vec<DeviceBuffer>,
    y: Vec<DeviceBuffer>,
    dy: Vec<DeviceBuffer>,
    dx: Vec<DeviceBuffer>,
    rstd: Vec<DeviceBuffer>,
    w: DeviceBuffer,
    dw: DeviceBuffer,
    ws: DeviceBuffer,
}

#[derive(Clone, Debug)]
struct Timing {
    shape: String,
    op: String,
    config: String,
    median_us: f64,
    min_us: f64,
    bytes: f64,
}

/// Median and minimum microseconds of `reps` timed calls of `f(i)` after `warmup`.
fn time_it(
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

fn fill_random(rng: &mut Rng, n: usize) -> Vec<u8> {
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

fn plan_text(p: &Plan) -> String {
    let k = p.kernel_name();
    let short = k.trim_start_matches("graft_rms_");
    format!(
        "{short} tpr{} rpb{} blk{} grid{}",
        p.threads_per_row, p.rows_per_block, p.block, p.grid
    )
}

fn timings(
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
fn copy_ratio(t: &[Timing], r: &Timing) -> f64 {
    let copy = t.iter().find(|c| c.shape == r.shape && c.op == "copy");
    copy.map_or(f64::NAN, |c| {
        r.median_us / (c.median_us * r.bytes / c.bytes)
    })
}

fn print_table(log: &mut Log, t: &[Timing], shapes: &[String]) {
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

fn json_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn write_outputs(dir: &str, log: &Log, sweep: Option<&Sweep>, t: &[Timing]) {
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
