//! The launch arguments of the softmax API and the `#[repr(C)]` parameter blocks of
//! softmax.cu's kernels.

#[cfg(doc)]
use super::{softmax_backward, softmax_forward};
use crate::DType;

/// Arguments of [`softmax_forward`]: contiguous `outer x dim x inner` tensors, reduced over
/// `dim`. Pointers are device addresses in `device`'s primary context.
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxForward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Log-softmax instead of softmax.
    pub log: bool,
    /// Dtype of `x`.
    pub input: DType,
    /// Dtype of `y`: `input`, or F32 for an F16 input (`half_to_float`).
    pub output: DType,
    /// Input.
    pub x: u64,
    /// Output.
    pub y: u64,
    /// Product of the sizes before the reduced dim.
    pub outer: usize,
    /// Size of the reduced dim.
    pub dim: usize,
    /// Product of the sizes after it.
    pub inner: usize,
}

/// Arguments of [`softmax_backward`], laid out like [`SoftmaxForward`]'s.
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Log-softmax instead of softmax.
    pub log: bool,
    /// Dtype of `dy` and `y`.
    pub grad: DType,
    /// Dtype of `dx`: `grad`, or F16 for an F32 grad (the backward of `half_to_float`).
    pub grad_input: DType,
    /// Gradient of the output.
    pub dy: u64,
    /// The forward's output.
    pub y: u64,
    /// Output: gradient of the input.
    pub dx: u64,
    /// Product of the sizes before the reduced dim.
    pub outer: usize,
    /// Size of the reduced dim.
    pub dim: usize,
    /// Product of the sizes after it.
    pub inner: usize,
}

/// `graft_softmax::Params` of softmax.cu (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SoftmaxParams {
    pub(super) in0: u64,
    pub(super) in1: u64,
    pub(super) out: u64,
    pub(super) outer: i64,
    pub(super) dim: i64,
    pub(super) inner: i64,
    pub(super) tpr: i64,
    pub(super) rpb: i64,
    pub(super) vec: i64,
    pub(super) log: i64,
    pub(super) stage: i64,
}
