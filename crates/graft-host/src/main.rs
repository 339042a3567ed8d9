//! torchgraft-host: a program with no Python that loads libtorch from an installed torch wheel,
//! loads libtorchgraft, enables the native grafts, calls aten::_fused_rms_norm and its backward
//! through the dispatcher, and checks the results against a float64 reference.
//!
//! ```text
//! torchgraft-host --torch-lib <site-packages>/torch/lib --graft-lib target/release/libtorchgraft.so [--device cpu|cuda]
//! ```
//! Exits 0 when every case matches and every call reached a torchgraft kernel.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::PathBuf;
use std::process::ExitCode;

use graft_abi::{dispatch, DType, Device, DeviceType, NewTensor, Tensor};
use libloading::os::unix::{Library, Symbol};

struct Options {
    torch_lib: PathBuf,
    graft_lib: PathBuf,
    device: Device,
}

fn parse_options() -> Result<Options, String> {
    let mut args = std::env::args().skip(1);
    let (mut torch_lib, mut graft_lib, mut device) = (None, None, Device::CPU);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--torch-lib" => torch_lib = Some(PathBuf::from(value()?)),
            "--graft-lib" => graft_lib = Some(PathBuf::from(value()?)),
            "--device" => {
                device = match value()?.as_str() {
                    "cpu" => Device::CPU,
                    "cuda" => Device {
                        kind: DeviceType::CUDA,
                        index: 0,
                    },
                    other => return Err(format!("unknown device {other}: use cpu or cuda")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Options {
        torch_lib: torch_lib.ok_or("--torch-lib <dir of libtorch.so> is required")?,
        graft_lib: graft_lib.ok_or("--graft-lib <path of libtorchgraft.so> is required")?,
        device,
    })
}

/// libtorchgraft's C API.
struct Grafts {
    _lib: Library,
    enable: unsafe extern "C" fn() -> c_int,
    calls: unsafe extern "C" fn(*const c_char, *const c_char) -> i64,
    cuda_status: unsafe extern "C" fn(*mut i64) -> c_int,
    last_error: unsafe extern "C" fn() -> *const c_char,
}

impl Grafts {
    fn load(path: &PathBuf) -> Result<Grafts, String> {
        // SAFETY: loading libtorchgraft runs no initialisers beyond Rust's static setup.
        let lib = unsafe { Library::open(Some(path), libc::RTLD_NOW) }
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        fn get<T: Copy>(lib: &Library, name: &[u8]) -> Result<T, String> {
            // SAFETY: the types match include/torchgraft.h.
            let symbol: Result<Symbol<T>, _> = unsafe { lib.get(name) };
            symbol.map(|s| *s).map_err(|e| e.to_string())
        }
        Ok(Grafts {
            enable: get(&lib, b"torchgraft_enable")?,
            calls: get(&lib, b"torchgraft_calls")?,
            cuda_status: get(&lib, b"torchgraft_cuda_status")?,
            last_error: get(&lib, b"torchgraft_last_error")?,
            _lib: lib,
        })
    }

    fn enable(&self) -> Result<(), String> {
        // SAFETY: C API call with no arguments.
        let status = unsafe { (self.enable)() };
        self.result(status)
    }

    /// Number of GPUs the CUDA grafts can use, or why they are off.
    fn cuda_status(&self) -> Result<i64, String> {
        let mut devices = 0i64;
        // SAFETY: `devices` is a valid out-pointer.
        let status = unsafe { (self.cuda_status)(&mut devices) };
        self.result(status).map(|()| devices)
    }

    fn result(&self, status: c_int) -> Result<(), String> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: torchgraft_last_error returns a valid NUL-terminated string.
        let message = unsafe { CStr::from_ptr((self.last_error)()) };
        Err(message.to_string_lossy().into_owned())
    }

    fn calls(&self, op: &str, key: &str) -> i64 {
        let (op, key) = (
            CString::new(op).unwrap_or_default(),
            CString::new(key).unwrap_or_default(),
        );
        // SAFETY: both are NUL-terminated strings alive for the call.
        unsafe { (self.calls)(op.as_ptr(), key.as_ptr()) }
    }
}

/// xorshift64* with a Box-Muller normal: inputs differ on every run (the seed is printed).
struct Random(u64);

impl Random {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

type Checked<T> = Result<T, String>;

fn abi<T>(r: graft_abi::Result<T>) -> Checked<T> {
    r.map_err(|e| e.to_string())
}

/// A tensor of random normal values in `dtype` on `device`.
fn random_tensor(rng: &mut Random, sizes: &[i64], dtype: DType, device: Device) -> Checked<Tensor> {
    let mut host = abi(NewTensor::empty(sizes, DType::F64, Device::CPU))?;
    abi(host.as_mut_slice::<f64>())?
        .iter_mut()
        .for_each(|v| *v = rng.normal());
    let out = abi(NewTensor::empty(sizes, dtype, device))?.finish();
    abi(out.copy_from(&host.finish()))?;
    Ok(out)
}

/// The values of any tensor as float64 on the host.
fn host_values(t: &Tensor) -> Checked<Vec<f64>> {
    let host = abi(NewTensor::empty(abi(t.sizes())?, DType::F64, Device::CPU))?.finish();
    abi(host.copy_from(t))?;
    Ok(abi(host.as_slice::<f64>())?.to_vec())
}

fn rel_err(out: &[f64], reference: &[f64]) -> f64 {
    let diff: f64 = out
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).powi(2))
        .sum();
    let norm: f64 = reference.iter().map(|b| b * b).sum();
    (diff / norm.max(1e-300)).sqrt()
}

struct Case {
    sizes: Vec<i64>,
    normalized: usize,
    dtype: DType,
    weight: bool,
    eps: Option<f64>,
}

fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 4e-3,
        _ => 2e-2,
    }
}

/// Runs one case forward and backward; returns the largest relative error.
fn run_case(rng: &mut Random, case: &Case, device: Device) -> Checked<f64> {
    let ns = &case.sizes[case.sizes.len() - case.normalized..];
    let cols: i64 = ns.iter().product();
    let rows = case.sizes.iter().product::<i64>() / cols;
    let (cols, rows) = (cols as usize, rows as usize);
    let x = random_tensor(rng, &case.sizes, case.dtype, device)?;
    let dy = random_tensor(rng, &case.sizes, case.dtype, device)?;
    let w = case
        .weight
        .then(|| random_tensor(rng, ns, case.dtype, device))
        .transpose()?;

    let (y, rstd): (Tensor, Tensor) = abi(dispatch::call(
        c"aten::_fused_rms_norm",
        c"",
        (&x, ns, w.as_ref(), case.eps),
    ))?;
    let (dx, dw): (Tensor, Tensor) = abi(dispatch::call(
        c"aten::_fused_rms_norm_backward",
        c"",
        (&dy, &x, ns, &rstd, w.as_ref(), &[true, true][..]),
    ))?;

    // float64 reference from the same (rounded) inputs.
    let (xv, dyv) = (host_values(&x)?, host_values(&dy)?);
    let wv = w
        .as_ref()
        .map(host_values)
        .transpose()?
        .unwrap_or_else(|| vec![1.0; cols]);
    let acc_eps = if case.dtype == DType::F64 {
        f64::EPSILON
    } else {
        f64::from(f32::EPSILON)
    };
    let eps = case.eps.unwrap_or(acc_eps);
    let (mut y_ref, mut rstd_ref, mut dx_ref, mut dw_ref) = (
        vec![0.0; rows * cols],
        vec![0.0; rows],
        vec![0.0; rows * cols],
        vec![0.0; cols],
    );
    for r in 0..rows {
        let row = &xv[r * cols..(r + 1) * cols];
        let rs = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + eps).sqrt();
        rstd_ref[r] = rs;
        let mut dot = 0.0;
        for c in 0..cols {
            y_ref[r * cols + c] = row[c] * rs * wv[c];
            dot += dyv[r * cols + c] * wv[c] * row[c] * rs;
        }
        for c in 0..cols {
            let xhat = row[c] * rs;
            dx_ref[r * cols + c] = rs * (dyv[r * cols + c] * wv[c] - xhat * dot / cols as f64);
            dw_ref[c] += dyv[r * cols + c] * xhat;
        }
    }
    let mut worst = [
        rel_err(&host_values(&y)?, &y_ref),
        rel_err(&host_values(&rstd)?, &rstd_ref),
        rel_err(&host_values(&dx)?, &dx_ref),
    ]
    .into_iter()
    .fold(0.0, f64::max);
    if case.weight {
        worst = worst.max(rel_err(&host_values(&dw)?, &dw_ref));
    } else if abi(dw.is_defined())? {
        return Err("dw must be undefined without a weight".into());
    }
    Ok(worst)
}

fn run(options: &Options) -> Checked<()> {
    let libtorch = options.torch_lib.join("libtorch.so");
    // SAFETY: loading libtorch runs its static initialisers (operator registration), which is what
    // a host program does; RTLD_GLOBAL lets libtorchgraft find it with RTLD_NOLOAD.
    let _torch = unsafe { Library::open(Some(&libtorch), libc::RTLD_NOW | libc::RTLD_GLOBAL) }
        .map_err(|e| format!("cannot load {}: {e}", libtorch.display()))?;
    let grafts = Grafts::load(&options.graft_lib)?;
    grafts.enable()?;
    abi(graft_abi::load())?;

    let key = if options.device.kind == DeviceType::CUDA {
        let devices = grafts
            .cuda_status()
            .map_err(|why| format!("no CUDA grafts: {why}"))?;
        println!("torchgraft-host: CUDA grafts on {devices} GPU(s)");
        "CUDA"
    } else {
        "CPU"
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0x5EED, |d| d.as_nanos() as u64)
        | 1;
    println!("torchgraft-host: device {}, seed {seed:#x}", options.device);
    let mut rng = Random(seed);
    let mut failures = 0;
    let shapes: [(&[i64], usize); 4] = [
        (&[2, 3, 64], 1),
        (&[5, 4097], 1),
        (&[4, 6, 10], 2),
        (&[3, 1000], 1),
    ];
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for (sizes, normalized) in shapes {
            for (weight, eps) in [(true, Some(1e-5)), (false, None)] {
                let case = Case {
                    sizes: sizes.to_vec(),
                    normalized,
                    dtype,
                    weight,
                    eps,
                };
                let before = (
                    grafts.calls("aten::_fused_rms_norm", key),
                    grafts.calls("aten::_fused_rms_norm_backward", key),
                );
                let outcome = run_case(&mut rng, &case, options.device);
                let after = (
                    grafts.calls("aten::_fused_rms_norm", key),
                    grafts.calls("aten::_fused_rms_norm_backward", key),
                );
                let grafted = after.0 == before.0 + 1 && after.1 == before.1 + 1;
                let verdict = match &outcome {
                    Ok(err) if *err <= tolerance(dtype) && grafted => "ok",
                    _ => {
                        failures += 1;
                        "FAIL"
                    }
                };
                println!(
                    "{verdict:4} {dtype:8} {sizes:?} normalized={normalized} weight={weight} \
                     eps={eps:?}: {} (torchgraft {key} kernels ran: {grafted})",
                    match outcome {
                        Ok(err) => format!("max rel err {err:.2e}"),
                        Err(e) => format!("error: {e}"),
                    }
                );
            }
        }
    }
    if failures > 0 {
        return Err(format!("{failures} case(s) failed"));
    }
    println!("torchgraft-host: all cases passed on {}", options.device);
    Ok(())
}

fn main() -> ExitCode {
    match parse_options().and_then(|options| run(&options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("torchgraft-host: {e}");
            ExitCode::FAILURE
        }
    }
}
