//! RMSNorm on CPU: the Rust kernels of graft-kernels, run on torch's thread pool.
//!
//! PyTorch has no fused CPU RMSNorm (CPU runs a ~7-pass composite). Registering these kernels at
//! the CPU key also switches CPU autograd from the composite to aten's derivative formula, which
//! calls `_fused_rms_norm_backward`: both ops are grafted together.

use graft_abi::{DType, Device, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::{convert, rms_norm, Float};
use half::{bf16, f16};

use super::{
    acc_dtype, check_backward, check_forward, contiguous, default_eps, in_backward_layout,
    in_forward_layout, rstd_sizes, to_dtype, Geometry,
};
use crate::stats::Counters;
use crate::threads::TorchPool;

/// Calls of the forward graft.
pub static FORWARD: Counters = Counters::new();
/// Calls of the backward graft.
pub static BACKWARD: Counters = Counters::new();

/// The accumulation types (f32, f64), with the conversions this module needs.
trait AccValue: Element + graft_kernels::Acc {
    fn of_f64(v: f64) -> Self;
    fn of_f32(v: f32) -> Self;
}

impl AccValue for f32 {
    fn of_f64(v: f64) -> f32 {
        v as f32
    }
    fn of_f32(v: f32) -> f32 {
        v
    }
}

impl AccValue for f64 {
    fn of_f64(v: f64) -> f64 {
        v
    }
    fn of_f32(v: f32) -> f64 {
        f64::from(v)
    }
}

/// A weight's values in the accumulation type of inputs of type `T`. The weight normally has
/// `T`'s dtype (vectorized conversion); direct calls may pass any float dtype.
fn weight_as_acc<T>(weight: &Tensor) -> Result<Vec<T::Acc>>
where
    T: Float + Element,
    T::Acc: AccValue,
{
    let w = contiguous(weight)?;
    Ok(match w.dtype()? {
        d if d == T::DTYPE => convert::to_acc_vec(w.as_slice::<T>()?),
        DType::F32 => w
            .as_slice::<f32>()?
            .iter()
            .map(|&v| T::Acc::of_f32(v))
            .collect(),
        DType::F64 => w
            .as_slice::<f64>()?
            .iter()
            .map(|&v| T::Acc::of_f64(v))
            .collect(),
        DType::BF16 => w
            .as_slice::<bf16>()?
            .iter()
            .map(|&v| T::Acc::of_f32(v.to_acc()))
            .collect(),
        DType::F16 => w
            .as_slice::<f16>()?
            .iter()
            .map(|&v| T::Acc::of_f32(v.to_acc()))
            .collect(),
        other => {
            return Err(graft_abi::Error::msg(format!(
                "unexpected weight dtype {other}"
            )))
        }
    })
}

/// aten::_fused_rms_norm at the CPU key.
pub struct ForwardCpu;

impl Kernel for ForwardCpu {
    type Args = (Tensor, Vec<i64>, Option<Tensor>, Option<f64>);
    type Outputs = (Tensor, Tensor);

    fn run((input, normalized_shape, weight, eps): Self::Args) -> Result<(Tensor, Tensor)> {
        FORWARD.call();
        let weight = Tensor::defined(weight)?;
        let geometry = check_forward(&input, &normalized_shape, weight.as_ref())?;
        let call = ForwardCall {
            input: &input,
            normalized_shape: &normalized_shape,
            weight: weight.as_ref(),
            eps,
            geometry,
        };
        let (y, rstd) = match input.dtype()? {
            DType::F32 => call.run::<f32>(),
            DType::F64 => call.run::<f64>(),
            DType::BF16 => call.run::<bf16>(),
            _ => call.run::<f16>(),
        }?;
        in_forward_layout((y, rstd), &input, &normalized_shape, weight.as_ref(), eps)
    }
}

struct ForwardCall<'a> {
    input: &'a Tensor,
    normalized_shape: &'a [i64],
    weight: Option<&'a Tensor>,
    eps: Option<f64>,
    geometry: Geometry,
}

impl ForwardCall<'_> {
    /// Contiguous outputs computed by the Rust kernel for element type `T`.
    fn run<T>(&self) -> Result<(Tensor, Tensor)>
    where
        T: Float + Element,
        T::Acc: AccValue,
    {
        let dtype = T::DTYPE;
        let x = contiguous(self.input)?;
        let weight = self.weight.map(weight_as_acc::<T>).transpose()?;
        let eps = T::Acc::of_f64(self.eps.unwrap_or_else(|| default_eps(dtype)));
        let sizes = self.input.sizes()?;
        let mut y = NewTensor::empty(sizes, dtype, Device::CPU)?;
        let mut rstd = NewTensor::empty(
            &rstd_sizes(sizes, self.normalized_shape.len()),
            acc_dtype(dtype),
            Device::CPU,
        )?;
        let Geometry { rows, cols } = self.geometry;
        rms_norm::forward::<T>(
            x.as_slice()?,
            rows,
            cols,
            weight.as_deref(),
            eps,
            y.as_mut_slice()?,
            rstd.as_mut_slice()?,
            &TorchPool,
        );
        Ok((y.finish(), rstd.finish()))
    }
}

/// aten::_fused_rms_norm_backward at the CPU key.
pub struct BackwardCpu;

impl Kernel for BackwardCpu {
    type Args = (Tensor, Tensor, Vec<i64>, Tensor, Option<Tensor>, Vec<bool>);
    type Outputs = (Tensor, Tensor);

    fn run(
        (grad_out, input, normalized_shape, rstd, weight, output_mask): Self::Args,
    ) -> Result<(Tensor, Tensor)> {
        BACKWARD.call();
        let weight = Tensor::defined(weight)?;
        let geometry = check_backward(
            &grad_out,
            &input,
            &normalized_shape,
            &rstd,
            weight.as_ref(),
            &output_mask,
        )?;
        let call = BackwardCall {
            grad_out: &grad_out,
            input: &input,
            rstd: &rstd,
            weight: weight.as_ref(),
            want_dx: output_mask[0],
            want_dw: output_mask[1] && weight.is_some(),
            geometry,
        };
        let (dx, dw) = match input.dtype()? {
            DType::F32 => call.run::<f32>(),
            DType::F64 => call.run::<f64>(),
            DType::BF16 => call.run::<bf16>(),
            _ => call.run::<f16>(),
        }?;
        in_backward_layout(
            (dx, dw),
            &grad_out,
            &input,
            &normalized_shape,
            &rstd,
            weight.as_ref(),
        )
    }
}

struct BackwardCall<'a> {
    grad_out: &'a Tensor,
    input: &'a Tensor,
    rstd: &'a Tensor,
    weight: Option<&'a Tensor>,
    want_dx: bool,
    want_dw: bool,
    geometry: Geometry,
}

impl BackwardCall<'_> {
    /// Contiguous (dx, dw) computed by the Rust kernel for element type `T`, each if wanted.
    fn run<T>(&self) -> Result<(Option<Tensor>, Option<Tensor>)>
    where
        T: Float + Element,
        T::Acc: AccValue,
    {
        let dtype = T::DTYPE;
        let x = contiguous(self.input)?;
        // Direct calls may pass other dtypes than autograd would; convert them (rare).
        let dy = contiguous(&to_dtype(self.grad_out, dtype)?)?;
        let rstd = contiguous(&to_dtype(self.rstd, acc_dtype(dtype))?)?;
        let weight = self.weight.map(weight_as_acc::<T>).transpose()?;
        let sizes = self.input.sizes()?;
        let mut dx = self
            .want_dx
            .then(|| NewTensor::empty(sizes, dtype, Device::CPU))
            .transpose()?;
        let Geometry { rows, cols } = self.geometry;
        let mut dw_acc = vec![T::Acc::default(); if self.want_dw { cols } else { 0 }];
        rms_norm::backward::<T>(
            dy.as_slice()?,
            x.as_slice()?,
            rstd.as_slice()?,
            rows,
            cols,
            weight.as_deref(),
            dx.as_mut().map(|dx| dx.as_mut_slice()).transpose()?,
            self.want_dw.then_some(dw_acc.as_mut_slice()),
            &TorchPool,
        );
        let dw = match self.weight.filter(|_| self.want_dw) {
            Some(weight) => {
                // In the input's dtype, like ATen's meta function (autograd casts it to the
                // weight's dtype when the two differ).
                let mut dw = NewTensor::empty(weight.sizes()?, dtype, Device::CPU)?;
                convert::from_acc::<T>(&dw_acc, dw.as_mut_slice()?);
                Some(dw.finish())
            }
            None => None,
        };
        Ok((dx.map(NewTensor::finish), dw))
    }
}
