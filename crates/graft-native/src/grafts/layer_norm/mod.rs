//! LayerNorm grafts: `aten::native_layer_norm` and `aten::native_layer_norm_backward`, at CPU
//! and CUDA.
//!
//! What every device shares lives here: ATen's argument checks and messages
//! (`_check_layer_norm_inputs`, CPU's mixed-dtype rules), the shape of mean and rstd (the batch
//! dims, then a 1 per normalized dim), and small tensor helpers. Outputs are contiguous, as
//! ATen's kernels and meta functions give them.

pub mod cpu;
pub mod cuda;

use graft_abi::{ensure, DType, DeviceType, Operands, Result, Tensor};

use crate::common::layout::rstd_sizes;
use crate::common::tensor::{contiguous, to_dtype};

/// `(input, normalized_shape, weight, bias, eps)`.
pub type ForwardArgs = (Tensor, Vec<i64>, Option<Tensor>, Option<Tensor>, f64);
/// `(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)`.
pub type BackwardArgs = (
    Tensor,
    Tensor,
    Vec<i64>,
    Tensor,
    Tensor,
    Option<Tensor>,
    Option<Tensor>,
    Vec<bool>,
);

/// Formats sizes the way c10 prints an IntArrayRef: `[3, 4]`.
fn shape_text(sizes: &[i64]) -> String {
    let items: Vec<String> = sizes.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// ATen's `_check_layer_norm_inputs`: `(rows, cols)` of a valid call, else its message.
pub fn check_inputs(
    input: &Tensor,
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<(usize, usize)> {
    ensure!(
        !normalized_shape.is_empty(),
        "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one \
         element, but got normalized_shape = {}",
        shape_text(normalized_shape)
    );
    for (name, t) in [("weight", weight), ("bias", bias)] {
        if let Some(t) = t {
            ensure!(
                t.sizes()? == normalized_shape,
                "Expected {name} to be of same shape as normalized_shape, but got {name} of shape \
                 {} and normalized_shape = {}",
                shape_text(t.sizes()?),
                shape_text(normalized_shape)
            );
        }
    }
    let sizes = input.sizes()?;
    let batch = sizes.len().checked_sub(normalized_shape.len());
    if batch.is_none_or(|b| &sizes[b..] != normalized_shape) {
        let dims: String = normalized_shape.iter().map(|s| format!(", {s}")).collect();
        return Err(graft_abi::Error::msg(format!(
            "Given normalized_shape={}, expected input with shape [*{dims}], but got input of \
             size{}",
            shape_text(normalized_shape),
            shape_text(sizes)
        )));
    }
    let batch = batch.unwrap_or(0);
    let product = |s: &[i64]| s.iter().map(|&v| v as usize).product::<usize>();
    Ok((product(&sizes[..batch]), product(&sizes[batch..])))
}

/// The backward's extra operands: the output gradient and the forward's statistics.
pub struct Saved<'a> {
    pub grad_out: &'a Tensor,
    pub mean: &'a Tensor,
    pub rstd: &'a Tensor,
}

/// Checks that every operand is on one device, of the kernel's type (ATen's message for
/// tensors on two devices). Dtypes and sizes are checked where ATen checks them, in its order
/// ([`check_inputs`] and the kernels).
pub fn check_devices(
    kernel: DeviceType,
    input: &Tensor,
    (weight, bias): (Option<&Tensor>, Option<&Tensor>),
    saved: Option<Saved<'_>>,
) -> Result<()> {
    Operands::new("layer_norm", kernel)
        .tensor("input", input)
        .optional("weight", weight)
        .optional("bias", bias)
        .optional("grad_out", saved.as_ref().map(|s| s.grad_out))
        .optional("mean", saved.as_ref().map(|s| s.mean))
        .optional("rstd", saved.as_ref().map(|s| s.rstd))
        .check()?;
    Ok(())
}

/// The message of a typed data access that finds another dtype.
pub fn expect_dtype(want: DType, found: DType) -> Result<()> {
    ensure!(
        want == found,
        "expected scalar type {want} but found {found}"
    );
    Ok(())
}

/// ATen's message for a dtype its dispatch macro does not cover (a NotImplementedError there).
pub fn not_implemented(kernel: &str, dtype: DType) -> graft_abi::Error {
    graft_abi::Error::msg(format!("\"{kernel}\" not implemented for '{dtype}'"))
}

/// The shape of mean and rstd: the batch dims, then a 1 per normalized dim.
pub fn stat_sizes(input_sizes: &[i64], normalized_dims: usize) -> Vec<i64> {
    rstd_sizes(input_sizes, normalized_dims)
}

/// `t` converted to `dtype` and made contiguous (`t` itself when it already is both).
pub fn contiguous_as(t: &Tensor, dtype: DType) -> Result<Tensor> {
    contiguous(&to_dtype(t, dtype)?)
}

/// The error ATen raises when a gradient is asked for a parameter that is absent (it allocates
/// the gradient like the undefined parameter).
pub fn missing_parameter() -> graft_abi::Error {
    graft_abi::Error::msg("tensor does not have a device")
}

/// `output_mask` as three flags, with a message for a malformed list.
pub fn mask3(mask: &[bool]) -> Result<[bool; 3]> {
    match mask {
        &[a, b, c] => Ok([a, b, c]),
        _ => Err(graft_abi::Error::msg(format!(
            "output_mask must hold 3 values (grad_input, grad_weight, grad_bias), got {}",
            mask.len()
        ))),
    }
}
