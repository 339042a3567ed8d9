//! torchgraft's native grafts: kernels in Rust (CPU) and CUDA C++ registered for aten operators
//! through PyTorch's stable C ABI, with no Python on the call path.
//!
//! [`enable`] registers every graft this process can run, [`disable`] removes them (the kernels
//! that were there before come back), [`grafts`] reports them with their call counts.
//!
//! Layout: [`grafts`]`/<aten op>/` holds the aten grafts, listed one row per (op, key) in
//! `GRAFTS` below; [`ops`]`/<op>/` holds torchgraft's own operators, listed in `ops::OPS`;
//! `common/` holds what both use and imports neither. Ops never import grafts (docs/adding-an-op.md).

mod common;
pub mod grafts;
pub mod ops;

use std::collections::BTreeSet;
use std::ffi::{CStr, CString};
use std::sync::{Mutex, MutexGuard};

use graft_abi::{Library, Result, Tensor};

pub use common::cuda::cuda_status;
pub use common::stats::{Counters, GraftInfo};
use grafts::{adam, layer_norm, rms_norm, softmax};

struct Graft {
    op: &'static str,
    dispatch_key: &'static str,
    counters: &'static Counters,
    holder: Holder,
    /// Registers this graft's kernel alone, under the op's name.
    kernel: fn(&mut Library, &CStr) -> Result<()>,
    /// The module function that registers this graft together with the others of its group.
    group: Option<Group>,
}

/// Which registration holds a graft, and so when it is active.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// Registered by [`enable`], removed by [`disable`].
    Cpu,
    /// Registered by the first [`enable`], kept for good ([`CPU_BACKWARD`]); no op filter
    /// reaches it.
    CpuKept,
    /// Registered by [`enable`] when the CUDA grafts can run, removed by [`disable`].
    Cuda,
}

/// Grafts that a kernel module registers together, with one function. [`enable`] calls it when
/// every graft of the group is wanted (the function may do more than register: softmax's CUDA
/// one reads its tuning variable), and registers the wanted ones one by one otherwise.
#[derive(Clone, Copy)]
struct Group {
    name: &'static str,
    register: fn(&mut Library) -> Result<()>,
}

const ADAM_CPU: Group = Group {
    name: "adam CPU",
    register: adam::register::<adam::cpu::Cpu>,
};
const ADAM_CUDA: Group = Group {
    name: "adam CUDA",
    register: adam::register::<adam::cuda::Cuda>,
};
const SOFTMAX_CPU: Group = Group {
    name: "softmax CPU",
    register: softmax::cpu::register,
};
const SOFTMAX_CUDA: Group = Group {
    name: "softmax CUDA",
    register: softmax::cuda::register,
};
const LAYER_NORM_CPU: Group = Group {
    name: "layer_norm CPU",
    register: layer_norm::cpu::register,
};
const LAYER_NORM_CUDA: Group = Group {
    name: "layer_norm CUDA",
    register: layer_norm::cuda::register,
};

const GRAFTS: [Graft; 24] = [
    Graft {
        op: "aten::_fused_rms_norm",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &rms_norm::cpu::FORWARD,
        kernel: Library::register::<rms_norm::cpu::ForwardCpu>,
        group: None,
    },
    Graft {
        op: "aten::_fused_rms_norm_backward",
        dispatch_key: "CPU",
        holder: Holder::CpuKept,
        counters: &rms_norm::cpu::BACKWARD,
        kernel: Library::register::<rms_norm::cpu::BackwardCpu>,
        group: None,
    },
    Graft {
        op: "aten::_fused_rms_norm",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &rms_norm::cuda::FORWARD,
        kernel: Library::register::<rms_norm::cuda::ForwardCuda>,
        group: None,
    },
    Graft {
        op: "aten::_fused_rms_norm_backward",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &rms_norm::cuda::BACKWARD,
        kernel: Library::register::<rms_norm::cuda::BackwardCuda>,
        group: None,
    },
    Graft {
        op: "aten::_fused_adamw_",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAMW,
        kernel: Library::register::<adam::Step<adam::AdamW, f64, adam::cpu::Cpu>>,
        group: Some(ADAM_CPU),
    },
    Graft {
        op: "aten::_fused_adamw_.tensor_lr",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAMW_TENSOR_LR,
        kernel: Library::register::<adam::Step<adam::AdamW, Tensor, adam::cpu::Cpu>>,
        group: Some(ADAM_CPU),
    },
    Graft {
        op: "aten::_fused_adam_",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAM,
        kernel: Library::register::<adam::Step<adam::Adam, f64, adam::cpu::Cpu>>,
        group: Some(ADAM_CPU),
    },
    Graft {
        op: "aten::_fused_adam_.tensor_lr",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &adam::cpu::ADAM_TENSOR_LR,
        kernel: Library::register::<adam::Step<adam::Adam, Tensor, adam::cpu::Cpu>>,
        group: Some(ADAM_CPU),
    },
    Graft {
        op: "aten::_fused_adamw_",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAMW,
        kernel: Library::register::<adam::Step<adam::AdamW, f64, adam::cuda::Cuda>>,
        group: Some(ADAM_CUDA),
    },
    Graft {
        op: "aten::_fused_adamw_.tensor_lr",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAMW_TENSOR_LR,
        kernel: Library::register::<adam::Step<adam::AdamW, Tensor, adam::cuda::Cuda>>,
        group: Some(ADAM_CUDA),
    },
    Graft {
        op: "aten::_fused_adam_",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAM,
        kernel: Library::register::<adam::Step<adam::Adam, f64, adam::cuda::Cuda>>,
        group: Some(ADAM_CUDA),
    },
    Graft {
        op: "aten::_fused_adam_.tensor_lr",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &adam::cuda::ADAM_TENSOR_LR,
        kernel: Library::register::<adam::Step<adam::Adam, Tensor, adam::cuda::Cuda>>,
        group: Some(ADAM_CUDA),
    },
    Graft {
        op: "aten::_softmax",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::SOFTMAX,
        kernel: Library::register::<softmax::Forward<softmax::Softmax, softmax::cpu::Cpu>>,
        group: Some(SOFTMAX_CPU),
    },
    Graft {
        op: "aten::_log_softmax",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::LOG_SOFTMAX,
        kernel: Library::register::<softmax::Forward<softmax::LogSoftmax, softmax::cpu::Cpu>>,
        group: Some(SOFTMAX_CPU),
    },
    Graft {
        op: "aten::_softmax_backward_data",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::SOFTMAX_BACKWARD,
        kernel: Library::register::<softmax::Backward<softmax::Softmax, softmax::cpu::Cpu>>,
        group: Some(SOFTMAX_CPU),
    },
    Graft {
        op: "aten::_log_softmax_backward_data",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &softmax::cpu::LOG_SOFTMAX_BACKWARD,
        kernel: Library::register::<softmax::Backward<softmax::LogSoftmax, softmax::cpu::Cpu>>,
        group: Some(SOFTMAX_CPU),
    },
    Graft {
        op: "aten::_softmax",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::SOFTMAX,
        kernel: Library::register::<softmax::Forward<softmax::Softmax, softmax::cuda::Cuda>>,
        group: Some(SOFTMAX_CUDA),
    },
    Graft {
        op: "aten::_log_softmax",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::LOG_SOFTMAX,
        kernel: Library::register::<softmax::Forward<softmax::LogSoftmax, softmax::cuda::Cuda>>,
        group: Some(SOFTMAX_CUDA),
    },
    Graft {
        op: "aten::_softmax_backward_data",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::SOFTMAX_BACKWARD,
        kernel: Library::register::<softmax::Backward<softmax::Softmax, softmax::cuda::Cuda>>,
        group: Some(SOFTMAX_CUDA),
    },
    Graft {
        op: "aten::_log_softmax_backward_data",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &softmax::cuda::LOG_SOFTMAX_BACKWARD,
        kernel: Library::register::<softmax::Backward<softmax::LogSoftmax, softmax::cuda::Cuda>>,
        group: Some(SOFTMAX_CUDA),
    },
    Graft {
        op: "aten::native_layer_norm",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &layer_norm::cpu::FORWARD,
        kernel: Library::register::<layer_norm::cpu::ForwardCpu>,
        group: Some(LAYER_NORM_CPU),
    },
    Graft {
        op: "aten::native_layer_norm_backward",
        dispatch_key: "CPU",
        holder: Holder::Cpu,
        counters: &layer_norm::cpu::BACKWARD,
        kernel: Library::register::<layer_norm::cpu::BackwardCpu>,
        group: Some(LAYER_NORM_CPU),
    },
    Graft {
        op: "aten::native_layer_norm",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &layer_norm::cuda::FORWARD,
        kernel: Library::register::<layer_norm::cuda::ForwardCuda>,
        group: Some(LAYER_NORM_CUDA),
    },
    Graft {
        op: "aten::native_layer_norm_backward",
        dispatch_key: "CUDA",
        holder: Holder::Cuda,
        counters: &layer_norm::cuda::BACKWARD,
        kernel: Library::register::<layer_norm::cuda::BackwardCuda>,
        group: Some(LAYER_NORM_CUDA),
    },
];

/// The registrations that [`enable`] makes and [`disable`] removes.
struct Installed {
    /// The CPU grafts (held: dropping a library deregisters its kernels).
    _cpu: Library,
    /// The CUDA grafts, when they could be registered.
    cuda: Option<Library>,
    /// The op symbols left out ([`enable_except`]).
    disabled: BTreeSet<String>,
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
/// tensors of our forward (same rstd dtype and shape) after [`disable`]. For the same reason no
/// op filter ([`enable_except`]) removes it: with the CPU forward grafted, autograd calls it.
static CPU_BACKWARD: Mutex<Option<Library>> = Mutex::new(None);

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An op's symbol: its qualified name without the namespace (`_fused_adam_.tensor_lr`).
fn symbol(op: &str) -> &str {
    op.split_once("::").map_or(op, |(_, name)| name)
}

/// Registers the native grafts (idempotent): at CPU always, at CUDA when [`cuda_status`] is Ok.
/// Needs libtorch loaded in the process. All or nothing: on an error nothing new stays
/// registered. The same as [`enable_except`] with no op left out.
pub fn enable() -> Result<()> {
    enable_except(&[])
}

/// Registers the native grafts except those of the ops named in `disabled` (bare symbols, one
/// overload each, as the dispatcher names them: `_fused_rms_norm`, `_fused_adam_.tensor_lr`),
/// which keep the kernels that were there before. Already enabled with the same ops left out:
/// nothing changes; with others: the grafts are registered again without them.
///
/// All or nothing: on an error nothing new stays registered, and grafts enabled before are
/// registered again as they were. The CPU backward of RMSNorm is never left out (see
/// [`CPU_BACKWARD`]). Names that are no graft's op are accepted and change nothing.
pub fn enable_except(disabled: &[&str]) -> Result<()> {
    let disabled: BTreeSet<String> = disabled.iter().map(|s| s.to_string()).collect();
    let mut installed = lock(&INSTALLED);
    if installed.as_ref().is_some_and(|i| i.disabled == disabled) {
        return Ok(());
    }
    graft_abi::load()?;
    // One kernel per (op, key): the old registrations go before the new ones are made.
    let previous = installed.take().map(|i| i.disabled);
    match install(disabled) {
        Ok(new) => {
            *installed = Some(new);
            Ok(())
        }
        Err(e) => {
            // Put back what was there (it registered before, so it registers again).
            *installed = previous.and_then(|p| install(p).ok());
            Err(e)
        }
    }
}

/// Registers the grafts not in `disabled`; an early return drops (and so deregisters) every
/// registration made so far.
fn install(disabled: BTreeSet<String>) -> Result<Installed> {
    let mut cpu = Library::implementations(c"aten", c"CPU")?;
    register(&mut cpu, Holder::Cpu, &disabled)?;
    let cuda = if cuda_status().is_ok() {
        let mut cuda = Library::implementations(c"aten", c"CUDA")?;
        register(&mut cuda, Holder::Cuda, &disabled)?;
        Some(cuda)
    } else {
        None
    };
    let mut backward = lock(&CPU_BACKWARD);
    if backward.is_none() {
        let mut lib = Library::implementations(c"aten", c"CPU")?;
        register(&mut lib, Holder::CpuKept, &BTreeSet::new())?;
        *backward = Some(lib);
    }
    Ok(Installed {
        _cpu: cpu,
        cuda,
        disabled,
    })
}

/// Registers in `lib` the grafts `holder` holds whose ops are not in `disabled`: a whole group
/// with its module's function, the rest one by one.
fn register(lib: &mut Library, holder: Holder, disabled: &BTreeSet<String>) -> Result<()> {
    let wanted = |g: &Graft| g.holder == holder && !disabled.contains(symbol(g.op));
    let mut groups_done: Vec<&str> = Vec::new();
    for graft in GRAFTS.iter().filter(|g| g.holder == holder) {
        if let Some(group) = graft.group {
            if groups_done.contains(&group.name) {
                continue;
            }
            let members = || {
                GRAFTS
                    .iter()
                    .filter(|g| g.group.is_some_and(|h| h.name == group.name))
            };
            if members().all(wanted) {
                (group.register)(lib)?;
                groups_done.push(group.name);
                continue;
            }
        }
        if wanted(graft) {
            let name = CString::new(symbol(graft.op)).expect("op names have no NUL");
            (graft.kernel)(lib, &name)?;
        }
    }
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

/// Every native graft this build has, with its state and counters (torchgraft's own operators'
/// kernels are in [`ops::kernels`]).
pub fn grafts() -> Vec<GraftInfo> {
    let installed = lock(&INSTALLED);
    let backward_kept = lock(&CPU_BACKWARD).is_some();
    GRAFTS
        .iter()
        .map(|g| {
            let (calls, fallbacks) = g.counters.read();
            let kept = |i: &Installed| !i.disabled.contains(symbol(g.op));
            let active = match g.holder {
                Holder::Cpu => installed.as_ref().is_some_and(kept),
                Holder::CpuKept => backward_kept,
                Holder::Cuda => installed
                    .as_ref()
                    .is_some_and(|i| i.cuda.is_some() && kept(i)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_graft_is_an_aten_op_at_its_holders_key() {
        for g in &GRAFTS {
            assert!(g.op.starts_with("aten::"), "{}", g.op);
            let key = match g.holder {
                Holder::Cpu | Holder::CpuKept => "CPU",
                Holder::Cuda => "CUDA",
            };
            assert_eq!(g.dispatch_key, key, "{}", g.op);
        }
    }

    #[test]
    fn a_group_is_held_by_one_registration() {
        for g in &GRAFTS {
            let Some(group) = g.group else { continue };
            for other in GRAFTS
                .iter()
                .filter(|o| o.group.is_some_and(|h| h.name == group.name))
            {
                assert!(other.holder == g.holder, "{} and {}", g.op, other.op);
            }
        }
    }

    #[test]
    fn a_symbol_is_the_name_without_its_namespace() {
        assert_eq!(
            symbol("aten::_fused_adam_.tensor_lr"),
            "_fused_adam_.tensor_lr"
        );
        assert_eq!(symbol("_softmax"), "_softmax");
    }

    #[test]
    fn nothing_is_active_before_enable() {
        assert!(grafts().iter().all(|g| !g.active));
    }
}
