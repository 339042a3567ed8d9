//! torchgraft's own operators (`torchgraft::*`): fused ops that no single aten op covers.
//!
//! Unlike the grafts, these replace nothing, so they are not switched by `enable()`/`disable()`:
//! [`define`] defines each schema once per process and registers its kernels at CPU (Rust) and,
//! when this build and process can run them, CUDA (graft-cuda). Their autograd formulas and
//! fake (meta) functions live in Python (`torchgraft.ops.<op>.custom_op`), which calls the
//! backward ops defined here. Adding an op is one row of [`OPS`] plus its kernel module.

mod cross_entropy;
mod glu;
mod linear_cross_entropy;
mod moe_permute;
mod rms_norm;
mod rope;
mod topk_sigmoid;
mod topk_softmax;

use std::sync::Mutex;

use graft_abi::{Library, Result};

use crate::common::cuda::cuda_status;
use crate::common::stats::{Counters, GraftInfo};

/// One operator: its schema and its kernels.
struct CustomOp {
    /// Qualified operator name, e.g. `torchgraft::swiglu`.
    op: &'static str,
    schema: &'static std::ffi::CStr,
    register_cpu: fn(&mut Library) -> Result<()>,
    register_cuda: fn(&mut Library) -> Result<()>,
    cpu_counters: &'static Counters,
    cuda_counters: &'static Counters,
    /// Whether the op has a CUDA kernel (`register_cuda` registers nothing otherwise).
    cuda: bool,
}

/// The counters of an op without a CUDA kernel (never counted: nothing is registered). No row
/// uses them today; they stay for an op that lands before its CUDA kernel (`cuda: false`).
#[allow(dead_code)]
static NO_CUDA_KERNEL: Counters = Counters::new();

const OPS: &[CustomOp] = &[
    CustomOp {
        op: "torchgraft::swiglu",
        schema: c"swiglu(Tensor gate, Tensor up, *, bool inplace_backward=False) -> Tensor",
        register_cpu: |lib| lib.register::<glu::cpu::SwigluCpu>(c"swiglu"),
        register_cuda: |lib| lib.register::<glu::cuda::SwigluCuda>(c"swiglu"),
        cpu_counters: &glu::cpu::SWIGLU_CPU,
        cuda_counters: &glu::cuda::SWIGLU_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::swiglu_backward",
        schema: c"swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<glu::cpu::SwigluBackwardCpu>(c"swiglu_backward"),
        register_cuda: |lib| lib.register::<glu::cuda::SwigluBackwardCuda>(c"swiglu_backward"),
        cpu_counters: &glu::cpu::SWIGLU_BACKWARD_CPU,
        cuda_counters: &glu::cuda::SWIGLU_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::geglu",
        schema: c"geglu(Tensor gate, Tensor up, bool tanh, *, bool inplace_backward=False) -> Tensor",
        register_cpu: |lib| lib.register::<glu::cpu::GegluCpu>(c"geglu"),
        register_cuda: |lib| lib.register::<glu::cuda::GegluCuda>(c"geglu"),
        cpu_counters: &glu::cpu::GEGLU_CPU,
        cuda_counters: &glu::cuda::GEGLU_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::geglu_backward",
        schema:
            c"geglu_backward(Tensor grad, Tensor gate, Tensor up, bool tanh) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<glu::cpu::GegluBackwardCpu>(c"geglu_backward"),
        register_cuda: |lib| lib.register::<glu::cuda::GegluBackwardCuda>(c"geglu_backward"),
        cpu_counters: &glu::cpu::GEGLU_BACKWARD_CPU,
        cuda_counters: &glu::cuda::GEGLU_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::swiglu_backward_",
        schema: c"swiglu_backward_(Tensor grad, Tensor(a!) gate, Tensor(b!) up) -> ()",
        register_cpu: |lib| lib.register::<glu::cpu::SwigluBackwardInPlaceCpu>(c"swiglu_backward_"),
        register_cuda: |lib| lib.register::<glu::cuda::SwigluBackwardInPlaceCuda>(c"swiglu_backward_"),
        cpu_counters: &glu::cpu::SWIGLU_BACKWARD_INPLACE_CPU,
        cuda_counters: &glu::cuda::SWIGLU_BACKWARD_INPLACE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::geglu_backward_",
        schema: c"geglu_backward_(Tensor grad, Tensor(a!) gate, Tensor(b!) up, bool tanh) -> ()",
        register_cpu: |lib| lib.register::<glu::cpu::GegluBackwardInPlaceCpu>(c"geglu_backward_"),
        register_cuda: |lib| lib.register::<glu::cuda::GegluBackwardInPlaceCuda>(c"geglu_backward_"),
        cpu_counters: &glu::cpu::GEGLU_BACKWARD_INPLACE_CPU,
        cuda_counters: &glu::cuda::GEGLU_BACKWARD_INPLACE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::swiglu_packed",
        schema: c"swiglu_packed(Tensor gate_up) -> Tensor",
        register_cpu: |lib| lib.register::<glu::cpu::SwigluPackedCpu>(c"swiglu_packed"),
        register_cuda: |lib| lib.register::<glu::cuda::SwigluPackedCuda>(c"swiglu_packed"),
        cpu_counters: &glu::cpu::SWIGLU_PACKED_CPU,
        cuda_counters: &glu::cuda::SWIGLU_PACKED_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::swiglu_packed_backward",
        schema: c"swiglu_packed_backward(Tensor grad, Tensor gate_up) -> Tensor",
        register_cpu: |lib| {
            lib.register::<glu::cpu::SwigluPackedBackwardCpu>(c"swiglu_packed_backward")
        },
        register_cuda: |lib| {
            lib.register::<glu::cuda::SwigluPackedBackwardCuda>(c"swiglu_packed_backward")
        },
        cpu_counters: &glu::cpu::SWIGLU_PACKED_BACKWARD_CPU,
        cuda_counters: &glu::cuda::SWIGLU_PACKED_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::swiglu_packed_backward_",
        schema: c"swiglu_packed_backward_(Tensor grad, Tensor(a!) gate_up) -> ()",
        register_cpu: |lib| {
            lib.register::<glu::cpu::SwigluPackedBackwardInPlaceCpu>(c"swiglu_packed_backward_")
        },
        register_cuda: |lib| {
            lib.register::<glu::cuda::SwigluPackedBackwardInPlaceCuda>(c"swiglu_packed_backward_")
        },
        cpu_counters: &glu::cpu::SWIGLU_PACKED_BACKWARD_INPLACE_CPU,
        cuda_counters: &glu::cuda::SWIGLU_PACKED_BACKWARD_INPLACE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::rope",
        schema: c"rope(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<rope::cpu::RopeCpu>(c"rope"),
        register_cuda: |lib| lib.register::<rope::cuda::RopeCuda>(c"rope"),
        cpu_counters: &rope::cpu::ROPE_CPU,
        cuda_counters: &rope::cuda::ROPE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::rope_backward",
        schema: c"rope_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, int unsqueeze_dim) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<rope::cpu::RopeBackwardCpu>(c"rope_backward"),
        register_cuda: |lib| lib.register::<rope::cuda::RopeBackwardCuda>(c"rope_backward"),
        cpu_counters: &rope::cpu::ROPE_BACKWARD_CPU,
        cuda_counters: &rope::cuda::ROPE_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::cross_entropy",
        schema: c"cross_entropy(Tensor logits, Tensor target, int ignore_index, int reduction, float label_smoothing, bool compute_grad) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<cross_entropy::cpu::CrossEntropyCpu>(c"cross_entropy"),
        register_cuda: |lib| lib.register::<cross_entropy::cuda::CrossEntropyCuda>(c"cross_entropy"),
        cpu_counters: &cross_entropy::cpu::CROSS_ENTROPY_CPU,
        cuda_counters: &cross_entropy::cuda::CROSS_ENTROPY_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::cross_entropy_",
        schema: c"cross_entropy_(Tensor(a!) logits, Tensor target, int ignore_index, int reduction, float label_smoothing) -> Tensor",
        register_cpu: |lib| lib.register::<cross_entropy::cpu::CrossEntropyInPlaceCpu>(c"cross_entropy_"),
        register_cuda: |lib| {
            lib.register::<cross_entropy::cuda::CrossEntropyInPlaceCuda>(c"cross_entropy_")
        },
        cpu_counters: &cross_entropy::cpu::CROSS_ENTROPY_INPLACE_CPU,
        cuda_counters: &cross_entropy::cuda::CROSS_ENTROPY_INPLACE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::scale_grad",
        schema: c"scale_grad(Tensor grad, Tensor grad_output) -> Tensor",
        register_cpu: |lib| lib.register::<cross_entropy::ScaleGradKernel<false>>(c"scale_grad"),
        register_cuda: |lib| lib.register::<cross_entropy::ScaleGradKernel<true>>(c"scale_grad"),
        cpu_counters: &cross_entropy::SCALE_GRAD_CPU,
        cuda_counters: &cross_entropy::SCALE_GRAD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::scale_grad_",
        schema: c"scale_grad_(Tensor(a!) grad, Tensor grad_output) -> ()",
        register_cpu: |lib| {
            lib.register::<cross_entropy::ScaleGradInPlaceKernel<false>>(c"scale_grad_")
        },
        register_cuda: |lib| {
            lib.register::<cross_entropy::ScaleGradInPlaceKernel<true>>(c"scale_grad_")
        },
        cpu_counters: &cross_entropy::SCALE_GRAD_INPLACE_CPU,
        cuda_counters: &cross_entropy::SCALE_GRAD_INPLACE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::linear_cross_entropy",
        schema: c"linear_cross_entropy(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, int reduction, int chunk_size, bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor)",
        register_cpu: |lib| {
            lib.register::<linear_cross_entropy::LinearCrossEntropyKernel<false>>(
                c"linear_cross_entropy",
            )
        },
        register_cuda: |lib| {
            lib.register::<linear_cross_entropy::LinearCrossEntropyKernel<true>>(
                c"linear_cross_entropy",
            )
        },
        cpu_counters: &linear_cross_entropy::LINEAR_CROSS_ENTROPY_CPU,
        cuda_counters: &linear_cross_entropy::LINEAR_CROSS_ENTROPY_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::linear_cross_entropy_backward",
        schema: c"linear_cross_entropy_backward(Tensor grad_output, Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, int chunk_size, bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
        register_cpu: |lib| {
            lib.register::<linear_cross_entropy::LinearCrossEntropyBackwardKernel<false>>(
                c"linear_cross_entropy_backward",
            )
        },
        register_cuda: |lib| {
            lib.register::<linear_cross_entropy::LinearCrossEntropyBackwardKernel<true>>(
                c"linear_cross_entropy_backward",
            )
        },
        cpu_counters: &linear_cross_entropy::LINEAR_CROSS_ENTROPY_BACKWARD_CPU,
        cuda_counters: &linear_cross_entropy::LINEAR_CROSS_ENTROPY_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::rms_norm",
        schema: c"rms_norm(Tensor x, Tensor? weight, float eps, float offset, bool cast_before_weight) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<rms_norm::cpu::RmsNormCpu>(c"rms_norm"),
        register_cuda: |lib| lib.register::<rms_norm::cuda::RmsNormCuda>(c"rms_norm"),
        cpu_counters: &rms_norm::cpu::RMS_NORM_CPU,
        cuda_counters: &rms_norm::cuda::RMS_NORM_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::rms_norm_backward",
        schema: c"rms_norm_backward(Tensor grad, Tensor x, Tensor rstd, Tensor? weight, float offset, bool cast_before_weight, bool[2] output_mask) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<rms_norm::cpu::RmsNormBackwardCpu>(c"rms_norm_backward"),
        register_cuda: |lib| lib.register::<rms_norm::cuda::RmsNormBackwardCuda>(c"rms_norm_backward"),
        cpu_counters: &rms_norm::cpu::RMS_NORM_BACKWARD_CPU,
        cuda_counters: &rms_norm::cuda::RMS_NORM_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::topk_softmax",
        schema: c"topk_softmax(Tensor logits, int k, bool renormalize) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<topk_softmax::cpu::TopkSoftmaxCpu>(c"topk_softmax"),
        register_cuda: |lib| lib.register::<topk_softmax::cuda::TopkSoftmaxCuda>(c"topk_softmax"),
        cpu_counters: &topk_softmax::cpu::TOPK_SOFTMAX_CPU,
        cuda_counters: &topk_softmax::cuda::TOPK_SOFTMAX_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::topk_softmax_backward",
        schema: c"topk_softmax_backward(Tensor grad_weights, Tensor logits, Tensor weights, Tensor indices, bool renormalize) -> Tensor",
        register_cpu: |lib| {
            lib.register::<topk_softmax::cpu::TopkSoftmaxBackwardCpu>(c"topk_softmax_backward")
        },
        register_cuda: |lib| {
            lib.register::<topk_softmax::cuda::TopkSoftmaxBackwardCuda>(c"topk_softmax_backward")
        },
        cpu_counters: &topk_softmax::cpu::TOPK_SOFTMAX_BACKWARD_CPU,
        cuda_counters: &topk_softmax::cuda::TOPK_SOFTMAX_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::topk_sigmoid",
        schema: c"topk_sigmoid(Tensor logits, Tensor? bias, int k, int groups, int topk_groups, bool renormalize, float scale) -> (Tensor, Tensor)",
        register_cpu: |lib| lib.register::<topk_sigmoid::cpu::TopkSigmoidCpu>(c"topk_sigmoid"),
        register_cuda: |lib| lib.register::<topk_sigmoid::cuda::TopkSigmoidCuda>(c"topk_sigmoid"),
        cpu_counters: &topk_sigmoid::cpu::TOPK_SIGMOID_CPU,
        cuda_counters: &topk_sigmoid::cuda::TOPK_SIGMOID_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::topk_sigmoid_backward",
        schema: c"topk_sigmoid_backward(Tensor grad_weights, Tensor logits, Tensor indices, bool renormalize, float scale) -> Tensor",
        register_cpu: |lib| {
            lib.register::<topk_sigmoid::cpu::TopkSigmoidBackwardCpu>(c"topk_sigmoid_backward")
        },
        register_cuda: |lib| {
            lib.register::<topk_sigmoid::cuda::TopkSigmoidBackwardCuda>(c"topk_sigmoid_backward")
        },
        cpu_counters: &topk_sigmoid::cpu::TOPK_SIGMOID_BACKWARD_CPU,
        cuda_counters: &topk_sigmoid::cuda::TOPK_SIGMOID_BACKWARD_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::moe_sort",
        schema: c"moe_sort(Tensor expert_ids, int num_experts) -> (Tensor, Tensor, Tensor)",
        register_cpu: |lib| lib.register::<moe_permute::cpu::MoeSortCpu>(c"moe_sort"),
        register_cuda: |lib| lib.register::<moe_permute::cuda::MoeSortCuda>(c"moe_sort"),
        cpu_counters: &moe_permute::cpu::MOE_SORT_CPU,
        cuda_counters: &moe_permute::cuda::MOE_SORT_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::moe_permute",
        schema: c"moe_permute(Tensor hidden, Tensor perm, Tensor valid, int top_k) -> Tensor",
        register_cpu: |lib| lib.register::<moe_permute::cpu::MoePermuteCpu>(c"moe_permute"),
        register_cuda: |lib| lib.register::<moe_permute::cuda::MoePermuteCuda>(c"moe_permute"),
        cpu_counters: &moe_permute::cpu::MOE_PERMUTE_CPU,
        cuda_counters: &moe_permute::cuda::MOE_PERMUTE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::moe_unpermute",
        schema: c"moe_unpermute(Tensor y, Tensor inv_perm, Tensor valid, Tensor? weights, int top_k) -> Tensor",
        register_cpu: |lib| lib.register::<moe_permute::cpu::MoeUnpermuteCpu>(c"moe_unpermute"),
        register_cuda: |lib| lib.register::<moe_permute::cuda::MoeUnpermuteCuda>(c"moe_unpermute"),
        cpu_counters: &moe_permute::cpu::MOE_UNPERMUTE_CPU,
        cuda_counters: &moe_permute::cuda::MOE_UNPERMUTE_CUDA,
        cuda: true,
    },
    CustomOp {
        op: "torchgraft::moe_unpermute_backward",
        schema: c"moe_unpermute_backward(Tensor grad, Tensor y, Tensor perm, Tensor inv_perm, Tensor valid, Tensor? weights, int top_k) -> (Tensor, Tensor)",
        register_cpu: |lib| {
            lib.register::<moe_permute::cpu::MoeUnpermuteBackwardCpu>(c"moe_unpermute_backward")
        },
        register_cuda: |lib| {
            lib.register::<moe_permute::cuda::MoeUnpermuteBackwardCuda>(c"moe_unpermute_backward")
        },
        cpu_counters: &moe_permute::cpu::MOE_UNPERMUTE_BACKWARD_CPU,
        cuda_counters: &moe_permute::cuda::MOE_UNPERMUTE_BACKWARD_CUDA,
        cuda: true,
    },
];

/// The libraries holding the definitions and kernels, kept for the life of the process once
/// made (an operator cannot be redefined while graphs may refer to it).
struct Defined {
    _libraries: Vec<Library>,
    cuda: bool,
}

static DEFINED: Mutex<Option<Defined>> = Mutex::new(None);

/// Defines every `torchgraft::` operator and registers its kernels (idempotent). Needs libtorch
/// loaded in the process.
pub fn define() -> Result<()> {
    let mut defined = DEFINED.lock().unwrap_or_else(|e| e.into_inner());
    if defined.is_some() {
        return Ok(());
    }
    graft_abi::load()?;
    let mut schemas = Library::fragment(c"torchgraft")?;
    let mut cpu = Library::implementations(c"torchgraft", c"CPU")?;
    for op in OPS {
        schemas.define(op.schema)?;
        (op.register_cpu)(&mut cpu)?;
    }
    let mut libraries = vec![schemas, cpu];
    let cuda = cuda_status().is_ok();
    if cuda {
        let mut lib = Library::implementations(c"torchgraft", c"CUDA")?;
        for op in OPS {
            (op.register_cuda)(&mut lib)?;
        }
        libraries.push(lib);
    }
    *defined = Some(Defined {
        _libraries: libraries,
        cuda,
    });
    Ok(())
}

/// The operators' kernels with their counters (`active`: registered in this process).
pub fn kernels() -> Vec<GraftInfo> {
    let defined = DEFINED.lock().unwrap_or_else(|e| e.into_inner());
    let (any, cuda) = defined.as_ref().map_or((false, false), |d| (true, d.cuda));
    let mut out = Vec::with_capacity(OPS.len() * 2);
    for op in OPS {
        for (key, counters, active) in [
            ("CPU", op.cpu_counters, any),
            ("CUDA", op.cuda_counters, cuda && op.cuda),
        ] {
            let (calls, fallbacks) = counters.read();
            out.push(GraftInfo {
                op: op.op,
                dispatch_key: key,
                active,
                calls,
                fallbacks,
            });
        }
    }
    out
}

/// Zeroes every operator kernel's counters.
pub fn reset_stats() {
    for op in OPS {
        op.cpu_counters.reset();
        op.cuda_counters.reset();
    }
}
