//! RMSNorm grafts: `aten::_fused_rms_norm` and `aten::_fused_rms_norm_backward`.
//!
//! What every device shares lives here: argument checks with ATen's messages, the shapes, dtypes
//! and strides of the outputs (those of ATen's meta function, which torch.compile relies on),
//! and eps defaults.

pub mod cpu;
pub mod cuda;

use std::sync::LazyLock;

use graft_abi::{contiguous_strides, dispatch, ensure, DType, Device, Result, Tensor};

use crate::layout::{LayoutCache, Signature};

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

/// Checks a forward call like ATen (`_check_rms_norm_inputs`, dtype and device checks) and
/// returns its geometry.
pub fn check_forward(
    input: &Tensor,
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
) -> Result<Geometry> {
    check_dtype(input.dtype()?)?;
    if let Some(weight) = weight {
        check_same_device(input, weight)?;
        check_dtype(weight.dtype()?)?;
    }
    check_shapes(input.sizes()?, normalized_shape, weight)
}

/// Checks a backward call and returns its geometry. Beyond what ATen checks (its backward is
/// normally fed by autograd), every tensor's size is verified so that a malformed direct call
/// fails instead of reading out of bounds.
pub fn check_backward(
    grad_out: &Tensor,
    input: &Tensor,
    normalized_shape: &[i64],
    rstd: &Tensor,
    weight: Option<&Tensor>,
    output_mask: &[bool],
) -> Result<Geometry> {
    ensure!(
        output_mask.len() == 2,
        "output_mask must hold 2 values (grad_input, grad_weight), got {}",
        output_mask.len()
    );
    let geometry = check_forward(input, normalized_shape, weight)?;
    check_same_device(input, grad_out)?;
    check_same_device(input, rstd)?;
    check_dtype(grad_out.dtype()?)?;
    check_dtype(rstd.dtype()?)?;
    ensure!(
        grad_out.sizes()? == input.sizes()?,
        "grad_out of size {} does not match input of size {}",
        shape(grad_out.sizes()?),
        shape(input.sizes()?)
    );
    ensure!(
        rstd.numel()? == geometry.rows,
        "rstd has {} elements, expected one per normalized row ({})",
        rstd.numel()?,
        geometry.rows
    );
    Ok(geometry)
}

fn check_dtype(dtype: DType) -> Result<()> {
    ensure!(
        dtype.is_float(),
        "\"rms_norm\" not implemented for '{dtype}'"
    );
    Ok(())
}

fn check_same_device(a: &Tensor, b: &Tensor) -> Result<()> {
    let (da, db) = (a.device()?, b.device()?);
    ensure!(
        da == db,
        "Expected all tensors to be on the same device, but found at least two devices, {da} and {db}!"
    );
    Ok(())
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

/// The dtype RMSNorm accumulates in and returns rstd in: float64 for float64, else float32.
pub fn acc_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// eps when the call passes None: the machine epsilon of the accumulation type.
pub fn default_eps(dtype: DType) -> f64 {
    if acc_dtype(dtype) == DType::F64 {
        f64::EPSILON
    } else {
        f64::from(f32::EPSILON)
    }
}

/// rstd's sizes: the batch dims, then a 1 for each normalized dim.
pub fn rstd_sizes(input_sizes: &[i64], normalized_dims: usize) -> Vec<i64> {
    let batch = input_sizes.len() - normalized_dims;
    input_sizes[..batch]
        .iter()
        .copied()
        .chain(std::iter::repeat_n(1, normalized_dims))
        .collect()
}

/// A contiguous tensor with `t`'s values: `t` itself when it already is one.
pub fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous()? {
        return t.new_ref();
    }
    let sizes = t.sizes()?;
    let out = Tensor::empty_strided(sizes, &contiguous_strides(sizes), t.dtype()?, t.device()?)?;
    out.copy_from(t)?;
    Ok(out)
}

/// `t` converted to `dtype` (a copy through `aten::_to_copy`; `t` itself when it has it).
pub fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype()? == dtype {
        return t.new_ref();
    }
    let none = None::<i64>;
    let (out,): (Tensor,) = dispatch::call(
        c"aten::_to_copy",
        c"",
        (t, Some(dtype), none, none, None::<bool>, false, none),
    )?;
    Ok(out)
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

fn meta_like(t: &Tensor) -> Result<Tensor> {
    Tensor::empty_strided(t.sizes()?, t.strides()?, t.dtype()?, Device::META)
}

static LAYOUTS: LazyLock<LayoutCache> = LazyLock::new(LayoutCache::new);

/// The forward's contiguous outputs (y, rstd) in the layout ATen's meta function gives them.
pub fn in_forward_layout(
    (y, rstd): (Tensor, Tensor),
    input: &Tensor,
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
    eps: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    match forward_strides(input, normalized_shape, weight, eps)? {
        None => Ok((y, rstd)),
        Some((y_strides, rstd_strides)) => Ok((
            with_strides(y, &y_strides)?,
            with_strides(rstd, &rstd_strides)?,
        )),
    }
}

/// The backward's outputs (dx contiguous) as ATen returns them: dx in the layout ATen's meta
/// function gives it, and an undefined tensor for each gradient that was not wanted.
pub fn in_backward_layout(
    (dx, dw): (Option<Tensor>, Option<Tensor>),
    grad_out: &Tensor,
    input: &Tensor,
    normalized_shape: &[i64],
    rstd: &Tensor,
    weight: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let dw = dw.map_or_else(Tensor::undefined, Ok)?;
    let Some(dx) = dx else {
        return Ok((Tensor::undefined()?, dw));
    };
    let dx = match backward_input_strides(grad_out, input, normalized_shape, rstd, weight)? {
        None => dx,
        Some(strides) => with_strides(dx, &strides)?,
    };
    Ok((dx, dw))
}

/// Strides of the forward's outputs (y, rstd) as ATen's meta function gives them, or None when
/// they are contiguous (always so for a contiguous input).
fn forward_strides(
    input: &Tensor,
    normalized_shape: &[i64],
    weight: Option<&Tensor>,
    eps: Option<f64>,
) -> Result<Option<(Vec<i64>, Vec<i64>)>> {
    if input.is_contiguous()? {
        return Ok(None);
    }
    let signature = Signature::new(0)
        .tensor(Some(input))?
        .tensor(weight)?
        .ints(normalized_shape);
    let ask_meta = || -> Result<Vec<Vec<i64>>> {
        let weight = weight.map(meta_like).transpose()?;
        let (y, rstd): (Tensor, Tensor) = dispatch::call(
            c"aten::_fused_rms_norm",
            c"",
            (meta_like(input)?, normalized_shape, weight, eps),
        )?;
        Ok(vec![y.strides()?.to_vec(), rstd.strides()?.to_vec()])
    };
    let sizes = input.sizes()?;
    let contiguous = || {
        vec![
            contiguous_strides(sizes),
            contiguous_strides(&rstd_sizes(sizes, normalized_shape.len())),
        ]
    };
    let mut strides = LAYOUTS.strides(signature, ask_meta, contiguous);
    let rstd = strides.pop().unwrap_or_default();
    let y = strides.pop().unwrap_or_default();
    Ok(Some((y, rstd)))
}

/// Strides of the backward's grad_input as ATen's meta function gives them, or None when they
/// are contiguous (always so when grad_out and input are).
fn backward_input_strides(
    grad_out: &Tensor,
    input: &Tensor,
    normalized_shape: &[i64],
    rstd: &Tensor,
    weight: Option<&Tensor>,
) -> Result<Option<Vec<i64>>> {
    if input.is_contiguous()? && grad_out.is_contiguous()? {
        return Ok(None);
    }
    let signature = Signature::new(1)
        .tensor(Some(grad_out))?
        .tensor(Some(input))?
        .tensor(Some(rstd))?
        .tensor(weight)?
        .ints(normalized_shape);
    let ask_meta = || -> Result<Vec<Vec<i64>>> {
        let weight = weight.map(meta_like).transpose()?;
        let (dx, _dw): (Tensor, Tensor) = dispatch::call(
            c"aten::_fused_rms_norm_backward",
            c"",
            (
                meta_like(grad_out)?,
                meta_like(input)?,
                normalized_shape,
                meta_like(rstd)?,
                weight,
                &[true, false][..],
            ),
        )?;
        Ok(vec![dx.strides()?.to_vec()])
    };
    let contiguous = || vec![contiguous_strides(input.sizes().unwrap_or_default())];
    Ok(LAYOUTS.strides(signature, ask_meta, contiguous).pop())
}
