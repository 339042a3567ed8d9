//! RMSNorm on CPU: the Rust kernels of graft-kernels, run on torch's thread pool.
//!
//! PyTorch has no fused CPU RMSNorm (CPU runs a ~7-pass composite). Registering these kernels at
//! the CPU key also switches CPU autograd from the composite to aten's derivative formula, which
//! calls `_fused_rms_norm_backward`: both ops are grafted together.

use graft_abi::{dispatch, DType, Device, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::ops::{convert, rms_norm};
use graft_kernels::Float;
use half::{bf16, f16};

use super::{
    check_backward_cpu, composite, default_eps, in_backward_layout, in_forward_layout,
    plan_forward_cpu, Geometry,
};
use crate::common::layout::rstd_sizes;
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, to_dtype};
use crate::common::threads::TorchPool;

/// Calls of the forward graft.
pub static FORWARD: Counters = Counters::new();
/// Calls of the backward graft.
pub static BACKWARD: Counters = Counters::new();

/// The accumulation types (f32, f64).
trait AccValue: Element + graft_kernels::Acc {
    fn of_f64(v: f64) -> Self;
}

impl AccValue for f32 {
    fn of_f64(v: f64) -> f32 {
        v as f32
    }
}

impl AccValue for f64 {
    fn of_f64(v: f64) -> f64 {
        v
    }
}

/// A weight's values in the accumulation type of inputs of type `T`, spread over `cols`
/// normalized elements. The weight normally has `T`'s dtype and their shape (vectorized
/// conversion); calls made directly may pass any dtype (converted by ATen, like its own
/// composite's type promotion would) and any shape that broadcasts (expanded).
fn weight_as_acc<T>(weight: &Tensor, normalized_sizes: &[i64]) -> Result<Vec<T::Acc>>
where
    T: Float + Element,
    T::Acc: AccValue,
{
    let expanded;
    let weight = if weight.sizes()? == normalized_sizes {
        weight
    } else {
        let (out,): (Tensor,) =
            dispatch::call(c"aten::expand", c"", (weight, normalized_sizes, false))?;
        expanded = out;
        &expanded
    };
    if weight.dtype()? == T::DTYPE {
        return Ok(convert::to_acc_vec(contiguous(weight)?.as_slice::<T>()?));
    }
    let w = contiguous(&to_dtype(weight, T::Acc::DTYPE)?)?;
    Ok(w.as_slice::<T::Acc>()?.to_vec())
}

/// aten::_fused_rms_norm at the CPU key.
pub struct ForwardCpu;

impl Kernel for ForwardCpu {
    type Args = (Tensor, Vec<i64>, Option<Tensor>, Option<f64>);
    type Outputs = (Tensor, Tensor);

    fn run((input, normalized_shape, weight, eps): Self::Args) -> Result<(Tensor, Tensor)> {
        FORWARD.call();
        let weight = Tensor::defined(weight)?;
        let Some(geometry) = plan_forward_cpu(&input, &normalized_shape, weight.as_ref())? else {
            FORWARD.fallback();
            return composite::forward(&input, normalized_shape.len(), weight.as_ref(), eps);
        };
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
        in_forward_layout((y, rstd), &input, normalized_shape.len(), weight.as_ref())
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
        let weight = self
            .weight
            .map(|w| weight_as_acc::<T>(w, self.normalized_shape))
            .transpose()?;
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
        let operands = (&grad_out, &input, &rstd);
        let (geometry, normalized_dims) =
            check_backward_cpu(operands, &normalized_shape, weight.as_ref(), &output_mask)?;
        let sizes = input.sizes()?;
        let call = BackwardCall {
            grad_out: &grad_out,
            input: &input,
            rstd: &rstd,
            weight: weight.as_ref(),
            normalized_sizes: &sizes[sizes.len() - normalized_dims..],
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
            normalized_dims,
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
    /// The trailing sizes that are normalized (what the weight broadcasts to, dw's shape).
    normalized_sizes: &'a [i64],
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
        let weight = self
            .weight
            .map(|w| weight_as_acc::<T>(w, self.normalized_sizes))
            .transpose()?;
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
            Some(weight) => Some(self.weight_grad::<T>(&dw_acc, weight.dtype()?)?),
            None => None,
        };
        Ok((dx.map(NewTensor::finish), dw))
    }

    /// dw from its accumulated values: in the input's dtype when the weight has it (as ATen's
    /// meta function says), else in the weight's own float dtype, so that a float32 weight under
    /// a bfloat16 input gets a float32-accurate gradient as stock's composite gives it (autograd
    /// casts to the weight's dtype either way). Shaped like the normalized dims.
    fn weight_grad<T>(&self, dw_acc: &[T::Acc], weight_dtype: DType) -> Result<Tensor>
    where
        T: Float + Element,
        T::Acc: AccValue,
    {
        let sizes = self.normalized_sizes;
        if weight_dtype == T::DTYPE || !weight_dtype.is_float() {
            let mut dw = NewTensor::empty(sizes, T::DTYPE, Device::CPU)?;
            convert::from_acc::<T>(dw_acc, dw.as_mut_slice()?);
            return Ok(dw.finish());
        }
        let mut dw = NewTensor::empty(sizes, T::Acc::DTYPE, Device::CPU)?;
        dw.as_mut_slice::<T::Acc>()?.copy_from_slice(dw_acc);
        to_dtype(&dw.finish(), weight_dtype)
    }
}
