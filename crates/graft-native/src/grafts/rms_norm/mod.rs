//! RMSNorm grafts: `aten::_fused_rms_norm` and `aten::_fused_rms_norm_backward`.
//!
//! What every device shares lives here: argument checks with ATen's messages, the shapes, dtypes
//! and strides of the outputs (those of ATen's meta function, which torch.compile relies on,
//! computed in Rust by [`crate::common::layout`]), and eps defaults.

mod composite;
pub mod cpu;
pub mod cuda;

use graft_abi::{ensure, DType, DeviceType, Operands, Result, Tensor};

use crate::common::layout::{self, Shape};
use crate::common::tensor::acc_dtype;

/// An RMSNorm call seen as `rows` rows of `cols` normalized elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub rows: usize,
    pub cols: usize,
}

/// Formats sizes the way c10 prints an IntArrayRef: `[3, 4]`.
fn shape(sizes: &[i64]) -> String {
    let items: Vec<String> = sizes.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// ATen's message for a `grad_out` of other sizes than the input (beyond ATen, whose backward is
/// normally fed by autograd: a malformed direct call fails instead of reading out of bounds).
const GRAD_OUT_SIZE: &str = "grad_out of size {got} does not match input of size {want}";

/// Checks a forward call at `kernel` like ATen (`_check_rms_norm_inputs`, dtype and device
/// checks) and returns its geometry.
pub fn check_forward(
    kernel: DeviceType,
    input: &Tensor,
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
) -> Result<Geometry> {
    Operands::new("rms_norm", kernel)
        .tensor("input", input)
        .float()
        .optional("weight", weight)
        .float()
        .check()?;
    check_shapes(input.sizes()?, normalized_shape, weight)
}

/// Checks a backward call at `kernel` and returns its geometry. Beyond what ATen checks (its
/// backward is normally fed by autograd), every tensor's size is verified so that a malformed
/// direct call fails instead of reading out of bounds.
pub fn check_backward(
    kernel: DeviceType,
    (grad_out, input, rstd): (&Tensor, &Tensor, &Tensor),
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
    output_mask: &[bool],
) -> Result<Geometry> {
    check_mask(output_mask)?;
    Operands::new("rms_norm", kernel)
        .tensor("input", input)
        .float()
        .optional("weight", weight)
        .float()
        .tensor("grad_out", grad_out)
        .float()
        .sizes_like("input")
        .message(GRAD_OUT_SIZE)
        .tensor("rstd", rstd)
        .float()
        .check()?;
    let geometry = check_shapes(input.sizes()?, normalized_shape, weight)?;
    check_rstd(rstd, geometry)?;
    Ok(geometry)
}

fn check_mask(output_mask: &[bool]) -> Result<()> {
    ensure!(
        output_mask.len() == 2,
        "output_mask must hold 2 values (grad_input, grad_weight), got {}",
        output_mask.len()
    );
    Ok(())
}

fn check_rstd(rstd: &Tensor, geometry: Geometry) -> Result<()> {
    ensure!(
        rstd.numel()? == geometry.rows,
        "rstd has {} elements, expected one per normalized row ({})",
        rstd.numel()?,
        geometry.rows
    );
    Ok(())
}

/// ATen's message for a dtype its dispatch macro does not cover (a NotImplementedError there).
fn not_implemented(dtype: DType) -> String {
    format!("\"rms_norm\" not implemented for '{dtype}'")
}

/// How the CPU forward computes a call: `Some(geometry)` for the fused kernel, `None` for
/// ATen's composite replayed op by op ([`composite`]).
///
/// Stock PyTorch runs that composite for every CPU call, so it decides what is valid: any float
/// or complex input, normalized_shape read only for its length, any weight that broadcasts. The
/// fused kernel takes the calls autograd and `F.rms_norm` make (a real float input whose trailing
/// dims are normalized_shape, a float weight of that shape); everything else gets the composite.
pub fn plan_forward_cpu(
    input: &Tensor,
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
) -> Result<Option<Geometry>> {
    Operands::new("rms_norm", DeviceType::CPU)
        .tensor("input", input)
        .optional("weight", weight)
        .check()?;
    let dtype = input.dtype()?;
    ensure!(
        dtype.is_float() || composite::computes(dtype),
        "{}",
        not_implemented(dtype)
    );
    let sizes = input.sizes()?;
    let trailing = sizes.len() >= normalized_shape.len()
        && sizes[sizes.len() - normalized_shape.len()..] == *normalized_shape;
    let weight_fits = match weight {
        None => true,
        Some(w) => w.dtype()?.is_float() && w.sizes()? == normalized_shape,
    };
    if dtype.is_float() && !normalized_shape.is_empty() && trailing && weight_fits {
        check_shapes(sizes, normalized_shape, weight).map(Some)
    } else {
        Ok(None)
    }
}

/// The number of trailing dims a CPU call normalizes, as ATen's composite reads normalized_shape:
/// by its length only, and an empty one (or a 0-dim input) means every dim.
pub fn normalized_dims_cpu(input_sizes: &[i64], normalized_shape: &[i64]) -> Result<usize> {
    let (dim, len) = (input_sizes.len(), normalized_shape.len());
    if len == 0 || dim == 0 {
        return Ok(dim);
    }
    ensure!(
        len <= dim,
        "normalized_shape {} has more dims than the input of size {}",
        shape(normalized_shape),
        shape(input_sizes)
    );
    Ok(len)
}

/// Checks a CPU backward call (what autograd passes for any forward the CPU graft accepted) and
/// returns its geometry: rows and columns of the normalized trailing dims.
pub fn check_backward_cpu(
    (grad_out, input, rstd): (&Tensor, &Tensor, &Tensor),
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
    output_mask: &[bool],
) -> Result<(Geometry, usize)> {
    check_mask(output_mask)?;
    Operands::new("rms_norm", DeviceType::CPU)
        .tensor("input", input)
        .float()
        .optional("weight", weight)
        .tensor("grad_out", grad_out)
        .float()
        .sizes_like("input")
        .message(GRAD_OUT_SIZE)
        .tensor("rstd", rstd)
        .float()
        .check()?;
    let sizes = input.sizes()?;
    let dims = normalized_dims_cpu(sizes, normalized_shape)?;
    let product = |sizes: &[i64]| sizes.iter().map(|&s| s as usize).product::<usize>();
    let batch = sizes.len() - dims;
    let geometry = Geometry {
        rows: product(&sizes[..batch]),
        cols: product(&sizes[batch..]),
    };
    check_rstd(rstd, geometry)?;
    Ok((geometry, dims))
}

fn check_shapes(
    input_sizes: &[i64],
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
) -> Result<Geometry> {
    ensure!(
        !normalized_shape.is_empty(),
        "Expected normalized_shape to be at least 1-dimensional, i.e., containing at least one \
         element, but got normalized_shape = {}",
        shape(normalized_shape)
    );
    if let Some(weight) = weight {
        ensure!(
            weight.sizes()? == normalized_shape,
            "Expected weight to be of same shape as normalized_shape, but got weight of shape {} \
             and normalized_shape = {}",
            shape(weight.sizes()?),
            shape(normalized_shape)
        );
    }
    let batch_dims = input_sizes.len().checked_sub(normalized_shape.len());
    let matches = batch_dims.is_some_and(|b| &input_sizes[b..] == normalized_shape);
    if !matches {
        let normalized = shape(normalized_shape);
        return Err(graft_abi::Error::msg(format!(
            "Given normalized_shape={normalized}, expected input with shape [*{}, but got input \
             of size{}",
            &normalized[1..],
            shape(input_sizes)
        )));
    }
    let batch_dims = batch_dims.unwrap_or(0);
    let product = |sizes: &[i64]| sizes.iter().map(|&s| s as usize).product::<usize>();
    Ok(Geometry {
        rows: product(&input_sizes[..batch_dims]),
        cols: product(normalized_shape),
    })
}

/// eps when the call passes None: the machine epsilon of the accumulation type.
pub fn default_eps(dtype: DType) -> f64 {
    if acc_dtype(dtype) == DType::F64 {
        f64::EPSILON
    } else {
        f64::from(f32::EPSILON)
    }
}

/// `t` with the given strides (a copy when its own differ).
fn with_strides(t: Tensor, strides: &[i64]) -> Result<Tensor> {
    if t.strides()? == strides {
        return Ok(t);
    }
    let out = Tensor::empty_strided(t.sizes()?, strides, t.dtype()?, t.device()?)?;
    out.copy_from(&t)?;
    Ok(out)
}

fn shape_of(t: &Tensor) -> Result<Shape<'_>> {
    Ok(Shape {
        sizes: t.sizes()?,
        strides: t.strides()?,
    })
}

/// Whether `t` has torch's contiguous strides and no dim of size 0 or 1. Its RMSNorm outputs
/// are then contiguous: its strides strictly decrease, so they decide every comparison of the
/// meta functions' stride sort (a size-1 dim would tie with its neighbour and let the weight or
/// grad_out decide). The common case, which needs no layout replay.
fn is_plainly_contiguous(t: &Tensor) -> Result<bool> {
    let (sizes, strides) = (t.sizes()?, t.strides()?);
    let mut expected = 1;
    for (&size, &stride) in sizes.iter().zip(strides).rev() {
        if stride != expected || size < 2 {
            return Ok(false);
        }
        expected *= size;
    }
    Ok(true)
}

/// The forward's contiguous outputs (y, rstd) in the layout ATen's meta function gives them,
/// for a call normalizing the trailing `normalized_dims` dims with a weight of their shape.
pub fn in_forward_layout(
    (y, rstd): (Tensor, Tensor),
    input: &Tensor,
    normalized_dims: usize,
    weight: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    if is_plainly_contiguous(input)? {
        return Ok((y, rstd));
    }
    // Each tensor with whether it already has the dtype the meta function computes in.
    let opmath = acc_dtype(input.dtype()?);
    let weight = match weight {
        Some(w) => Some((shape_of(w)?, w.dtype()? == opmath)),
        None => None,
    };
    let (y_strides, rstd_strides) = layout::forward_strides(
        shape_of(input)?,
        normalized_dims,
        weight,
        input.dtype()? == opmath,
    );
    Ok((
        with_strides(y, &y_strides)?,
        with_strides(rstd, &rstd_strides)?,
    ))
}

/// The backward's outputs (dx contiguous) as ATen returns them: dx in the layout ATen's meta
/// function gives it, and an undefined tensor for each gradient that was not wanted.
pub fn in_backward_layout(
    (dx, dw): (Option<Tensor>, Option<Tensor>),
    grad_out: &Tensor,
    input: &Tensor,
    normalized_dims: usize,
    rstd: &Tensor,
    weight: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let dw = dw.map_or_else(Tensor::undefined, Ok)?;
    let Some(dx) = dx else {
        return Ok((Tensor::undefined()?, dw));
    };
    if is_plainly_contiguous(input)? && is_plainly_contiguous(grad_out)? {
        return Ok((dx, dw));
    }
    let opmath = acc_dtype(input.dtype()?);
    let weight = match weight {
        Some(w) => Some((shape_of(w)?, w.dtype()? == opmath)),
        None => None,
    };
    let strides = layout::backward_input_strides(
        shape_of(grad_out)?,
        shape_of(input)?,
        normalized_dims,
        shape_of(rstd)?,
        weight,
        input.dtype()? == opmath,
    );
    Ok((with_strides(dx, &strides)?, dw))
}
