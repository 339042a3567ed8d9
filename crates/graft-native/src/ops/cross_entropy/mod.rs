//! Cross-entropy: `torchgraft::cross_entropy` (the loss and, in the same pass over the logits,
//! its gradient), `cross_entropy_` (the gradient written over the logits), and the backward's
//! `scale_grad` / `scale_grad_` (a saved gradient times the upstream gradient), on CPU
//! (graft-kernels) and CUDA (graft-cuda).
//!
//! Semantics: `F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...,
//! label_smoothing=...)` for 2-D logits `(N, V)` and targets `(N,)`; the loss is float32 (float64
//! for float64 logits). The gradient is the loss's (before the upstream gradient), in the logits'
//! dtype. The row work is shared with `linear_cross_entropy` through [`cpu::rows_cpu`] and
//! [`cuda::rows_cuda`].

pub mod cpu;
pub mod cuda;

use graft_abi::{
    contiguous_strides, ensure, DType, DeviceType, Error, Kernel, NewTensor, Operands, Result,
    Tensor,
};
use graft_kernels::ops::cross_entropy::{BadTarget, Options};
use half::{bf16, f16};

use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, filled, to_dtype, unsupported};
use cpu::scale_cpu_typed;
use cuda::scale_cuda;

pub static SCALE_GRAD_CPU: Counters = Counters::new();
pub static SCALE_GRAD_CUDA: Counters = Counters::new();
pub static SCALE_GRAD_INPLACE_CPU: Counters = Counters::new();
pub static SCALE_GRAD_INPLACE_CUDA: Counters = Counters::new();

/// ATen's `Reduction` enum values, as the schemas take them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduction {
    None,
    Mean,
    Sum,
}

impl Reduction {
    pub(crate) fn from_i64(op: &str, r: i64) -> Result<Reduction> {
        match r {
            0 => Ok(Reduction::None),
            1 => Ok(Reduction::Mean),
            2 => Ok(Reduction::Sum),
            _ => Err(Error::msg(format!(
                "{op}: {r} is not a valid value for reduction (0: none, 1: mean, 2: sum)"
            ))),
        }
    }
}

/// The loss's parameters, checked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loss {
    pub ignore_index: i64,
    pub reduction: Reduction,
    /// In `[0, 1]` (negative values mean none, as in ATen).
    pub smoothing: f64,
}

impl Loss {
    pub(crate) fn new(op: &str, ignore_index: i64, reduction: i64, smoothing: f64) -> Result<Loss> {
        ensure!(
            smoothing <= 1.0,
            "label_smoothing must be between 0.0 and 1.0. Got: {smoothing}"
        );
        Ok(Loss {
            ignore_index,
            reduction: Reduction::from_i64(op, reduction)?,
            // ATen applies no smoothing for negative values (and NaN compares false).
            smoothing: if smoothing > 0.0 { smoothing } else { 0.0 },
        })
    }

    fn options(&self, cols: usize) -> Options {
        Options {
            cols,
            ignore_index: self.ignore_index,
            smoothing: self.smoothing,
        }
    }
}

/// The device type a kernel of this device flag computes on.
pub(crate) fn kernel_device(cuda: bool) -> DeviceType {
    if cuda {
        DeviceType::CUDA
    } else {
        DeviceType::CPU
    }
}

/// Checks `(N, V)` logits (written by the in-place op, which needs them contiguous) and their
/// `(N,)` target as ATen checks `cross_entropy`'s; returns `(N, V)`.
pub(crate) fn check_logits(
    op: &str,
    kernel: DeviceType,
    logits: &Tensor,
    target: &Tensor,
    in_place: bool,
) -> Result<(usize, usize)> {
    let sizes = logits.sizes()?;
    let rows = if sizes.len() == 2 { sizes[0] } else { 0 };
    let operands = if in_place {
        Operands::new(op, kernel)
            .written("logits", logits)
            .contiguous()
            .message("{op}: the logits must be contiguous to take the gradient in place")
    } else {
        Operands::new(op, kernel).tensor("logits", logits)
    };
    let operands = operands
        .float()
        .dims(2)
        .message("{op}: expected 2-D logits (N, V), got {got} dimensions");
    with_target(operands, target, rows).check()?;
    Ok((sizes[0] as usize, sizes[1] as usize))
}

/// `operands` and a `(rows,)` int64 target on the call's device, with ATen's messages.
pub(crate) fn with_target<'a>(
    operands: Operands<'a>,
    target: &'a Tensor,
    rows: i64,
) -> Operands<'a> {
    operands
        .tensor("target", target)
        .dtype(DType::I64)
        .message("expected target dtype to be Long or Byte, but got {got}")
        .dims(1)
        .message("{op}: expected a 1-D target, got {got} dimensions")
        .size(0, rows)
        .message("Expected input batch_size ({want}) to match target batch_size ({got}).")
}

fn bad_target(e: BadTarget) -> Error {
    Error::msg(format!("Target {} is out of bounds.", e.0))
}

/// The loss of a row of no classes (ignored, as every such row must be): 0, or with label
/// smoothing NaN, as ATen divides the smoothing term by the number of classes.
pub(crate) fn empty_row_loss(loss: &Loss) -> f64 {
    if loss.smoothing > 0.0 {
        f64::NAN
    } else {
        0.0
    }
}

/// The reduced loss `out` of a call over `cols` classes: with no classes and label smoothing
/// NaN whatever the rows (ATen multiplies the smoothing term by `smoothing / 0`).
fn without_classes(out: Tensor, loss: &Loss, cols: usize) -> Result<Tensor> {
    if cols > 0 || loss.smoothing <= 0.0 || loss.reduction == Reduction::None {
        return Ok(out);
    }
    filled(&[], out.dtype()?, out.device()?, f64::NAN)
}

/// `1 / valid` for a mean, else 1.
pub(crate) fn grad_scale(reduction: Reduction, valid: usize) -> f64 {
    if reduction == Reduction::Mean {
        1.0 / valid as f64
    } else {
        1.0
    }
}

/// A new contiguous copy of `t`: memory no other argument can share (for the small read-only
/// arguments of in-place kernels, which then cannot alias the tensor being written).
fn private_copy(t: &Tensor) -> Result<Tensor> {
    let sizes = t.sizes()?;
    let out = Tensor::empty_strided(sizes, &contiguous_strides(sizes), t.dtype()?, t.device()?)?;
    out.copy_from(t)?;
    Ok(out)
}

/// Checks `grad` (written by the in-place op, which needs it contiguous) and `grad_output`
/// for [`scale_grad`]: 0-dim (one factor), or `(rows,)` for a gradient of `rows` rows (one
/// factor per row). Returns whether it is per row, and the factors converted to `grad`'s
/// accumulation dtype.
fn check_scale(
    op: &str,
    kernel: DeviceType,
    grad: &Tensor,
    grad_output: &Tensor,
    in_place: bool,
) -> Result<(bool, Tensor)> {
    let operands = if in_place {
        Operands::new(op, kernel)
            .written("grad", grad)
            .contiguous()
            .message("{op}: the gradient must be contiguous")
    } else {
        Operands::new(op, kernel).tensor("grad", grad)
    };
    let dtype = operands
        .float()
        .tensor("grad_output", grad_output)
        .float()
        .check()?
        .dtype;
    let gs = grad.sizes()?;
    let os = grad_output.sizes()?;
    let per_row = match os.len() {
        0 => false,
        1 if !gs.is_empty() && os[0] == gs[0] => true,
        _ => {
            return Err(Error::msg(format!(
                "{op}: grad_output of size {os:?} does not fit a gradient of size {gs:?} (a \
                 scalar, or one value per row)"
            )))
        }
    };
    // A private copy (a scalar or one value per row): it cannot share memory with `grad`.
    let factors = private_copy(&to_dtype(grad_output, acc_dtype(dtype))?)?;
    Ok((per_row, factors))
}

/// Row length of `grad` for per-row factors (its elements over its first dimension).
fn row_len(grad: &Tensor) -> Result<usize> {
    let sizes = grad.sizes()?;
    let rows = sizes.first().copied().unwrap_or(1).max(1) as usize;
    Ok(grad.numel()? / rows)
}

/// `grad * grad_output` as a new tensor.
fn scale_grad(kernel: DeviceType, grad: &Tensor, grad_output: &Tensor) -> Result<Tensor> {
    let (per_row, factors) = check_scale("scale_grad", kernel, grad, grad_output, false)?;
    let g = contiguous(grad)?;
    let (dtype, device) = (g.dtype()?, g.device()?);
    let mut out = NewTensor::empty(g.sizes()?, dtype, device)?;
    if device.kind == DeviceType::CUDA {
        let out = out.finish();
        scale_cuda(&g, &out, &factors, per_row)?;
        return Ok(out);
    }
    macro_rules! typed {
        ($t:ty) => {
            scale_cpu_typed::<$t>(&g, Some(out.as_mut_slice()?), None, &factors, per_row)?
        };
    }
    match dtype {
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        DType::BF16 => typed!(bf16),
        DType::F16 => typed!(f16),
        other => return Err(unsupported("scale_grad", other)),
    }
    Ok(out.finish())
}

/// `grad *= grad_output` in place; elements whose factor is exactly 1 are not touched.
fn scale_grad_(kernel: DeviceType, mut grad: Tensor, grad_output: &Tensor) -> Result<()> {
    let (per_row, factors) = check_scale("scale_grad_", kernel, &grad, grad_output, true)?;
    let (dtype, device) = (grad.dtype()?, grad.device()?);
    if device.kind == DeviceType::CUDA {
        return scale_cuda(&grad, &grad, &factors, per_row);
    }
    let src = grad.new_ref()?;
    macro_rules! typed {
        ($t:ty) => {
            scale_cpu_typed::<$t>(&src, None, Some(&mut grad), &factors, per_row)
        };
    }
    match dtype {
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        DType::BF16 => typed!(bf16),
        DType::F16 => typed!(f16),
        other => Err(unsupported("scale_grad_", other)),
    }
}

/// `torchgraft::scale_grad` at CPU and CUDA (the device is the tensors').
pub struct ScaleGradKernel<const CUDA: bool>;

impl<const CUDA: bool> Kernel for ScaleGradKernel<CUDA> {
    type Args = (Tensor, Tensor);
    type Outputs = (Tensor,);
    fn run((grad, grad_output): Self::Args) -> Result<(Tensor,)> {
        if CUDA {
            SCALE_GRAD_CUDA.call();
        } else {
            SCALE_GRAD_CPU.call();
        }
        Ok((scale_grad(kernel_device(CUDA), &grad, &grad_output)?,))
    }
}

/// `torchgraft::scale_grad_` at CPU and CUDA.
pub struct ScaleGradInPlaceKernel<const CUDA: bool>;

impl<const CUDA: bool> Kernel for ScaleGradInPlaceKernel<CUDA> {
    type Args = (Tensor, Tensor);
    type Outputs = ();
    fn run((grad, grad_output): Self::Args) -> Result<()> {
        if CUDA {
            SCALE_GRAD_INPLACE_CUDA.call();
        } else {
            SCALE_GRAD_INPLACE_CPU.call();
        }
        scale_grad_(kernel_device(CUDA), grad, &grad_output)
    }
}
