//! `torchgraft._native`: the Python face of the native grafts. Python calls into it only to
//! enable, disable and inspect; the grafts themselves run without Python.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Registers the native grafts with the dispatcher, except those of the ops named in `disabled`
/// (bare symbols: `_fused_rms_norm`, `_fused_adam_.tensor_lr`). Idempotent; called again with
/// other ops left out, it registers the grafts again without them. `import torch` must come
/// first.
#[pyfunction]
#[pyo3(signature = (disabled = Vec::new()))]
fn enable(disabled: Vec<String>) -> PyResult<()> {
    let disabled: Vec<&str> = disabled.iter().map(String::as_str).collect();
    graft_native::enable_except(&disabled).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// Removes the native grafts, restoring the kernels that were there before (idempotent).
#[pyfunction]
fn disable() {
    graft_native::disable();
}

/// Whether the native grafts are registered.
#[pyfunction]
fn is_enabled() -> bool {
    graft_native::is_enabled()
}

/// Every native graft this build has: dicts with op, dispatch_key, active, calls, fallbacks.
#[pyfunction]
fn grafts(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    infos_to_dicts(py, graft_native::grafts())
}

/// The kernels of torchgraft's own operators (`torchgraft::*`), as [`grafts`] describes grafts
/// (`active`: defined in this process).
#[pyfunction]
fn op_kernels(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    infos_to_dicts(py, graft_native::ops::kernels())
}

fn infos_to_dicts(
    py: Python<'_>,
    infos: Vec<graft_native::GraftInfo>,
) -> PyResult<Vec<Bound<'_, PyDict>>> {
    infos
        .into_iter()
        .map(|g| {
            let d = PyDict::new(py);
            d.set_item("op", g.op)?;
            d.set_item("dispatch_key", g.dispatch_key)?;
            d.set_item("active", g.active)?;
            d.set_item("calls", g.calls)?;
            d.set_item("fallbacks", g.fallbacks)?;
            Ok(d)
        })
        .collect()
}

/// What this build has and what it found in this process: version, whether CUDA kernels were
/// compiled in, and the CUDA grafts' status (number of GPUs, or why they are off).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("torch_abi", "stable C ABI, torch >= 2.11")?;
    d.set_item("cuda_kernels_built", graft_cuda::kernels_built())?;
    match graft_native::cuda_status() {
        Ok(devices) => d.set_item("cuda_devices", devices)?,
        Err(why) => d.set_item("cuda_devices", why)?,
    }
    Ok(d)
}

/// Defines torchgraft's own operators (`torch.ops.torchgraft.*`) with their CPU and CUDA
/// kernels (idempotent; they stay for the life of the process). `import torch` must come first.
#[pyfunction]
fn define_ops() -> PyResult<()> {
    graft_native::ops::define().map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// Zeroes the native grafts' counters.
#[pyfunction]
fn reset_stats() {
    graft_native::reset_stats();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(enable, m)?)?;
    m.add_function(wrap_pyfunction!(disable, m)?)?;
    m.add_function(wrap_pyfunction!(is_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(grafts, m)?)?;
    m.add_function(wrap_pyfunction!(op_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(reset_stats, m)?)?;
    m.add_function(wrap_pyfunction!(define_ops, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    Ok(())
}
