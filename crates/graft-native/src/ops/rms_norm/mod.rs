//! RMSNorm with a model's own numerics: `torchgraft::rms_norm` and `torchgraft::rms_norm_backward`,
//! one kernel each way, on CPU (graft-kernels) and CUDA (graft-cuda).
//!
//! `x` is normalized over its last dim: `rstd = 1 / sqrt(mean(x^2) + eps)` and `xhat = x * rstd`
//! in the accumulation dtype (float32, float64 for float64 `x`). With a weight, `xhat` is scaled
//! by `offset + weight` (added in the accumulation dtype), and
//! - `cast_before_weight`: `xhat` is rounded to `x`'s dtype first (Llama's
//!   `weight * xhat.to(dtype)`), the product rounded to `x`'s dtype;
//! - else the product is rounded once (Gemma's `(xhat * (1 + weight.float())).to(dtype)`, OLMo2's
//!   `(weight * xhat).to(dtype)`).
//!
//! `y` has `x`'s dtype. In the Llama form the eager expression returns the promoted dtype of
//! weight and `x`; a weight that promotes `x` (a float32 weight under a bfloat16 `x`) is refused
//! here (torchgraft.functional.rms_norm computes that case in two steps).
//!
//! The backward is `_fused_rms_norm_backward`'s with `offset + weight` as the weight; dw, in the
//! weight's dtype, sums `dy * xhat` (`dy * round(xhat)` in the Llama form: the rounding's
//! derivative is 1, as autograd takes `.to()`'s) in the accumulation dtype, in a fixed order.
//! Gradients not asked for come back as empty (0-element) tensors.

pub mod cpu;
pub mod cuda;

use graft_abi::{ensure, DType, Device, DeviceType, NewTensor, Operands, Result, Tensor};

/// Whether the eager `weight * xhat.to(x_dtype)` keeps `x`'s dtype (type promotion among the
/// floating types: the wider one wins, float16 with bfloat16 gives float32).
fn keeps_dtype(x: DType, weight: DType) -> bool {
    x == weight || x == DType::F64 || (x == DType::F32 && weight != DType::F64)
}

/// A call's rows (the product of all dims but the last) and columns (the last dim).
#[derive(Clone, Copy, Debug)]
struct Geometry {
    rows: usize,
    cols: usize,
}

/// The backward's extra operands: the output gradient and the forward's rstd.
struct Saved<'a> {
    grad: &'a Tensor,
    rstd: &'a Tensor,
}

/// Checks the operands as `F.rms_norm(x, [x.shape[-1]], weight)` would, plus the dtype rule of
/// the Llama form and, for the backward, `grad` and `rstd` against `x`; returns the geometry.
fn check(
    op: &str,
    kernel: DeviceType,
    x: &Tensor,
    weight: Option<&Tensor>,
    cast_before_weight: bool,
    saved: Option<Saved<'_>>,
) -> Result<Geometry> {
    let sizes = x.sizes()?;
    let Some((&cols, batch)) = sizes.split_last() else {
        return Err(graft_abi::Error::msg(format!(
            "{op}: expected an input with at least 1 dimension (normalized over the last), got a \
             0-dim tensor"
        )));
    };
    let rows = batch.iter().product::<i64>();
    let (grad, rstd) = (
        saved.as_ref().map(|s| s.grad),
        saved.as_ref().map(|s| s.rstd),
    );
    let dtype = Operands::new(op, kernel)
        .tensor("x", x)
        .float()
        .optional("weight", weight)
        .float()
        .sizes(&[cols])
        .message(
            "Expected weight to be of same shape as normalized_shape, but got weight of shape \
             {got} and normalized_shape = {want}",
        )
        .optional("grad", grad)
        .float()
        .sizes_like("x")
        .message("{op}: grad of size {got} does not match input of size {want}")
        .optional("rstd", rstd)
        .float()
        .numel(rows)
        .message("{op}: rstd has {got} elements, expected one per normalized row ({want})")
        .check()?
        .dtype;
    if let Some(w) = weight {
        let wdtype = w.dtype()?;
        ensure!(
            !cast_before_weight || keeps_dtype(dtype, wdtype),
            "{op}: with cast_before_weight, a {wdtype} weight times a {dtype} input is not {dtype}; \
             this op returns the input's dtype (torchgraft.functional.rms_norm computes this case)"
        );
    }
    Ok(Geometry {
        rows: rows as usize,
        cols: cols as usize,
    })
}

/// Checks the backward's arguments: the forward's, and `grad` and `rstd`.
fn check_backward(
    kernel: DeviceType,
    (grad, x, rstd): (&Tensor, &Tensor, &Tensor),
    weight: Option<&Tensor>,
    cast_before_weight: bool,
    output_mask: &[bool],
) -> Result<Geometry> {
    const OP: &str = "rms_norm_backward";
    ensure!(
        output_mask.len() == 2,
        "{OP}: output_mask must hold 2 values (grad_input, grad_weight), got {}",
        output_mask.len()
    );
    let saved = Saved { grad, rstd };
    check(OP, kernel, x, weight, cast_before_weight, Some(saved))
}

/// rstd's sizes: `x`'s without the last dim.
fn rstd_sizes(x: &Tensor) -> Result<Vec<i64>> {
    let sizes = x.sizes()?;
    Ok(sizes[..sizes.len() - 1].to_vec())
}

/// The gradient not asked for: an empty tensor.
fn skipped(dtype: DType, device: Device) -> Result<Tensor> {
    Ok(NewTensor::empty(&[0], dtype, device)?.finish())
}
