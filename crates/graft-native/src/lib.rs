//! torchgraft's native grafts: kernels in Rust (CPU) and CUDA C++ registered for aten operators
//! through PyTorch's stable C ABI, with no Python on the call path.
//!
//! [`enable`] registers every graft this process can run, [`disable`] removes them (the kernels
//! that were there before come back), [`grafts`] reports them with their call counts.

pub mod adam;
mod layout;
pub mod ops;
pub mod rms_norm;
mod stats;
mod threads;

use std::sync::{Mutex, MutexGuard};

use graft_abi::{Library, Result};

pub use stats::Counters;

/// One native graft: an operator at a dispatch key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraftInfo {
    /// Qualified operator name, e.g. `aten::_fused_rms_norm`.
    pub op: &'static str,
    /// Dispatch key, e.g. `CPU`.
    pub dispatch_key: &'static str,
    /// Whether it is registered now.
    pub active: bool,
    /// Calls since the last reset.
    pub calls: u64,
    /// Calls computed by a slower general path instead of the fused kernel.
    pub fallbacks: u64,
}

struct Graft {
    op: &'static str,
    dispatch_key: &'static str,
    counters: &'static Counters,
}

const GRAFTS: [Graft; 12] = [
    Graft {
        op: "aten::_fused_rms_norm",
        dispatch_key: "CPU",
        counters: &rms_norm::cpu::FORWARD,
    },
    Graft {
        op: "aten::_fused_rms_norm_backward",
        dispatch_key: "CPU",
        counters: &rms_norm::cpu::BACKWARD,
    },
    Graft {
        op: "aten::_fused_rms_norm",
        dispatch_key: "CUDA",
        counters: &rms_norm::cuda::FORWARD,
    },
    Graft {
        op: "aten::_fused_rms_norm_backward",
        dispatch_key: "CUDA",
        counters: &rms_norm::cuda::BACKWARD,
    },
    Graft {
        op: "aten::_fused_adamw_",
        dispatch_key: "CPU",
        counters: &adam::cpu::ADAMW,
    },
    Graft {
        op: "aten::_fused_adamw_.tensor_lr",
        dispatch_key: "CPU",
        counters: &adam::cpu::ADAMW_TENSOR_LR,
    },
    Graft {
        op: "aten::_fused_adam_",
        dispatch_key: "CPU",
        counters: &adam::cpu::ADAM,
    },
    Graft {
        op: "aten::_fused_adam_.tensor_lr",
        dispatch_key: "CPU",
        counters: &adam::cpu::ADAM_TENSOR_LR,
    },
    Graft {
        op: "aten::_fused_adamw_",
        dispatch_key: "CUDA",
        counters: &adam::cuda::ADAMW,
    },
    Graft {
        op: "aten::_fused_adamw_.tensor_lr",
        dispatch_key: "CUDA",
        counters: &adam::cuda::ADAMW_TENSOR_LR,
    },
    Graft {
        op: "aten::_fused_adam_",
        dispatch_key: "CUDA",
        counters: &adam::cuda::ADAM,
    },
    Graft {
        op: "aten::_fused_adam_.tensor_lr",
        dispatch_key: "CUDA",
        counters: &adam::cuda::ADAM_TENSOR_LR,
    },
];

/// The libraries holding our registrations, by dispatch key, while enabled.
static INSTALLED: Mutex<Option<Vec<(&'static str, Library)>>> = Mutex::new(None);

fn installed() -> MutexGuard<'static, Option<Vec<(&'static str, Library)>>> {
    INSTALLED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers the native grafts (idempotent): at CPU always, at CUDA when [`cuda_status`] is Ok.
/// Needs libtorch loaded in the process.
pub fn enable() -> Result<()> {
    let mut installed = installed();
    if installed.is_some() {
        return Ok(());
    }
    graft_abi::load()?;
    let mut cpu = Library::implementations(c"aten", c"CPU")?;
    cpu.register::<rms_norm::cpu::ForwardCpu>(c"_fused_rms_norm")?;
    cpu.register::<rms_norm::cpu::BackwardCpu>(c"_fused_rms_norm_backward")?;
    adam::register::<adam::cpu::Cpu>(&mut cpu)?;
    let mut libraries = vec![("CPU", cpu)];
    if cuda_status().is_ok() {
        let mut cuda = Library::implementations(c"aten", c"CUDA")?;
        cuda.register::<rms_norm::cuda::ForwardCuda>(c"_fused_rms_norm")?;
        cuda.register::<rms_norm::cuda::BackwardCuda>(c"_fused_rms_norm_backward")?;
        adam::register::<adam::cuda::Cuda>(&mut cuda)?;
        libraries.push(("CUDA", cuda));
    }
    *installed = Some(libraries);
    Ok(())
}

/// Removes the native grafts, restoring the kernels that were there before (idempotent).
pub fn disable() {
    // Dropping the libraries deregisters their kernels.
    installed().take();
}

/// Whether the native grafts are registered.
pub fn is_enabled() -> bool {
    installed().is_some()
}

/// Whether the CUDA grafts can be registered in this process: Ok(number of GPUs), or why not.
pub fn cuda_status() -> std::result::Result<usize, String> {
    if !graft_cuda::kernels_built() {
        return Err("this build has no CUDA kernels (nvcc was not found when it was built)".into());
    }
    if !graft_abi::cuda::torch_has_cuda() {
        return Err("this torch has no CUDA support loaded".into());
    }
    match graft_cuda::device_count() {
        Ok(0) => Err("the CUDA driver sees no GPU".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no CUDA driver: {e}")),
    }
}

/// Every native graft this build has, with its state and counters (torchgraft's own operators'
/// kernels are in [`ops::kernels`]).
pub fn grafts() -> Vec<GraftInfo> {
    let installed = installed();
    let keys: Vec<&str> = installed.iter().flatten().map(|(key, _)| *key).collect();
    GRAFTS
        .iter()
        .map(|g| {
            let (calls, fallbacks) = g.counters.read();
            let active = keys.contains(&g.dispatch_key);
            GraftInfo {
                op: g.op,
                dispatch_key: g.dispatch_key,
                active,
                calls,
                fallbacks,
            }
        })
        .collect()
}

/// Zeroes every graft's counters.
pub fn reset_stats() {
    GRAFTS.iter().for_each(|g| g.counters.reset());
    ops::reset_stats();
}
