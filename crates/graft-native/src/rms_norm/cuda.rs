//! RMSNorm on CUDA: CUDA C++ kernels compiled ahead of time (graft-cuda), launched on PyTorch's
//! current stream of the tensors' device.
//!
//! The native route cannot call the kernel that was registered before (ATen's), so every valid
//! input is computed here: any float dtype (float64 included), any width, any layout (copied to
//! contiguous first), a weight of another float dtype (converted to the accumulation type).

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{DType, Device, DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{RmsNormBackward, RmsNormForward, Weight, WeightMode};

use super::{
    acc_dtype, check_backward, check_forward, contiguous, default_eps, in_backward_layout,
    in_forward_layout, rstd_sizes, to_dtype, Geometry,
};
use crate::stats::Counters;

/// Calls of the forward graft.
pub static FORWARD: Counters = Counters::new();
/// Calls of the backward graft.
pub static BACKWARD: Counters = Counters::new();

pub(crate) fn kernel_dtype(dtype: DType) -> graft_cuda::DType {
    match dtype {
        DType::F32 => graft_cuda::DType::F32,
        DType::F64 => graft_cuda::DType::F64,
        DType::BF16 => graft_cuda::DType::BF16,
        _ => graft_cuda::DType::F16,
    }
}

pub(crate) fn ptr(t: &Tensor) -> Result<u64> {
    Ok(t.data_ptr()? as u64)
}

pub(crate) fn cuda_error(e: graft_cuda::CudaError) -> graft_abi::Error {
    graft_abi::Error::msg(e.to_string())
}

/// The tensors of one RMSNorm backward launch (`dx` / `dw`: those asked for).
pub(crate) struct BackwardOperands<'a> {
    pub dy: &'a Tensor,
    pub x: &'a Tensor,
    pub rstd: &'a Tensor,
    pub weight: Weight,
    pub dx: Option<&'a Tensor>,
    pub dw: Option<&'a Tensor>,
}

/// Launches the backward kernels over `rows` x `cols` (both nonzero) on the current stream of
/// `device`, with the dw partials' scratch when dw is asked for.
pub(crate) fn launch_backward(
    device: Device,
    dtype: DType,
    t: BackwardOperands<'_>,
    rows: usize,
    cols: usize,
    mode: WeightMode,
) -> Result<()> {
    let want_dw = t.dw.is_some();
    let workspace_bytes = graft_cuda::rms_norm_backward_workspace_bytes_for(
        device.index,
        kernel_dtype(dtype),
        rows,
        cols,
        want_dw,
    )
    .map_err(cuda_error)?;
    // Scratch for the dw partials; without dw the kernels never touch it.
    let workspace = want_dw
        .then(|| NewTensor::empty(&[workspace_bytes.max(16) as i64], DType::U8, device))
        .transpose()?
        .map(NewTensor::finish);
    graft_cuda::rms_norm_backward(&RmsNormBackward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: kernel_dtype(dtype),
        dy: ptr(t.dy)?,
        x: ptr(t.x)?,
        rstd: ptr(t.rstd)?,
        weight: t.weight,
        dx: t.dx.map(ptr).transpose()?,
        dw: t.dw.map(ptr).transpose()?,
        workspace: workspace.as_ref().map(ptr).transpose()?.unwrap_or(0),
        workspace_bytes,
        rows,
        cols,
        mode,
    })
    .map_err(cuda_error)
}

/// A contiguous weight the kernels can read: in the input's dtype, or else in the accumulation
/// dtype (converted; rare: F.rms_norm only reaches the op with matching dtypes).
pub(crate) fn kernel_weight(
    weight: Option<&Tensor>,
    dtype: DType,
) -> Result<(Option<Tensor>, Weight)> {
    let Some(weight) = weight else {
        return Ok((None, Weight::None));
    };
    if weight.dtype()? == dtype {
        let w = contiguous(weight)?;
        let p = ptr(&w)?;
        Ok((Some(w), Weight::Same(p)))
    } else {
        let w = contiguous(&to_dtype(weight, acc_dtype(dtype))?)?;
        let p = ptr(&w)?;
        Ok((Some(w), Weight::Acc(p)))
    }
}

/// A tensor of `sizes` on `device` holding `value` everywhere (made on the CPU, then copied:
/// the stable ABI cannot pass a Scalar to aten::fill_).
pub(crate) fn filled(sizes: &[i64], dtype: DType, device: Device, value: f64) -> Result<Tensor> {
    let mut host = NewTensor::empty(sizes, DType::F64, Device::CPU)?;
    host.as_mut_slice::<f64>()?.fill(value);
    let out = NewTensor::empty(sizes, dtype, device)?.finish();
    out.copy_from(&host.finish())?;
    Ok(out)
}

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
