//! torchgraft's CUDA kernels (RMSNorm forward and backward, gated linear units, and the
//! other fused ops in kernels/*.cu), compiled ahead of time by nvcc (build.rs) into one
//! fatbin embedded in this library, and launched through the CUDA driver API on the
//! caller's stream.
//!
//! Nothing is linked at build time: the driver (`libcuda.so.1`) is opened at run time.
//! Each device's kernels are loaded once into its primary context (the one PyTorch uses);
//! after that a launch validates its arguments, picks a configuration from `cols` and the
//! device's SM count, and calls `cuLaunchKernel`: no allocation, no synchronisation, no
//! lock.
//!
//! RMSNorm's semantics follow PyTorch's reference composite `_fused_rms_norm` /
//! `_fused_rms_norm_backward`: for a row `x` of `cols` elements,
//! `rstd = 1 / sqrt(mean(x^2) + eps)` in the accumulation type (f32, or f64 for F64),
//! `y = (x * rstd) * w` rounded to the dtype; backward `xhat = x * rstd`, `g = dy * w`,
//! `dx = rstd * (g - xhat * mean(g * xhat))`, `dw = sum over rows of dy * xhat`, reduced
//! in a fixed order (the same bits on every run). [`WeightMode`] gives the variants models
//! write by hand (torchgraft::rms_norm): a weight offset and rounding before the weight.

#![warn(missing_docs)]

mod adam;
mod config;
mod cross_entropy;
mod device;
mod driver;
pub mod fatbin;
mod glu;
mod kernels;
mod launch;
mod layer_norm;
mod params;
mod rms_norm;
mod rope;
mod softmax;
pub mod tools;

pub use adam::{adam_step, AdamMode, AdamStep, AdamTensor, MAX_TENSORS as ADAM_MAX_TENSORS};
pub use config::{DeviceLimits, KernelAttrs};
pub use cross_entropy::{
    accumulate_f32, cross_entropy_block_grad, cross_entropy_block_stats, cross_entropy_count,
    cross_entropy_reduce, cross_entropy_rows, cross_entropy_rows_with, scale_grad, AccumulateF32,
    CrossEntropyBlockGrad, CrossEntropyBlockStats, CrossEntropyCount, CrossEntropyReduce,
    CrossEntropyRows, RowsTuning, ScaleGrad,
};
pub use error::{CudaError, ErrorKind};
pub use glu::{glu_backward, glu_forward, GluActivation, GluBackward, GluForward};
pub use layer_norm::{
    layer_norm_backward, layer_norm_backward_workspace_bytes, layer_norm_forward,
    LayerNormBackward, LayerNormForward,
};
pub use rms_norm::{
    plan_backward, plan_forward, rms_norm_backward, rms_norm_backward_with,
    rms_norm_backward_workspace_bytes, rms_norm_backward_workspace_bytes_for, rms_norm_forward,
    rms_norm_forward_with, Plan, Tuning,
};
pub use rope::{rope, RopeArgs, RopeOperand};
pub use softmax::{softmax_backward, softmax_forward, SoftmaxBackward, SoftmaxForward};

mod error;

/// Whether this build embeds the CUDA kernels (nvcc was found and succeeded at build time).
pub fn kernels_built() -> bool {
    fatbin::fatbin().is_some()
}

/// Names of every kernel the library launches (all must be in the fatbin).
pub fn kernel_names() -> Vec<String> {
    kernels::all_names()
}

/// Number of CUDA devices. Loads the driver on first use; `Err` when the driver library
/// is absent or fails to initialise, `Ok(0)` when it loads but finds no device.
pub fn device_count() -> Result<usize, CudaError> {
    device::device_count()
}

/// Element type of `x`, `y`, `dy` and `dx`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `float32`.
    F32,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `float64`.
    F64,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// The accumulation dtype (of `rstd`, of an `Acc` weight and of its dw): f32, or f64
    /// for F64.
    pub const fn acc(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }
}

/// The weight argument: a device pointer to `cols` elements, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weight {
    /// No weight (`y = x * rstd`).
    None,
    /// Weight of the input dtype.
    Same(u64),
    /// Weight of the accumulation dtype (f32; f64 for F64).
    Acc(u64),
}

impl Weight {
    /// The device pointer, 0 for `None`.
    pub fn ptr(self) -> u64 {
        match self {
            Weight::None => 0,
            Weight::Same(p) | Weight::Acc(p) => p,
        }
    }

    /// The weight's dtype for inputs of `dtype` (`None` without a weight).
    pub fn dtype(self, dtype: DType) -> Option<DType> {
        match self {
            Weight::None => None,
            Weight::Same(_) => Some(dtype),
            Weight::Acc(_) => Some(dtype.acc()),
        }
    }
}

/// How the weight scales the normalized value `xhat = x * rstd`. The default is PyTorch's
/// `_fused_rms_norm`: `y = xhat * w` in the accumulation dtype, rounded once.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WeightMode {
    /// Added to the weight in the accumulation dtype: the kernels scale by `offset + w`
    /// (Gemma's `1 + weight`). Without a weight it is not used.
    pub offset: f64,
    /// Round `xhat` to the input dtype before the weight multiply, as Llama's
    /// `weight * xhat.to(dtype)` does; the backward's dw then sums `dy * round(xhat)` (the
    /// rounding's derivative taken as 1, as autograd does for `.to()`). For float16 and
    /// bfloat16 inputs it needs a weight of their dtype ([`Weight::Same`]): with a wider one
    /// the model's product is wider than the input, which these kernels do not write.
    pub round_first: bool,
}

impl WeightMode {
    /// The offset as the kernels add it: 0 becomes -0.0, which adds exactly nothing
    /// (`w + -0.0 == w` for every `w`, -0 included; `-0.0 + 0.0` would be `+0.0`).
    pub(crate) fn kernel_offset(self) -> f64 {
        if self.offset == 0.0 {
            -0.0
        } else {
            self.offset
        }
    }
}

/// Arguments of [`rms_norm_forward`]. Pointers are device addresses in `device`'s primary
/// context; every tensor is contiguous.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormForward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on (0: the legacy default stream).
    pub stream: usize,
    /// Dtype of `x` and `y`.
    pub dtype: DType,
    /// Input, `rows * cols` of `dtype`.
    pub x: u64,
    /// Weight, `cols` elements.
    pub weight: Weight,
    /// Output, `rows * cols` of `dtype` (may equal `x`).
    pub y: u64,
    /// Output, `rows` of the accumulation dtype.
    pub rstd: u64,
    /// Rows (>= 1).
    pub rows: usize,
    /// Columns, the normalized size (>= 1).
    pub cols: usize,
    /// Added to the mean square before the reciprocal square root.
    pub eps: f64,
    /// How the weight applies (default: PyTorch's `_fused_rms_norm`).
    pub mode: WeightMode,
}

/// Arguments of [`rms_norm_backward`]. Pointers are device addresses in `device`'s primary
/// context; every tensor is contiguous.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on (0: the legacy default stream).
    pub stream: usize,
    /// Dtype of `dy`, `x` and `dx`.
    pub dtype: DType,
    /// Gradient of `y`, `rows * cols` of `dtype`.
    pub dy: u64,
    /// Forward input, `rows * cols` of `dtype`.
    pub x: u64,
    /// Forward `rstd`, `rows` of the accumulation dtype.
    pub rstd: u64,
    /// The forward's weight.
    pub weight: Weight,
    /// Output gradient of `x` (`rows * cols` of `dtype`), if wanted.
    pub dx: Option<u64>,
    /// Output gradient of the weight (`cols` of the weight's dtype), if wanted; needs a
    /// weight.
    pub dw: Option<u64>,
    /// Device scratch for the dw partials (16-byte aligned); unused without `dw`.
    pub workspace: u64,
    /// Bytes available at `workspace` (added to the brief's API so that a short workspace
    /// is an error instead of an out-of-bounds write); see
    /// [`rms_norm_backward_workspace_bytes`].
    pub workspace_bytes: usize,
    /// Rows (>= 1).
    pub rows: usize,
    /// Columns (>= 1).
    pub cols: usize,
    /// How the forward applied the weight (default: PyTorch's `_fused_rms_norm`).
    pub mode: WeightMode,
}
