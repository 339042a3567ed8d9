//! torchgraft's CUDA kernels (RMSNorm forward and backward, gated linear units, and the
//! other fused ops, each in src/ops/<op>/ with its kernels in <op>.cu), compiled ahead of
//! time by nvcc (build.rs) into one fatbin embedded in this library, and launched through
//! the CUDA driver API on the caller's stream.
//!
//! Nothing is linked at build time: the driver (`libcuda.so.1`) is opened at run time.
//! Each device's kernels are loaded once into its primary context (the one PyTorch uses);
//! after that a launch validates its arguments, picks a configuration from `cols` and the
//! device's SM count, and calls `cuLaunchKernel`: no allocation, no synchronisation, no
//! lock.
//!
//! Layout: `runtime/` (the driver, devices, launching, the fatbin; it knows no op) and
//! `ops/<op>/` (each op's launches and its kernels). The ops' kernel tables are concatenated
//! in ops/mod.rs; the runtime loads and configures every kernel from that table.

#![warn(missing_docs)]

mod dtype;
mod ops;
mod runtime;
pub mod tools;

pub use dtype::DType;
pub use ops::adam::{adam_step, AdamMode, AdamStep, AdamTensor, MAX_TENSORS as ADAM_MAX_TENSORS};
pub use ops::cross_entropy::{
    accumulate_f32, cross_entropy_block_grad, cross_entropy_block_stats, cross_entropy_count,
    cross_entropy_reduce, cross_entropy_rows, cross_entropy_rows_with, scale_grad, AccumulateF32,
    CrossEntropyBlockGrad, CrossEntropyBlockStats, CrossEntropyCount, CrossEntropyReduce,
    CrossEntropyRows, RowsTuning, ScaleGrad,
};
pub use ops::glu::{
    glu_backward, glu_forward, glu_packed_backward, glu_packed_forward, GluActivation, GluBackward,
    GluForward, GluPackedBackward, GluPackedForward,
};
pub use ops::layer_norm::{
    layer_norm_backward, layer_norm_backward_workspace_bytes, layer_norm_forward,
    LayerNormBackward, LayerNormForward,
};
pub use ops::moe_permute::{
    moe_permute, moe_sort, moe_sort_workspace, moe_unpermute, moe_unpermute_backward, MoePermute,
    MoeSort, MoeUnpermute, MoeUnpermuteBackward, MoeValid, MoeWeights, MOE_SORT_MAX_EXPERTS,
};
pub use ops::rms_norm::{
    plan_backward, plan_forward, rms_norm_backward, rms_norm_backward_with,
    rms_norm_backward_workspace_bytes, rms_norm_backward_workspace_bytes_for, rms_norm_forward,
    rms_norm_forward_with, Plan, RmsNormBackward, RmsNormForward, Tuning, Weight, WeightMode,
};
pub use ops::rope::{rope, RopeArgs, RopeOperand};
pub use ops::softmax::{softmax_backward, softmax_forward, SoftmaxBackward, SoftmaxForward};
pub use ops::topk_sigmoid::{
    topk_sigmoid_backward, topk_sigmoid_forward, TopkSigmoidBackward, TopkSigmoidForward,
};
pub use ops::topk_softmax::{
    topk_softmax_backward, topk_softmax_forward, TopkSoftmaxBackward, TopkSoftmaxForward,
};
pub use runtime::config::{DeviceLimits, KernelAttrs};
pub use runtime::error::{CudaError, ErrorKind};
pub use runtime::fatbin;

/// Whether this build embeds the CUDA kernels (nvcc was found and succeeded at build time).
pub fn kernels_built() -> bool {
    fatbin::fatbin().is_some()
}

/// Names of every kernel the library launches (all must be in the fatbin).
pub fn kernel_names() -> Vec<String> {
    runtime::kernels::table()
        .iter()
        .map(|k| k.name.clone())
        .collect()
}

/// Number of CUDA devices. Loads the driver on first use; `Err` when the driver library
/// is absent or fails to initialise, `Ok(0)` when it loads but finds no device.
pub fn device_count() -> Result<usize, CudaError> {
    runtime::device::device_count()
}

/// The kernel table the runtime loads: every op's kernels (ops/mod.rs).
pub(crate) fn kernel_table() -> Vec<runtime::kernels::Kernel> {
    ops::kernel_table()
}
