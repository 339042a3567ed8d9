//! LayerNorm on CUDA: graft-cuda's kernels (kernels/layer_norm.cu) on PyTorch's current stream
//! of the tensors' device.
//!
//! ATen's CUDA rules: parameters of the input's dtype (read as it), mean and rstd in the
//! accumulation dtype (float32; float64 for float64), nothing computed (and no dtype error) for
//! an empty batch.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{DType, DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{LayerNormBackward, LayerNormForward};

use super::{
    check_devices, check_inputs, contiguous_as, expect_dtype, mask3, missing_parameter,
    not_implemented, stat_sizes, BackwardArgs, ForwardArgs, Saved,
};
use crate::common::cuda::{cuda_error, kernel_dtype, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, filled};

/// Calls of `aten::native_layer_norm` at CUDA.
pub static FORWARD: Counters = Counters::new();
/// Calls of `aten::native_layer_norm_backward` at CUDA.
pub static BACKWARD: Counters = Counters::new();

/// A parameter as the kernels read it: contiguous, of the input's dtype (ATen's message
/// otherwise); 0 when absent.
fn param(p: Option<&Tensor>, dtype: DType) -> Result<(Option<Tensor>, u64)> {
    match p {
        None => Ok((None, 0)),
        Some(p) => {
            expect_dtype(dtype, p.dtype()?)?;
            let p = contiguous(p)?;
            let at = ptr(&p)?;
            Ok((Some(p), at))
        }
    }
}

/// aten::native_layer_norm at the CUDA key.
pub struct ForwardCuda;

impl Kernel for ForwardCuda {
    type Args = ForwardArgs;
    type Outputs = (Tensor, Tensor, Tensor);

    fn run(
        (input, normalized_shape, weight, bias, eps): ForwardArgs,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        FORWARD.call();
        let (weight, bias) = (Tensor::defined(weight)?, Tensor::defined(bias)?);
        check_devices(
            DeviceType::CUDA,
            &input,
            (weight.as_ref(), bias.as_ref()),
            None,
        )?;
        let (rows, cols) = check_inputs(&input, &normalized_shape, weight.as_ref(), bias.as_ref())?;
        let device = input.device()?;
        let _guard = DeviceGuard::new(device.index)?;
        let dtype = input.dtype()?;
        let acc = acc_dtype(dtype);
        let sizes = input.sizes()?;
        let stat = stat_sizes(sizes, normalized_shape.len());
        let y = NewTensor::empty(sizes, dtype, device)?.finish();
        if rows == 0 {
            let mean = NewTensor::empty(&stat, acc, device)?.finish();
            let rstd = NewTensor::empty(&stat, acc, device)?.finish();
            return Ok((y, mean, rstd));
        }
        if !dtype.is_float() {
            return Err(not_implemented("LayerNormKernelImpl", dtype));
        }
        let (_w, w) = param(weight.as_ref(), dtype)?;
        let (_b, b) = param(bias.as_ref(), dtype)?;
        if cols == 0 {
            // The statistics of empty rows: mean 0, rstd NaN (0 / 0 variance).
            let mean = filled(&stat, acc, device, 0.0)?;
            let rstd = filled(&stat, acc, device, f64::NAN)?;
            return Ok((y, mean, rstd));
        }
        let x = contiguous(&input)?;
        let mean = NewTensor::empty(&stat, acc, device)?.finish();
        let rstd = NewTensor::empty(&stat, acc, device)?.finish();
        graft_cuda::layer_norm_forward(&LayerNormForward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: kernel_dtype(dtype),
            x: ptr(&x)?,
            weight: w,
            bias: b,
            y: ptr(&y)?,
            mean: ptr(&mean)?,
            rstd: ptr(&rstd)?,
            rows,
            cols,
            eps,
        })
        .map_err(cuda_error)?;
        Ok((y, mean, rstd))
    }
}

/// aten::native_layer_norm_backward at the CUDA key.
pub struct BackwardCuda;

impl Kernel for BackwardCuda {
    type Args = BackwardArgs;
    type Outputs = (Tensor, Tensor, Tensor);

    fn run(
        (grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask): BackwardArgs,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        BACKWARD.call();
        let (weight, bias) = (Tensor::defined(weight)?, Tensor::defined(bias)?);
        let saved = Saved {
            grad_out: &grad_out,
            mean: &mean,
            rstd: &rstd,
        };
        let params = (weight.as_ref(), bias.as_ref());
        check_devices(DeviceType::CUDA, &input, params, Some(saved))?;
        let mask = mask3(&output_mask)?;
        let (rows, cols) = check_inputs(&input, &normalized_shape, weight.as_ref(), bias.as_ref())?;
        for (want, p) in [(mask[1], &weight), (mask[2], &bias)] {
            if want && p.is_none() {
                return Err(missing_parameter());
            }
        }
        let device = input.device()?;
        let _guard = DeviceGuard::new(device.index)?;
        let dtype = input.dtype()?;
        let sizes = input.sizes()?;
        let dx = mask[0]
            .then(|| NewTensor::empty(sizes, dtype, device))
            .transpose()?
            .map(NewTensor::finish);
        // dw and db in the parameters' shapes and dtypes (zeros when there are no rows).
        let grad_of = |want: bool, p: &Option<Tensor>| -> Result<Option<Tensor>> {
            match (want, p) {
                (true, Some(p)) if rows == 0 => {
                    Ok(Some(filled(p.sizes()?, p.dtype()?, device, 0.0)?))
                }
                (true, Some(p)) => Ok(Some(
                    NewTensor::empty(p.sizes()?, p.dtype()?, device)?.finish(),
                )),
                _ => Ok(None),
            }
        };
        let (dw, db) = (grad_of(mask[1], &weight)?, grad_of(mask[2], &bias)?);
        if rows > 0 && cols > 0 && (mask[0] || mask[1] || mask[2]) {
            if !dtype.is_float() {
                return Err(not_implemented("LayerNormBackwardKernelImpl", dtype));
            }
            let acc = acc_dtype(dtype);
            expect_dtype(dtype, grad_out.dtype()?)?;
            expect_dtype(acc, mean.dtype()?)?;
            expect_dtype(acc, rstd.dtype()?)?;
            graft_abi::ensure!(
                grad_out.sizes()? == sizes,
                "grad_out of size {:?} does not match input of size {:?}",
                grad_out.sizes()?,
                sizes
            );
            for (name, t) in [("mean", &mean), ("rstd", &rstd)] {
                graft_abi::ensure!(
                    t.numel()? == rows,
                    "{name} has {} elements, expected one per normalized row ({rows})",
                    t.numel()?
                );
            }
            let (_w, w) = param(weight.as_ref(), dtype)?;
            if let Some(b) = &bias {
                expect_dtype(dtype, b.dtype()?)?;
            }
            let dy = contiguous(&grad_out)?;
            let x = contiguous(&input)?;
            let (mean, rstd) = (contiguous_as(&mean, acc)?, contiguous_as(&rstd, acc)?);
            let kdtype = kernel_dtype(dtype);
            let sums = mask[1] || mask[2];
            let workspace_bytes = graft_cuda::layer_norm_backward_workspace_bytes(
                device.index,
                kdtype,
                rows,
                cols,
                sums,
            )
            .map_err(cuda_error)?;
            let workspace = sums
                .then(|| NewTensor::empty(&[workspace_bytes.max(16) as i64], DType::U8, device))
                .transpose()?
                .map(NewTensor::finish);
            graft_cuda::layer_norm_backward(&LayerNormBackward {
                device: device.index,
                stream: current_stream(device.index)? as usize,
                dtype: kdtype,
                dy: ptr(&dy)?,
                x: ptr(&x)?,
                mean: ptr(&mean)?,
                rstd: ptr(&rstd)?,
                weight: w,
                dx: dx.as_ref().map(ptr).transpose()?,
                dw: dw.as_ref().map(ptr).transpose()?,
                db: db.as_ref().map(ptr).transpose()?,
                workspace: workspace.as_ref().map(ptr).transpose()?.unwrap_or(0),
                workspace_bytes,
                rows,
                cols,
            })
            .map_err(cuda_error)?;
        }
        Ok((
            dx.map_or_else(Tensor::undefined, Ok)?,
            dw.map_or_else(Tensor::undefined, Ok)?,
            db.map_or_else(Tensor::undefined, Ok)?,
        ))
    }
}

/// Registers both CUDA kernels in `lib` (an `aten` implementation library at CUDA).
pub fn register(lib: &mut graft_abi::Library) -> Result<()> {
    lib.register::<ForwardCuda>(c"native_layer_norm")?;
    lib.register::<BackwardCuda>(c"native_layer_norm_backward")
}
