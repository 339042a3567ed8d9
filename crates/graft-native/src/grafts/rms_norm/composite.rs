//! ATen's CPU forward (`rms_norm_composite`) replayed op by op through the dispatcher, for the
//! calls the fused kernel does not take: complex inputs or weights, a normalized_shape that is
//! not the input's trailing shape (ATen reads only its length), weights of other dtypes or
//! shapes that broadcast. The native route cannot call the kernel that was there before, so this
//! is how it keeps computing whatever stock PyTorch computes on CPU: same ops, same order, so
//! the same results, errors, warnings and layouts.
//!
//! Two steps differ in form because the stable ABI cannot pass a Scalar: `pow(x, 2)` is
//! `mul(x, x)` (ATen computes pow by 2 as that product) and `add_(eps)` is done in Rust on the
//! mean, a fresh contiguous tensor.

use graft_abi::{dispatch, DType, Device, Element, NewTensor, Result, Tensor};

use super::{not_implemented, shape_of};
use crate::common::layout;
use crate::common::tensor::{contiguous, to_dtype};

/// Two floats: one complex number, as complex tensors store it.
#[derive(Clone, Copy)]
#[repr(C)]
struct Complex<T>([T; 2]);

impl Element for Complex<f32> {
    const DTYPE: DType = DType::COMPLEX64;
}

impl Element for Complex<f64> {
    const DTYPE: DType = DType::COMPLEX128;
}

/// The complex dtypes ATen's composite computes (its dispatch macro has no ComplexHalf).
pub fn computes(dtype: DType) -> bool {
    matches!(dtype, DType::COMPLEX64 | DType::COMPLEX128)
}

/// The dtype the composite computes in ("opmath"): float32 for the 16-bit floats, else the
/// input's own.
fn opmath(dtype: DType) -> Result<DType> {
    match dtype {
        DType::F16 | DType::BF16 | DType::F32 => Ok(DType::F32),
        DType::F64 | DType::COMPLEX64 | DType::COMPLEX128 => Ok(dtype),
        other => Err(graft_abi::Error::msg(not_implemented(other))),
    }
}

fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (out,): (Tensor,) = dispatch::call(c"aten::mul", c"Tensor", (a, b))?;
    Ok(out)
}

/// `t + eps` for a fresh contiguous CPU tensor of an opmath dtype (to the real part if complex).
fn plus_eps(t: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = t.dtype()?;
    let mut out = NewTensor::empty(t.sizes()?, dtype, Device::CPU)?;
    out.tensor().copy_from(t)?;
    // ATen adds eps as a float for float32 / complex64 (`float eps_val`), as a double otherwise.
    let eps32 = eps as f32;
    match dtype {
        DType::F32 => out
            .as_mut_slice::<f32>()?
            .iter_mut()
            .for_each(|v| *v += eps32),
        DType::F64 => out
            .as_mut_slice::<f64>()?
            .iter_mut()
            .for_each(|v| *v += eps),
        DType::COMPLEX64 => out
            .as_mut_slice::<Complex<f32>>()?
            .iter_mut()
            .for_each(|v| v.0[0] += eps32),
        _ => out
            .as_mut_slice::<Complex<f64>>()?
            .iter_mut()
            .for_each(|v| v.0[0] += eps),
    }
    Ok(out.finish())
}

/// `_fused_rms_norm(input, normalized_shape, weight, eps)` on CPU exactly as ATen's composite
/// computes it, for a normalized_shape of `normalized_dims` entries.
pub fn forward(
    input: &Tensor,
    normalized_dims: usize,
    weight: Option<&Tensor>,
    eps: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    let dtype = input.dtype()?;
    let opmath = opmath(dtype)?;
    let up = to_dtype(input, opmath)?;
    let dim = input.sizes()?.len() as i64;
    let dims: Vec<i64> = (1..=normalized_dims as i64).map(|i| dim - i).collect();
    let squares = mul(&up, &up)?;
    let (mean,): (Tensor,) = dispatch::call(
        c"aten::mean",
        c"dim",
        (&squares, Some(&dims[..]), true, None::<DType>),
    )?;
    // None: the machine epsilon of the real type opmath is made of.
    let eps = eps.unwrap_or(match opmath {
        DType::F64 | DType::COMPLEX128 => f64::EPSILON,
        _ => f64::from(f32::EPSILON),
    });
    let (mut rstd,): (Tensor,) = dispatch::call(c"aten::rsqrt", c"", (plus_eps(&mean, eps)?,))?;
    let mut y = mul(&up, &rstd)?;
    if let Some(weight) = weight {
        y = mul(&y, weight)?;
    }
    if !layout::suggests_channels_last(shape_of(input)?) {
        y = contiguous(&y)?;
        rstd = contiguous(&rstd)?;
    }
    Ok((to_dtype(&y, dtype)?, rstd))
}
