//! torchgraft's native grafts: kernels in Rust (CPU) and CUDA C++ registered for aten operators
//! through PyTorch's stable C ABI, with no Python on the call path.
//!
//! [`enable`] registers every graft this process can run, [`disable`] removes them (the kernels
//! that were there before come back), [`grafts`] reports them with their call counts.

pub mod adam;
pub mod layer_norm;
mod layout;
pub mod ops;
pub mod rms_norm;
pub mod softmax;
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
    holder: Holder,
}

/// Which registration holds a graft, and so when it is active.
#[derive(Clone, Copy)]
enum Holder {
    /// Registered by [`enable`], removed by [`disable`].
    Cpu,
    /// Registered by the first [`enable`], kept for good ([`CPU_BACKWARD`]).
    CpuKept,
    /// Registered by [`enable`] when the CUDA grafts can run, removed by [`disable`].
    Cuda,
}

const GRAFTS: [Graft; 24] = [
    Graft {
        op: "aten::_fused_rms_norm",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &rms_norm::cpu::FORWARD,
    },
    Graft {
        op: "aten::_fused_rms_norm_backward",
        dispatch_key: "CPU",
        holder: Holder::CpuKept,
        counters: &rms_norm::cpu::BACKWARD,
    },
    Graft {
        op: "aten::_fused_rms_norm",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &rms_norm::cuda::FORWARD,
    },
    Graft {
        op: "aten::_fused_rms_norm_backward",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &rms_norm::cuda::BACKWARD,
    },
    Graft {
        op: "aten::_fused_adamw_",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAMW,
    },
    Graft {
        op: "aten::_fused_adamw_.tensor_lr",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAMW_TENSOR_LR,
    },
    Graft {
        op: "aten::_fused_adam_",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAM,
    },
    Graft {
        op: "aten::_fused_adam_.tensor_lr",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAM_TENSOR_LR,
    },
    Graft {
        op: "aten::_fused_adamw_",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAMW,
    },
    Graft {
        op: "aten::_fused_adamw_.tensor_lr",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAMW_TENSOR_LR,
    },
    Graft {
        op: "aten::_fused_adam_",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAM,
    },
    Graft {
        op: "aten::_fused_adam_.tensor_lr",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAM_TENSOR_LR,
    },
    Graft {
        op: "aten::_softmax",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::SOFTMAX,
    },
    Graft {
        op: "aten::_log_softmax",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::LOG_SOFTMAX,
    },
    Graft {
        op: "aten::_softmax_backward_data",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::SOFTMAX_BACKWARD,
    },
    Graft {
        op: "aten::_log_softmax_backward_data",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::LOG_SOFTMAX_BACKWARD,
    },
    Graft {
        op: "aten::_softmax",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::SOFTMAX,
    },
    Graft {
        op: "aten::_log_softmax",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::LOG_SOFTMAX,
    },
    Graft {
        op: "aten::_softmax_backward_data",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::SOFTMAX_BACKWARD,
    },
    Graft {
        op: "aten::_log_softmax_backward_data",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::LOG_SOFTMAX_BACKWARD,
    },
    Graft {
        op: "aten::native_layer_norm",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &layer_norm::cpu::FORWARD,
    },
    Graft {
        op: "aten::native_layer_norm_backward",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &layer_norm::cpu::BACKWARD,
    },
    Graft {
        op: "aten::native_layer_norm",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &layer_norm::cuda::FORWARD,
    },
    Graft {
        op: "aten::native_layer_norm_backward",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &layer_norm::cuda::BACKWARD,
    },
];

/// The registrations that [`enable`] makes and [`disable`] removes.
struct Installed {
    /// The CPU forward (held: dropping it deregisters it).
    _cpu: Library,
    /// Both CUDA ops, when the CUDA grafts could be registered.
    cuda: Option<Library>,
}

/// The grafts [`enable`] installed, while enabled.
static INSTALLED: Mutex<Option<Installed>> = Mutex::new(None);

/// The CPU backward, registered by the first successful [`enable`] and never removed.
///
/// A graph recorded while enabled (an autograd graph, an `aot_eager` graph) calls
/// `aten::_fused_rms_norm_backward` at CPU whenever its backward runs, perhaps after [`disable`].
/// Stock PyTorch has no CPU kernel for that op (its CPU forward is a composite that autograd
/// differentiates op by op), so keeping ours changes no call that stock can run: it only keeps
/// such graphs working. On CUDA nothing needs keeping: ATen's own CUDA backward takes the saved
/// tensors of our forward (same rstd dtype and shape) after [`disable`].
static CPU_BACKWARD: Mutex<Option<Library>> = Mutex::new(None);

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers the native grafts (idempotent): at CPU always, at CUDA when [`cuda_status`] is Ok.
/// Needs libtorch loaded in the process. All or nothing: on an error nothing new stays
/// registered.
pub fn enable() -> Result<()> {
    let mut installed = lock(&INSTALLED);
    if installed.is_some() {
        return Ok(());
    }
    graft_abi::load()?;
    // Every registration is owned by a local until all have succeeded: an early return drops
    // (and so deregisters) those made so far.
    let mut cpu = Library::implementations(c"aten", c"CPU")?;
    cpu.register::<rms_norm::cpu::ForwardCpu>(c"_fused_rms_norm")?;
    adam::register::<adam::cpu::Cpu>(&mut cpu)?;
    softmax::cpu::register(&mut cpu)?;
    layer_norm::cpu::register(&mut cpu)?;
    let cuda = if cuda_status().is_ok() {
        let mut cuda = Library::implementations(c"aten", c"CUDA")?;
        cuda.register::<rms_norm::cuda::ForwardCuda>(c"_fused_rms_norm")?;
        cuda.register::<rms_norm::cuda::BackwardCuda>(c"_fused_rms_norm_backward")?;
        adam::register::<adam::cuda::Cuda>(&mut cuda)?;
        layer_norm::cuda::register(&mut cuda)?;
        softmax::cuda::register(&mut cuda)?;
        Some(cuda)
    } else {
        None
    };
    let mut backward = lock(&CPU_BACKWARD);
    if backward.is_none() {
        let mut lib = Library::implementations(c"aten", c"CPU")?;
        lib.register::<rms_norm::cpu::BackwardCpu>(c"_fused_rms_norm_backward")?;
        *backward = Some(lib);
    }
    *installed = Some(Installed { _cpu: cpu, cuda });
    Ok(())
}

/// Removes the native grafts, restoring the kernels that were there before (idempotent), except
/// the CPU backward, which stock PyTorch lacks and which graphs recorded while enabled still call
/// (see [`CPU_BACKWARD`]).
pub fn disable() {
    // Dropping the libraries deregisters their kernels.
    lock(&INSTALLED).take();
}

/// Whether the native grafts are registered.
pub fn is_enabled() -> bool {
    lock(&INSTALLED).is_some()
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
    let installed = lock(&INSTALLED);
    let backward_kept = lock(&CPU_BACKWARD).is_some();
    GRAFTS
        .iter()
        .map(|g| {
            let (calls, fallbacks) = g.counters.read();
            let active = match g.holder {
                Holder::Cpu => installed.is_some(),
                Holder::CpuKept => backward_kept,
                Holder::Cuda => installed.as_ref().is_some_and(|i| i.cuda.is_some()),
            };
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
