//! The correctness sweep: device buffers, cases, checks.

use super::*;

// Device buffers for the sweep, and one test case.

pub(super) const GUARD: usize = 256;
pub(super) const GUARD_BYTE: u8 = 0xA5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WKind {
    None,
    Same,
    Acc,
}

impl WKind {
    pub(super) fn name(self) -> &'static str {
        match self {
            WKind::None => "none",
            WKind::Same => "same",
            WKind::Acc => "acc",
        }
    }
    pub(super) fn weight(self, p: u64) -> Weight {
        match self {
            WKind::None => Weight::None,
            WKind::Same => Weight::Same(p),
            WKind::Acc => Weight::Acc(p),
        }
    }
    pub(super) fn dtype(self, d: DType) -> Option<DType> {
        self.weight(1).dtype(d)
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Case {
    pub(super) dtype: DType,
    pub(super) w: WKind,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Offset every pointer by one element (misaligns the 16-byte vectors).
    pub(super) offset: bool,
    /// Launch overrides of the forward and the backward (their V ranges differ).
    pub(super) fwd_tuning: Tuning,
    pub(super) bwd_tuning: Tuning,
    /// Also run the dx-only and dw-only backward.
    pub(super) partial_modes: bool,
}

impl Case {
    pub(super) fn label(&self) -> String {
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

pub(super) fn tuning_text(t: &Tuning) -> String {
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

pub(super) struct Bufs {
    pub(super) x: DeviceBuffer,
    pub(super) y: DeviceBuffer,
    pub(super) dy: DeviceBuffer,
    pub(super) dx: DeviceBuffer,
    pub(super) w: DeviceBuffer,
    pub(super) dw: DeviceBuffer,
    pub(super) rstd: DeviceBuffer,
    pub(super) ws: DeviceBuffer,
}

pub(super) struct Sweep {
    pub(super) device: i32,
    pub(super) stream: Stream,
    pub(super) bufs: Bufs,
    pub(super) rng: Rng,
    pub(super) eps: f64,
    pub(super) checks: usize,
    pub(super) failures: Vec<String>,
    /// (output and dtype, worst error, tolerance, case)
    pub(super) worst: Vec<(String, f64, f64, String)>,
}

/// Uploads `data` at `off` into `buf`, followed by guard bytes.
pub(super) fn put(buf: &DeviceBuffer, off: usize, data: &[u8]) -> Result<(), CudaError> {
    let mut v = data.to_vec();
    v.extend(std::iter::repeat_n(GUARD_BYTE, GUARD));
    buf.upload(off, &v)
}

/// Fills `n` elements at `off` with NaN of `dtype`, followed by guard bytes.
pub(super) fn poison(
    buf: &DeviceBuffer,
    off: usize,
    dtype: DType,
    n: usize,
) -> Result<(), CudaError> {
    put(buf, off, &nan_bytes(dtype).repeat(n))
}

/// Downloads `n` elements of `dtype` at `off`; `Err` text if the guard after them changed.
pub(super) fn get(
    buf: &DeviceBuffer,
    off: usize,
    dtype: DType,
    n: usize,
) -> Result<Vec<f64>, String> {
    let mut v = vec![0u8; n * dtype.size() + GUARD];
    buf.download(off, &mut v).map_err(|e| e.to_string())?;
    if v[n * dtype.size()..].iter().any(|&b| b != GUARD_BYTE) {
        return Err("wrote past the end of its output".into());
    }
    v.truncate(n * dtype.size());
    Ok(decode(dtype, &v))
}

impl Sweep {
    pub(super) fn fail(&mut self, what: String) {
        println!("FAIL {what}");
        self.failures.push(what);
    }

    /// Compares one output; records the worst error per (dtype, output).
    pub(super) fn check(
        &mut self,
        label: &str,
        what: &str,
        dtype: DType,
        out: &[f64],
        reference: &[f64],
    ) {
        self.check_scaled(label, what, dtype, out, reference, 0.0);
    }

    pub(super) fn check_scaled(
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
    pub(super) fn run(&mut self, c: &Case) -> Result<(), CudaError> {
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

pub(super) fn sweep_cases(small: bool) -> Vec<Case> {
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
pub(super) fn special_values_case(
    s: &mut Sweep,
    dtype: DType,
    cols: usize,
) -> Result<(), CudaError> {
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
pub(super) fn workspace_check(s: &mut Sweep) -> Result<(), CudaError> {
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

pub(super) fn correctness(dev: i32, small: bool, log: &mut Log) -> Result<Sweep, CudaError> {
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
