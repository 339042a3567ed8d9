//! torchgraft::rms_norm on CPU: graft-kernels' kernels on torch's thread pool.

use graft_abi::{DType, Device, DeviceType, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::ops::convert;
use graft_kernels::ops::rms_norm::{self, WeightMode};
use graft_kernels::Float;
use half::{bf16, f16};

use super::{check, check_backward, rstd_sizes, skipped, Geometry};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, to_dtype};
use crate::common::threads::TorchPool;

pub static RMS_NORM_CPU: Counters = Counters::new();
pub static RMS_NORM_BACKWARD_CPU: Counters = Counters::new();

/// The accumulation types, with `eps` and `offset` converted from f64.
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

/// The weight's values in `T::Acc` (exact: a weight of `T`, or converted by ATen otherwise).
fn weight_as_acc<T>(weight: &Tensor) -> Result<Vec<T::Acc>>
where
    T: Float + Element,
    T::Acc: AccValue,
{
    if weight.dtype()? == T::DTYPE {
        return Ok(convert::to_acc_vec(contiguous(weight)?.as_slice::<T>()?));
    }
    let w = contiguous(&to_dtype(weight, T::Acc::DTYPE)?)?;
    Ok(w.as_slice::<T::Acc>()?.to_vec())
}

fn mode_of<A: AccValue>(offset: f64, cast_before_weight: bool) -> WeightMode<A> {
    WeightMode {
        offset: A::of_f64(offset),
        round_first: cast_before_weight,
    }
}

fn forward_cpu<T>(
    x: &Tensor,
    weight: Option<&Tensor>,
    eps: f64,
    mode: WeightMode<T::Acc>,
    Geometry { rows, cols }: Geometry,
) -> Result<(Tensor, Tensor)>
where
    T: Float + Element,
    T::Acc: AccValue,
{
    let xc = contiguous(x)?;
    let w = weight.map(weight_as_acc::<T>).transpose()?;
    let mut y = NewTensor::empty(x.sizes()?, T::DTYPE, Device::CPU)?;
    let mut rstd = NewTensor::empty(&rstd_sizes(x)?, T::Acc::DTYPE, Device::CPU)?;
    rms_norm::forward_with::<T>(
        xc.as_slice()?,
        rows,
        cols,
        w.as_deref(),
        T::Acc::of_f64(eps),
        mode,
        y.as_mut_slice()?,
        rstd.as_mut_slice()?,
        &TorchPool,
    );
    Ok((y.finish(), rstd.finish()))
}

#[allow(clippy::too_many_arguments)]
fn backward_cpu<T>(
    grad: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
    weight: Option<&Tensor>,
    mode: WeightMode<T::Acc>,
    (want_dx, want_dw): (bool, bool),
    Geometry { rows, cols }: Geometry,
) -> Result<(Tensor, Tensor)>
where
    T: Float + Element,
    T::Acc: AccValue,
{
    let xc = contiguous(x)?;
    // Autograd passes grad in y's dtype (x's) and rstd as the forward made it; direct calls
    // may pass other dtypes (converted).
    let dy = contiguous(&to_dtype(grad, T::DTYPE)?)?;
    let rstd = contiguous(&to_dtype(rstd, T::Acc::DTYPE)?)?;
    let w = weight.map(weight_as_acc::<T>).transpose()?;
    let want_dw = want_dw && weight.is_some();
    let mut dx = want_dx
        .then(|| NewTensor::empty(x.sizes()?, T::DTYPE, Device::CPU))
        .transpose()?;
    let mut dw_acc = vec![T::Acc::default(); if want_dw { cols } else { 0 }];
    rms_norm::backward_with::<T>(
        dy.as_slice()?,
        xc.as_slice()?,
        rstd.as_slice()?,
        rows,
        cols,
        w.as_deref(),
        mode,
        dx.as_mut().map(|dx| dx.as_mut_slice()).transpose()?,
        want_dw.then_some(dw_acc.as_mut_slice()),
        &TorchPool,
    );
    let dx = match dx {
        Some(dx) => dx.finish(),
        None => skipped(T::DTYPE, Device::CPU)?,
    };
    let dw = match weight.filter(|_| want_dw) {
        Some(w) => weight_grad::<T>(&dw_acc, w.dtype()?)?,
        None => skipped(weight.map_or(Ok(T::DTYPE), Tensor::dtype)?, Device::CPU)?,
    };
    Ok((dx, dw))
}

/// dw in the weight's dtype from its accumulated values (rounded once).
fn weight_grad<T>(dw_acc: &[T::Acc], dtype: DType) -> Result<Tensor>
where
    T: Float + Element,
    T::Acc: AccValue,
{
    let sizes = [dw_acc.len() as i64];
    if dtype == T::DTYPE {
        let mut dw = NewTensor::empty(&sizes, T::DTYPE, Device::CPU)?;
        convert::from_acc::<T>(dw_acc, dw.as_mut_slice()?);
        return Ok(dw.finish());
    }
    let mut dw = NewTensor::empty(&sizes, T::Acc::DTYPE, Device::CPU)?;
    dw.as_mut_slice::<T::Acc>()?.copy_from_slice(dw_acc);
    to_dtype(&dw.finish(), dtype)
}

/// `torchgraft::rms_norm` at CPU.
pub struct RmsNormCpu;

impl Kernel for RmsNormCpu {
    type Args = (Tensor, Option<Tensor>, f64, f64, bool);
    type Outputs = (Tensor, Tensor);
    fn run((x, weight, eps, offset, cast): Self::Args) -> Result<(Tensor, Tensor)> {
        RMS_NORM_CPU.call();
        let weight = Tensor::defined(weight)?;
        let w = weight.as_ref();
        let g = check("rms_norm", DeviceType::CPU, &x, w, cast, None)?;
        match x.dtype()? {
            DType::F32 => forward_cpu::<f32>(&x, w, eps, mode_of(offset, cast), g),
            DType::F64 => forward_cpu::<f64>(&x, w, eps, mode_of(offset, cast), g),
            DType::BF16 => forward_cpu::<bf16>(&x, w, eps, mode_of(offset, cast), g),
            _ => forward_cpu::<f16>(&x, w, eps, mode_of(offset, cast), g),
        }
    }
}

/// `torchgraft::rms_norm_backward` at CPU.
pub struct RmsNormBackwardCpu;

impl Kernel for RmsNormBackwardCpu {
    type Args = (Tensor, Tensor, Tensor, Option<Tensor>, f64, bool, Vec<bool>);
    type Outputs = (Tensor, Tensor);
    fn run((grad, x, rstd, weight, offset, cast, mask): Self::Args) -> Result<(Tensor, Tensor)> {
        RMS_NORM_BACKWARD_CPU.call();
        let weight = Tensor::defined(weight)?;
        let w = weight.as_ref();
        let g = check_backward(DeviceType::CPU, (&grad, &x, &rstd), w, cast, &mask)?;
        let want = (mask[0], mask[1]);
        match x.dtype()? {
            DType::F32 => backward_cpu::<f32>(&grad, &x, &rstd, w, mode_of(offset, cast), want, g),
            DType::F64 => backward_cpu::<f64>(&grad, &x, &rstd, w, mode_of(offset, cast), want, g),
            DType::BF16 => {
                backward_cpu::<bf16>(&grad, &x, &rstd, w, mode_of(offset, cast), want, g)
            }
            _ => backward_cpu::<f16>(&grad, &x, &rstd, w, mode_of(offset, cast), want, g),
        }
    }
}
