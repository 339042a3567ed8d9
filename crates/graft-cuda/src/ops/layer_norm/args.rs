//! The launch arguments of the layer_norm API and the `#[repr(C)]` parameter blocks of
//! layer_norm.cu's kernels.

#[cfg(doc)]
use super::{layer_norm_backward, layer_norm_backward_workspace_bytes, layer_norm_forward};
use crate::DType;

/// Arguments of [`layer_norm_forward`]: contiguous `rows x cols` `x` and `y`, parameters of
/// `cols` values of `dtype` (0: absent), `mean` and `rstd` of `rows` values of the
/// accumulation dtype. Pointers are device addresses in `device`'s primary context.
#[derive(Clone, Copy, Debug)]
pub struct LayerNormForward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Dtype of `x`, `y`, the weight and the bias.
    pub dtype: DType,
    /// Input.
    pub x: u64,
    /// Weight, or 0.
    pub weight: u64,
    /// Bias, or 0.
    pub bias: u64,
    /// Output.
    pub y: u64,
    /// Output: the rows' means.
    pub mean: u64,
    /// Output: the rows' reciprocal standard deviations.
    pub rstd: u64,
    /// Rows (>= 1).
    pub rows: usize,
    /// Columns (>= 1).
    pub cols: usize,
    /// Added to the variance.
    pub eps: f64,
}

/// Arguments of [`layer_norm_backward`].
#[derive(Clone, Copy, Debug)]
pub struct LayerNormBackward {
    /// CUDA device ordinal.
    pub device: i32,
    /// `CUstream` to launch on.
    pub stream: usize,
    /// Dtype of `dy`, `x`, `dx`, the weight, `dw` and `db`.
    pub dtype: DType,
    /// Gradient of the output.
    pub dy: u64,
    /// The forward's input.
    pub x: u64,
    /// The forward's means (accumulation dtype).
    pub mean: u64,
    /// The forward's rstd (accumulation dtype).
    pub rstd: u64,
    /// The weight, or 0.
    pub weight: u64,
    /// Output: gradient of `x`, if wanted.
    pub dx: Option<u64>,
    /// Output: gradient of the weight (`cols`), if wanted.
    pub dw: Option<u64>,
    /// Output: gradient of the bias (`cols`), if wanted.
    pub db: Option<u64>,
    /// Device scratch for the partial rows (16-byte aligned), with dw or db.
    pub workspace: u64,
    /// Bytes at `workspace`; see [`layer_norm_backward_workspace_bytes`].
    pub workspace_bytes: usize,
    /// Rows (>= 1).
    pub rows: usize,
    /// Columns (>= 1).
    pub cols: usize,
}

/// `graft_layer_norm::Params` (every field 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct LayerNormParams {
    pub(super) x: u64,
    pub(super) w: u64,
    pub(super) b: u64,
    pub(super) y: u64,
    pub(super) mean: u64,
    pub(super) rstd: u64,
    pub(super) dy: u64,
    pub(super) dx: u64,
    pub(super) partial: u64,
    pub(super) rows: i64,
    pub(super) cols: i64,
    pub(super) tpr: i64,
    pub(super) rpb: i64,
    pub(super) vec: i64,
    pub(super) stage: i64,
    pub(super) eps: f64,
    pub(super) inv_cols: f64,
}

/// `graft_layer_norm::FinalizeParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct FinalizeParams {
    pub(super) partial: u64,
    pub(super) dw: u64,
    pub(super) db: u64,
    pub(super) nparts: i64,
    pub(super) cols: i64,
}
