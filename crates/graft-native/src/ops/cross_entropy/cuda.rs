//! Cross-entropy on CUDA: graft-cuda's row kernels on PyTorch's current stream of the tensors'
//! device.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{DType, Device, DeviceType, Kernel, NewTensor, Result, Tensor};

use super::{check_logits, empty_row_loss, row_len, without_classes, Loss, Reduction};
use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, filled};

pub static CROSS_ENTROPY_CUDA: Counters = Counters::new();
pub static CROSS_ENTROPY_INPLACE_CUDA: Counters = Counters::new();

/// The device state of one CUDA call: the guard, the stream.
pub(crate) struct CudaCall {
    _guard: DeviceGuard,
    pub device: Device,
    pub stream: usize,
}

impl CudaCall {
    pub(crate) fn new(device: Device) -> Result<CudaCall> {
        let guard = DeviceGuard::new(device.index)?;
        let stream = current_stream(device.index)? as usize;
        Ok(CudaCall {
            _guard: guard,
            device,
            stream,
        })
    }

    /// Checks the targets (a device-side assertion on a bad one) and counts the rows not
    /// ignored into a new one-element float64 tensor.
    pub(crate) fn count(&self, target: &Tensor, cols: usize, ignore_index: i64) -> Result<Tensor> {
        let count = NewTensor::empty(&[1], DType::F64, self.device)?.finish();
        graft_cuda::cross_entropy_count(&graft_cuda::CrossEntropyCount {
            device: self.device.index,
            stream: self.stream,
            target: ptr(target)?,
            count: ptr(&count)?,
            rows: target.numel()?,
            cols,
            ignore_index,
        })
        .map_err(cuda_error)?;
        Ok(count)
    }

    /// The reduced loss of `loss_rows` (the rows themselves for `none`).
    pub(crate) fn reduce(
        &self,
        loss_rows: Tensor,
        reduction: Reduction,
        count: &Tensor,
    ) -> Result<Tensor> {
        if reduction == Reduction::None {
            return Ok(loss_rows);
        }
        let dtype = loss_rows.dtype()?;
        let out = NewTensor::empty(&[], dtype, self.device)?.finish();
        graft_cuda::cross_entropy_reduce(&graft_cuda::CrossEntropyReduce {
            device: self.device.index,
            stream: self.stream,
            dtype: cuda_dtype("cross_entropy", dtype)?,
            loss_rows: ptr(&loss_rows)?,
            count: if reduction == Reduction::Mean {
                Some(ptr(count)?)
            } else {
                None
            },
            out: ptr(&out)?,
            rows: loss_rows.numel()?,
        })
        .map_err(cuda_error)?;
        Ok(out)
    }
}

/// The rows of one CUDA launch, as device pointers.
pub(crate) struct CudaRows {
    pub dtype: DType,
    pub logits: u64,
    pub target: u64,
    pub grad: Option<u64>,
    pub loss_rows: u64,
    /// The count tensor's address for a mean (the gradient is divided by it).
    pub count: Option<u64>,
    pub row_scale: Option<u64>,
    pub rows: usize,
    pub cols: usize,
}

/// Launches the rows kernel on `call`'s stream (nothing for zero rows or classes).
pub(crate) fn rows_cuda(call: &CudaCall, r: &CudaRows, loss: &Loss) -> Result<()> {
    if r.rows == 0 || r.cols == 0 {
        return Ok(());
    }
    graft_cuda::cross_entropy_rows(&graft_cuda::CrossEntropyRows {
        device: call.device.index,
        stream: call.stream,
        dtype: cuda_dtype("cross_entropy", r.dtype)?,
        logits: r.logits,
        target: r.target,
        grad: r.grad,
        loss: r.loss_rows,
        count: r.count,
        row_scale: r.row_scale,
        rows: r.rows,
        cols: r.cols,
        ignore_index: loss.ignore_index,
        smoothing: loss.smoothing,
    })
    .map_err(cuda_error)
}

/// `cross_entropy` (`in_place`: over the logits, which must be contiguous) on CUDA.
fn forward_cuda(
    logits: &Tensor,
    target: &Tensor,
    loss: &Loss,
    grad: CudaGradMode,
) -> Result<(Tensor, Tensor)> {
    let device = logits.device()?;
    let call = CudaCall::new(device)?;
    let dtype = logits.dtype()?;
    let sizes = logits.sizes()?;
    let (rows, cols) = (sizes[0] as usize, sizes[1] as usize);
    let t = contiguous(target)?;
    let count = call.count(&t, cols, loss.ignore_index)?;
    let (x, g) = match grad {
        CudaGradMode::InPlace => (logits.new_ref()?, None),
        CudaGradMode::New => (
            contiguous(logits)?,
            Some(NewTensor::empty(sizes, dtype, device)?.finish()),
        ),
        CudaGradMode::None => (
            contiguous(logits)?,
            Some(NewTensor::empty(&[0], dtype, device)?.finish()),
        ),
    };
    let grad_ptr = match grad {
        CudaGradMode::InPlace => Some(ptr(&x)?),
        CudaGradMode::New => Some(ptr(g.as_ref().expect("allocated"))?),
        CudaGradMode::None => None,
    };
    let loss_rows = if cols == 0 {
        // The rows kernel does not run: the losses of rows of no classes.
        filled(
            &[rows as i64],
            acc_dtype(dtype),
            device,
            empty_row_loss(loss),
        )?
    } else {
        NewTensor::empty(&[rows as i64], acc_dtype(dtype), device)?.finish()
    };
    rows_cuda(
        &call,
        &CudaRows {
            dtype,
            logits: ptr(&x)?,
            target: ptr(&t)?,
            grad: grad_ptr,
            loss_rows: ptr(&loss_rows)?,
            count: if loss.reduction == Reduction::Mean {
                Some(ptr(&count)?)
            } else {
                None
            },
            row_scale: None,
            rows,
            cols,
        },
        loss,
    )?;
    let out = without_classes(call.reduce(loss_rows, loss.reduction, &count)?, loss, cols)?;
    let g = match g {
        Some(g) => g,
        None => Tensor::undefined()?,
    };
    Ok((out, g))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum CudaGradMode {
    None,
    New,
    InPlace,
}

pub(super) fn scale_cuda(
    src: &Tensor,
    dst: &Tensor,
    factors: &Tensor,
    per_row: bool,
) -> Result<()> {
    let device = src.device()?;
    let call = CudaCall::new(device)?;
    let n = src.numel()?;
    graft_cuda::scale_grad(&graft_cuda::ScaleGrad {
        device: device.index,
        stream: call.stream,
        dtype: cuda_dtype("scale_grad", src.dtype()?)?,
        src: ptr(src)?,
        dst: ptr(dst)?,
        factor: ptr(factors)?,
        per_row,
        n,
        cols: if per_row { row_len(src)? } else { n.max(1) },
    })
    .map_err(cuda_error)
}

/// `torchgraft::cross_entropy` at CUDA.
pub struct CrossEntropyCuda;

impl Kernel for CrossEntropyCuda {
    type Args = (Tensor, Tensor, i64, i64, f64, bool);
    type Outputs = (Tensor, Tensor);
    fn run((logits, target, ignore, reduction, eps, grad): Self::Args) -> Result<Self::Outputs> {
        CROSS_ENTROPY_CUDA.call();
        let loss = Loss::new("cross_entropy", ignore, reduction, eps)?;
        check_logits("cross_entropy", DeviceType::CUDA, &logits, &target, false)?;
        let mode = if grad {
            CudaGradMode::New
        } else {
            CudaGradMode::None
        };
        forward_cuda(&logits, &target, &loss, mode)
    }
}

/// `torchgraft::cross_entropy_` at CUDA.
pub struct CrossEntropyInPlaceCuda;

impl Kernel for CrossEntropyInPlaceCuda {
    type Args = (Tensor, Tensor, i64, i64, f64);
    type Outputs = (Tensor,);
    fn run((logits, target, ignore, reduction, eps): Self::Args) -> Result<(Tensor,)> {
        CROSS_ENTROPY_INPLACE_CUDA.call();
        let loss = Loss::new("cross_entropy_", ignore, reduction, eps)?;
        check_logits("cross_entropy_", DeviceType::CUDA, &logits, &target, true)?;
        let (out, _) = forward_cuda(&logits, &target, &loss, CudaGradMode::InPlace)?;
        Ok((out,))
    }
}
