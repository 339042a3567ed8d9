//! torchgraft::rms_norm on CUDA: graft-cuda's kernels on PyTorch's current stream of the
//! tensors' device.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{RmsNormForward, Weight};

use super::{check, check_backward, rstd_sizes, skipped, Geometry};
use crate::common::cuda::{cuda_error, kernel_dtype, ptr};
use crate::common::rms_norm_cuda::{kernel_weight, launch_backward, BackwardOperands};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, filled, to_dtype};

pub static RMS_NORM_CUDA: Counters = Counters::new();
pub static RMS_NORM_BACKWARD_CUDA: Counters = Counters::new();

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
