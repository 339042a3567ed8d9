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

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{
    ensure, DType, Device, DeviceType, Element, Kernel, NewTensor, Operands, Result, Tensor,
};
use graft_cuda::{RmsNormForward, Weight};
use graft_kernels::ops::convert;
use graft_kernels::ops::rms_norm::{self, WeightMode};
use graft_kernels::Float;
use half::{bf16, f16};

use crate::common::cuda::{cuda_error, kernel_dtype, ptr};
use crate::common::rms_norm_cuda::{kernel_weight, launch_backward, BackwardOperands};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, filled, to_dtype};
use crate::common::threads::TorchPool;

pub static RMS_NORM_CPU: Counters = Counters::new();
pub static RMS_NORM_CUDA: Counters = Counters::new();
pub static RMS_NORM_BACKWARD_CPU: Counters = Counters::new();
pub static RMS_NORM_BACKWARD_CUDA: Counters = Counters::new();

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

// ------------------------------------------------------------------------------------ CPU

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

// ----------------------------------------------------------------------------------- CUDA

fn forward_cuda(
    x: &Tensor,
    weight: Option<&Tensor>,
    eps: f64,
    mode: graft_cuda::WeightMode,
    Geometry { rows, cols }: Geometry,
) -> Result<(Tensor, Tensor)> {
    let device = x.device()?;
    let _guard = DeviceGuard::new(device.index)?;
    let dtype = x.dtype()?;
    let xc = contiguous(x)?;
    let (_weight, kernel_w) = kernel_weight(weight, dtype)?;
    let y = NewTensor::empty(x.sizes()?, dtype, device)?.finish();
    let rstd_shape = rstd_sizes(x)?;
    let rstd = if cols == 0 {
        // The mean of an empty row is NaN (as for F.rms_norm).
        filled(&rstd_shape, acc_dtype(dtype), device, f64::NAN)?
    } else {
        NewTensor::empty(&rstd_shape, acc_dtype(dtype), device)?.finish()
    };
    if rows > 0 && cols > 0 {
        graft_cuda::rms_norm_forward(&RmsNormForward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: kernel_dtype(dtype),
            x: ptr(&xc)?,
            weight: kernel_w,
            y: ptr(&y)?,
            rstd: ptr(&rstd)?,
            rows,
            cols,
            eps,
            mode,
        })
        .map_err(cuda_error)?;
    }
    Ok((y, rstd))
}

fn backward_cuda(
    grad: &Tensor,
    x: &Tensor,
    rstd: &Tensor,
    weight: Option<&Tensor>,
    mode: graft_cuda::WeightMode,
    (want_dx, want_dw): (bool, bool),
    Geometry { rows, cols }: Geometry,
) -> Result<(Tensor, Tensor)> {
    let device = x.device()?;
    let _guard = DeviceGuard::new(device.index)?;
    let dtype = x.dtype()?;
    let want_dw = want_dw && weight.is_some();
    let xc = contiguous(x)?;
    let dy = contiguous(&to_dtype(grad, dtype)?)?;
    let rstd = contiguous(&to_dtype(rstd, acc_dtype(dtype))?)?;
    let (_weight, kernel_w) = kernel_weight(weight, dtype)?;
    let dx = if want_dx {
        NewTensor::empty(x.sizes()?, dtype, device)?.finish()
    } else {
        skipped(dtype, device)?
    };
    // The kernels write dw in the dtype they read the weight in (the accumulation dtype for a
    // converted weight); it is converted to the weight's below.
    let dw_kernel_dtype = match kernel_w {
        Weight::Acc(_) => acc_dtype(dtype),
        _ => dtype,
    };
    let dw_sizes = [cols as i64];
    let dw = match (want_dw, rows) {
        (false, _) => None,
        (true, 0) => Some(filled(&dw_sizes, dw_kernel_dtype, device, 0.0)?),
        (true, _) => Some(NewTensor::empty(&dw_sizes, dw_kernel_dtype, device)?.finish()),
    };
    if rows > 0 && cols > 0 && (want_dx || want_dw) {
        let operands = BackwardOperands {
            dy: &dy,
            x: &xc,
            rstd: &rstd,
            weight: kernel_w,
            dx: want_dx.then_some(&dx),
            dw: dw.as_ref(),
        };
        launch_backward(device, dtype, operands, rows, cols, mode)?;
    }
    let dw = match (dw, weight) {
        (Some(dw), Some(w)) => to_dtype(&dw, w.dtype()?)?,
        _ => skipped(weight.map_or(Ok(dtype), Tensor::dtype)?, device)?,
    };
    Ok((dx, dw))
}

// -------------------------------------------------------------------------------- kernels

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

fn cuda_mode(offset: f64, cast_before_weight: bool) -> graft_cuda::WeightMode {
    graft_cuda::WeightMode {
        offset,
        round_first: cast_before_weight,
    }
}

/// `torchgraft::rms_norm` at CUDA.
pub struct RmsNormCuda;
impl Kernel for RmsNormCuda {
    type Args = (Tensor, Option<Tensor>, f64, f64, bool);
    type Outputs = (Tensor, Tensor);
    fn run((x, weight, eps, offset, cast): Self::Args) -> Result<(Tensor, Tensor)> {
        RMS_NORM_CUDA.call();
        let weight = Tensor::defined(weight)?;
        let g = check(
            "rms_norm",
            DeviceType::CUDA,
            &x,
            weight.as_ref(),
            cast,
            None,
        )?;
        forward_cuda(&x, weight.as_ref(), eps, cuda_mode(offset, cast), g)
    }
}

/// `torchgraft::rms_norm_backward` at CUDA.
pub struct RmsNormBackwardCuda;
impl Kernel for RmsNormBackwardCuda {
    type Args = (Tensor, Tensor, Tensor, Option<Tensor>, f64, bool, Vec<bool>);
    type Outputs = (Tensor, Tensor);
    fn run((grad, x, rstd, weight, offset, cast, mask): Self::Args) -> Result<(Tensor, Tensor)> {
        RMS_NORM_BACKWARD_CUDA.call();
        let weight = Tensor::defined(weight)?;
        let w = weight.as_ref();
        let g = check_backward(DeviceType::CUDA, (&grad, &x, &rstd), w, cast, &mask)?;
        let mode = cuda_mode(offset, cast);
        backward_cuda(&grad, &x, &rstd, w, mode, (mask[0], mask[1]), g)
    }
}
