//! RMSNorm on CUDA: CUDA C++ kernels compiled ahead of time (graft-cuda), launched on PyTorch's
//! current stream of the tensors' device.
//!
//! The native route cannot call the kernel that was registered before (ATen's), so every valid
//! input is computed here: any float dtype (float64 included), any width, any layout (copied to
//! contiguous first), a weight of another float dtype (converted to the accumulation type).

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{RmsNormForward, Weight, WeightMode};

use super::{
    check_backward, check_forward, default_eps, in_backward_layout, in_forward_layout, Geometry,
};
use crate::common::cuda::{cuda_error, kernel_dtype, ptr};
use crate::common::layout::rstd_sizes;
use crate::common::rms_norm_cuda::{kernel_weight, launch_backward, BackwardOperands};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, filled, to_dtype};

/// Calls of the forward graft.
pub static FORWARD: Counters = Counters::new();
/// Calls of the backward graft.
pub static BACKWARD: Counters = Counters::new();

/// aten::_fused_rms_norm at the CUDA key.
pub struct ForwardCuda;

impl Kernel for ForwardCuda {
    type Args = (Tensor, Vec<i64>, Option<Tensor>, Option<f64>);
    type Outputs = (Tensor, Tensor);

    fn run((input, normalized_shape, weight, eps): Self::Args) -> Result<(Tensor, Tensor)> {
        FORWARD.call();
        let weight = Tensor::defined(weight)?;
        let Geometry { rows, cols } =
            check_forward(DeviceType::CUDA, &input, &normalized_shape, weight.as_ref())?;
        let device = input.device()?;
        let _guard = DeviceGuard::new(device.index)?;
        let dtype = input.dtype()?;
        let x = contiguous(&input)?;
        let (_weight, kernel_w) = kernel_weight(weight.as_ref(), dtype)?;
        if matches!(kernel_w, Weight::Acc(_)) {
            FORWARD.fallback();
        }
        let sizes = input.sizes()?;
        let rstd_shape = rstd_sizes(sizes, normalized_shape.len());
        let y = NewTensor::empty(sizes, dtype, device)?.finish();
        let rstd = if cols == 0 {
            // The mean of an empty row is NaN, as in ATen's composite.
            filled(&rstd_shape, acc_dtype(dtype), device, f64::NAN)?
        } else {
            NewTensor::empty(&rstd_shape, acc_dtype(dtype), device)?.finish()
        };
        if rows > 0 && cols > 0 {
            graft_cuda::rms_norm_forward(&RmsNormForward {
                device: device.index,
                stream: current_stream(device.index)? as usize,
                dtype: kernel_dtype(dtype),
                x: ptr(&x)?,
                weight: kernel_w,
                y: ptr(&y)?,
                rstd: ptr(&rstd)?,
                rows,
                cols,
                eps: eps.unwrap_or_else(|| default_eps(dtype)),
                mode: WeightMode::default(),
            })
            .map_err(cuda_error)?;
        }
        in_forward_layout((y, rstd), &input, normalized_shape.len(), weight.as_ref())
    }
}

/// aten::_fused_rms_norm_backward at the CUDA key.
pub struct BackwardCuda;

impl Kernel for BackwardCuda {
    type Args = (Tensor, Tensor, Vec<i64>, Tensor, Option<Tensor>, Vec<bool>);
    type Outputs = (Tensor, Tensor);

    fn run(
        (grad_out, input, normalized_shape, rstd, weight, output_mask): Self::Args,
    ) -> Result<(Tensor, Tensor)> {
        BACKWARD.call();
        let weight = Tensor::defined(weight)?;
        let Geometry { rows, cols } = check_backward(
            DeviceType::CUDA,
            (&grad_out, &input, &rstd),
            &normalized_shape,
            weight.as_ref(),
            &output_mask,
        )?;
        let want_dx = output_mask[0];
        let want_dw = output_mask[1] && weight.is_some();
        let device = input.device()?;
        let _guard = DeviceGuard::new(device.index)?;
        let dtype = input.dtype()?;
        let sizes = input.sizes()?;
        let x = contiguous(&input)?;
        // Direct calls may pass other dtypes than autograd would; convert them (rare).
        let dy = contiguous(&to_dtype(&grad_out, dtype)?)?;
        let rstd_acc = contiguous(&to_dtype(&rstd, acc_dtype(dtype))?)?;
        let (_weight, kernel_w) = kernel_weight(weight.as_ref(), dtype)?;
        if matches!(kernel_w, Weight::Acc(_)) {
            BACKWARD.fallback();
        }
        let dx = want_dx
            .then(|| NewTensor::empty(sizes, dtype, device))
            .transpose()?;
        let dx = dx.map(NewTensor::finish);
        // The kernel writes dw in the dtype it reads the weight in (the accumulation dtype for a
        // converted weight).
        let dw_sizes = weight
            .as_ref()
            .map(|w| w.sizes().map(<[i64]>::to_vec))
            .transpose()?;
        let dw_kernel_dtype = match kernel_w {
            Weight::Acc(_) => acc_dtype(dtype),
            _ => dtype,
        };
        let mut dw = match (&dw_sizes, want_dw) {
            (Some(s), true) if rows == 0 => Some(filled(s, dw_kernel_dtype, device, 0.0)?),
            (Some(s), true) => Some(NewTensor::empty(s, dw_kernel_dtype, device)?.finish()),
            _ => None,
        };
        if rows > 0 && cols > 0 && (want_dx || want_dw) {
            let operands = BackwardOperands {
                dy: &dy,
                x: &x,
                rstd: &rstd_acc,
                weight: kernel_w,
                dx: dx.as_ref(),
                dw: dw.as_ref(),
            };
            launch_backward(device, dtype, operands, rows, cols, WeightMode::default())?;
        }
        if let (Some(d), Some(w)) = (dw.take(), weight.as_ref()) {
            // In the input's dtype when the weight has it (ATen's meta function), else in the
            // weight's own: a float32 weight under a bfloat16 input keeps a float32-accurate
            // gradient, as stock's composite gives it.
            dw = Some(to_dtype(&d, w.dtype()?)?);
        }
        in_backward_layout(
            (dx, dw),
            &grad_out,
            &input,
            normalized_shape.len(),
            &rstd,
            weight.as_ref(),
        )
    }
}
