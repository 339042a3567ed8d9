//! RMSNorm's arguments: the weight, how it applies, and the forward and backward launches.

#[cfg(doc)]
use super::{rms_norm_backward, rms_norm_backward_workspace_bytes, rms_norm_forward};
use crate::DType;

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
