//! Cross-entropy: `torchgraft::cross_entropy` (the loss and, in the same pass over the logits,
//! its gradient), `cross_entropy_` (the gradient written over the logits), and the backward's
//! `scale_grad` / `scale_grad_` (a saved gradient times the upstream gradient), on CPU
//! (graft-kernels) and CUDA (graft-cuda).
//!
//! Semantics: `F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...,
//! label_smoothing=...)` for 2-D logits `(N, V)` and targets `(N,)`; the loss is float32 (float64
//! for float64 logits). The gradient is the loss's (before the upstream gradient), in the logits'
//! dtype. The row work is shared with `linear_cross_entropy` through [`rows_cpu`] and
//! [`rows_cuda`].

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{
    contiguous_strides, ensure, in_place_views, DType, Device, DeviceType, Element, Error, Kernel,
    NewTensor, Operands, Result, Tensor,
};
use graft_kernels::ops::cross_entropy::{self as ce, BadTarget, CeMath, Options, Scale};
use graft_kernels::{Acc, Float};
use half::{bf16, f16};

use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous, filled, to_dtype, unsupported};
use crate::common::threads::TorchPool;

pub static CROSS_ENTROPY_CPU: Counters = Counters::new();
pub static CROSS_ENTROPY_CUDA: Counters = Counters::new();
pub static CROSS_ENTROPY_INPLACE_CPU: Counters = Counters::new();
pub static CROSS_ENTROPY_INPLACE_CUDA: Counters = Counters::new();
pub static SCALE_GRAD_CPU: Counters = Counters::new();
pub static SCALE_GRAD_CUDA: Counters = Counters::new();
pub static SCALE_GRAD_INPLACE_CPU: Counters = Counters::new();
pub static SCALE_GRAD_INPLACE_CUDA: Counters = Counters::new();

/// ATen's `Reduction` enum values, as the schemas take them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduction {
    None,
    Mean,
    Sum,
}

impl Reduction {
    pub(crate) fn from_i64(op: &str, r: i64) -> Result<Reduction> {
        match r {
            0 => Ok(Reduction::None),
            1 => Ok(Reduction::Mean),
            2 => Ok(Reduction::Sum),
            _ => Err(Error::msg(format!(
                "{op}: {r} is not a valid value for reduction (0: none, 1: mean, 2: sum)"
            ))),
        }
    }
}

/// The loss's parameters, checked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loss {
    pub ignore_index: i64,
    pub reduction: Reduction,
    /// In `[0, 1]` (negative values mean none, as in ATen).
    pub smoothing: f64,
}

impl Loss {
    pub(crate) fn new(op: &str, ignore_index: i64, reduction: i64, smoothing: f64) -> Result<Loss> {
        ensure!(
            smoothing <= 1.0,
            "label_smoothing must be between 0.0 and 1.0. Got: {smoothing}"
        );
        Ok(Loss {
            ignore_index,
            reduction: Reduction::from_i64(op, reduction)?,
            // ATen applies no smoothing for negative values (and NaN compares false).
            smoothing: if smoothing > 0.0 { smoothing } else { 0.0 },
        })
    }

    fn options(&self, cols: usize) -> Options {
        Options {
            cols,
            ignore_index: self.ignore_index,
            smoothing: self.smoothing,
        }
    }
}

/// The device type a kernel of this device flag computes on.
pub(crate) fn kernel_device(cuda: bool) -> DeviceType {
    if cuda {
        DeviceType::CUDA
    } else {
        DeviceType::CPU
    }
}

/// Checks `(N, V)` logits (written by the in-place op, which needs them contiguous) and their
/// `(N,)` target as ATen checks `cross_entropy`'s; returns `(N, V)`.
pub(crate) fn check_logits(
    op: &str,
    kernel: DeviceType,
    logits: &Tensor,
    target: &Tensor,
    in_place: bool,
) -> Result<(usize, usize)> {
    let sizes = logits.sizes()?;
    let rows = if sizes.len() == 2 { sizes[0] } else { 0 };
    let operands = if in_place {
        Operands::new(op, kernel)
            .written("logits", logits)
            .contiguous()
            .message("{op}: the logits must be contiguous to take the gradient in place")
    } else {
        Operands::new(op, kernel).tensor("logits", logits)
    };
    let operands = operands
        .float()
        .dims(2)
        .message("{op}: expected 2-D logits (N, V), got {got} dimensions");
    with_target(operands, target, rows).check()?;
    Ok((sizes[0] as usize, sizes[1] as usize))
}

/// `operands` and a `(rows,)` int64 target on the call's device, with ATen's messages.
pub(crate) fn with_target<'a>(
    operands: Operands<'a>,
    target: &'a Tensor,
    rows: i64,
) -> Operands<'a> {
    operands
        .tensor("target", target)
        .dtype(DType::I64)
        .message("expected target dtype to be Long or Byte, but got {got}")
        .dims(1)
        .message("{op}: expected a 1-D target, got {got} dimensions")
        .size(0, rows)
        .message("Expected input batch_size ({want}) to match target batch_size ({got}).")
}

fn bad_target(e: BadTarget) -> Error {
    Error::msg(format!("Target {} is out of bounds.", e.0))
}

/// The loss of `loss_rows` (per-row, `rows` of the accumulation dtype) for `reduction`: the
/// rows themselves, or a new 0-dim sum / mean. CPU only.
fn reduce_cpu<A>(loss_rows: NewTensor, reduction: Reduction, valid: usize) -> Result<Tensor>
where
    A: CeMath + Element + Into<f64>,
{
    if reduction == Reduction::None {
        return Ok(loss_rows.finish());
    }
    let total = ce::reduce(
        loss_rows.tensor().as_slice::<A>()?,
        reduction == Reduction::Mean,
        valid,
    );
    let mut out = NewTensor::empty(&[], A::DTYPE, Device::CPU)?;
    out.as_mut_slice::<A>()?[0] = total;
    Ok(out.finish())
}

// ------------------------------------------------------------------------------------ CPU

/// The rows of one CPU call and where their gradient goes.
pub(crate) enum CpuRows<'a, T> {
    /// The losses only.
    LossOnly(&'a [T]),
    /// The gradient into its own buffer, like the logits.
    Into { logits: &'a [T], grad: &'a mut [T] },
    /// The gradient over the logits.
    InPlace(&'a mut [T]),
}

/// Per-row losses (and gradients) of `rows` on the CPU (targets already checked).
pub(crate) fn rows_cpu<T>(
    rows: CpuRows<'_, T>,
    target: &[i64],
    cols: usize,
    loss: &Loss,
    loss_rows: &mut [T::Acc],
    scale: (f64, Option<&[T::Acc]>),
) where
    T: Float + Element,
    T::Acc: CeMath,
{
    if cols == 0 {
        // Only possible when every row is ignored (targets were checked).
        loss_rows.fill(T::Acc::from_f64(empty_row_loss(loss)));
        return;
    }
    let o = loss.options(cols);
    let scale = Scale {
        all: T::Acc::from_f64(scale.0),
        rows: scale.1,
    };
    match rows {
        CpuRows::LossOnly(x) => ce::forward(x, target, &o, loss_rows, None, &TorchPool),
        CpuRows::Into { logits, grad } => {
            ce::forward(
                logits,
                target,
                &o,
                loss_rows,
                Some((grad, scale)),
                &TorchPool,
            );
        }
        CpuRows::InPlace(x) => ce::forward_in_place(x, target, &o, loss_rows, scale, &TorchPool),
    }
}

/// The loss of a row of no classes (ignored, as every such row must be): 0, or with label
/// smoothing NaN, as ATen divides the smoothing term by the number of classes.
pub(crate) fn empty_row_loss(loss: &Loss) -> f64 {
    if loss.smoothing > 0.0 {
        f64::NAN
    } else {
        0.0
    }
}

/// The reduced loss `out` of a call over `cols` classes: with no classes and label smoothing
/// NaN whatever the rows (ATen multiplies the smoothing term by `smoothing / 0`).
fn without_classes(out: Tensor, loss: &Loss, cols: usize) -> Result<Tensor> {
    if cols > 0 || loss.smoothing <= 0.0 || loss.reduction == Reduction::None {
        return Ok(out);
    }
    filled(&[], out.dtype()?, out.device()?, f64::NAN)
}

/// Checks the targets of a CPU call; returns the rows not ignored.
pub(crate) fn count_cpu(target: &Tensor, cols: usize, ignore_index: i64) -> Result<usize> {
    ce::count_valid(target.as_slice::<i64>()?, cols, ignore_index).map_err(bad_target)
}

/// `1 / valid` for a mean, else 1.
pub(crate) fn grad_scale(reduction: Reduction, valid: usize) -> f64 {
    if reduction == Reduction::Mean {
        1.0 / valid as f64
    } else {
        1.0
    }
}

fn forward_cpu_typed<T>(
    logits: &Tensor,
    target: &Tensor,
    loss: &Loss,
    compute_grad: bool,
) -> Result<(Tensor, Tensor)>
where
    T: Float + Element,
    T::Acc: CeMath + Element + Into<f64>,
{
    let sizes = logits.sizes()?;
    let (rows, cols) = (sizes[0] as usize, sizes[1] as usize);
    let (x, t) = (contiguous(logits)?, contiguous(target)?);
    let valid = count_cpu(&t, cols, loss.ignore_index)?;
    let mut loss_rows = NewTensor::empty(&[rows as i64], T::Acc::DTYPE, Device::CPU)?;
    let mut grad = NewTensor::empty(
        if compute_grad { sizes } else { &[0] },
        T::DTYPE,
        Device::CPU,
    )?;
    let logits = x.as_slice()?;
    let rows_and_grad = if compute_grad {
        CpuRows::Into {
            logits,
            grad: grad.as_mut_slice::<T>()?,
        }
    } else {
        CpuRows::LossOnly(logits)
    };
    rows_cpu::<T>(
        rows_and_grad,
        t.as_slice()?,
        cols,
        loss,
        loss_rows.as_mut_slice()?,
        (grad_scale(loss.reduction, valid), None),
    );
    let out = reduce_cpu::<T::Acc>(loss_rows, loss.reduction, valid)?;
    Ok((without_classes(out, loss, cols)?, grad.finish()))
}

/// A new contiguous copy of `t`: memory no other argument can share (for the small read-only
/// arguments of in-place kernels, which then cannot alias the tensor being written).
fn private_copy(t: &Tensor) -> Result<Tensor> {
    let sizes = t.sizes()?;
    let out = Tensor::empty_strided(sizes, &contiguous_strides(sizes), t.dtype()?, t.device()?)?;
    out.copy_from(t)?;
    Ok(out)
}

fn inplace_cpu_typed<T>(logits: &mut Tensor, target: &Tensor, loss: &Loss) -> Result<Tensor>
where
    T: Float + Element,
    T::Acc: CeMath + Element + Into<f64>,
{
    let sizes = logits.sizes()?;
    let (rows, cols) = (sizes[0] as usize, sizes[1] as usize);
    let t = private_copy(target)?;
    let valid = count_cpu(&t, cols, loss.ignore_index)?;
    let mut loss_rows = NewTensor::empty(&[rows as i64], T::Acc::DTYPE, Device::CPU)?;
    let mut views = in_place_views::<T>(vec![logits])?;
    rows_cpu::<T>(
        CpuRows::InPlace(views.remove(0)),
        t.as_slice()?,
        cols,
        loss,
        loss_rows.as_mut_slice()?,
        (grad_scale(loss.reduction, valid), None),
    );
    let out = reduce_cpu::<T::Acc>(loss_rows, loss.reduction, valid)?;
    without_classes(out, loss, cols)
}

// ----------------------------------------------------------------------------------- CUDA

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

// ------------------------------------------------------------------------ gradient scaling

/// Checks `grad` (written by the in-place op, which needs it contiguous) and `grad_output`
/// for [`scale_grad`]: 0-dim (one factor), or `(rows,)` for a gradient of `rows` rows (one
/// factor per row). Returns whether it is per row, and the factors converted to `grad`'s
/// accumulation dtype.
fn check_scale(
    op: &str,
    kernel: DeviceType,
    grad: &Tensor,
    grad_output: &Tensor,
    in_place: bool,
) -> Result<(bool, Tensor)> {
    let operands = if in_place {
        Operands::new(op, kernel)
            .written("grad", grad)
            .contiguous()
            .message("{op}: the gradient must be contiguous")
    } else {
        Operands::new(op, kernel).tensor("grad", grad)
    };
    let dtype = operands
        .float()
        .tensor("grad_output", grad_output)
        .float()
        .check()?
        .dtype;
    let gs = grad.sizes()?;
    let os = grad_output.sizes()?;
    let per_row = match os.len() {
        0 => false,
        1 if !gs.is_empty() && os[0] == gs[0] => true,
        _ => {
            return Err(Error::msg(format!(
                "{op}: grad_output of size {os:?} does not fit a gradient of size {gs:?} (a \
                 scalar, or one value per row)"
            )))
        }
    };
    // A private copy (a scalar or one value per row): it cannot share memory with `grad`.
    let factors = private_copy(&to_dtype(grad_output, acc_dtype(dtype))?)?;
    Ok((per_row, factors))
}

/// Row length of `grad` for per-row factors (its elements over its first dimension).
fn row_len(grad: &Tensor) -> Result<usize> {
    let sizes = grad.sizes()?;
    let rows = sizes.first().copied().unwrap_or(1).max(1) as usize;
    Ok(grad.numel()? / rows)
}

fn scale_cpu_typed<T>(
    src: &Tensor,
    dst: Option<&mut [T]>,
    in_place: Option<&mut Tensor>,
    factors: &Tensor,
    per_row: bool,
) -> Result<()>
where
    T: Float + Element,
    T::Acc: CeMath + Element,
{
    let f = factors.as_slice::<T::Acc>()?;
    let n = src.numel()?;
    let cols = if per_row { row_len(src)? } else { n.max(1) };
    let scale = if per_row {
        Scale {
            all: T::Acc::ONE,
            rows: Some(f),
        }
    } else {
        Scale {
            all: f[0],
            rows: None,
        }
    };
    if n == 0 {
        return Ok(());
    }
    match (dst, in_place) {
        (Some(dst), None) => ce::scale_into(src.as_slice::<T>()?, dst, cols, scale, &TorchPool),
        (None, Some(g)) => {
            let mut views = in_place_views::<T>(vec![g])?;
            ce::scale_in_place(views.remove(0), cols, scale, &TorchPool);
        }
        _ => return Err(Error::msg("scale_grad: inconsistent arguments")),
    }
    Ok(())
}

fn scale_cuda(src: &Tensor, dst: &Tensor, factors: &Tensor, per_row: bool) -> Result<()> {
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

/// `grad * grad_output` as a new tensor.
fn scale_grad(kernel: DeviceType, grad: &Tensor, grad_output: &Tensor) -> Result<Tensor> {
    let (per_row, factors) = check_scale("scale_grad", kernel, grad, grad_output, false)?;
    let g = contiguous(grad)?;
    let (dtype, device) = (g.dtype()?, g.device()?);
    let mut out = NewTensor::empty(g.sizes()?, dtype, device)?;
    if device.kind == DeviceType::CUDA {
        let out = out.finish();
        scale_cuda(&g, &out, &factors, per_row)?;
        return Ok(out);
    }
    macro_rules! typed {
        ($t:ty) => {
            scale_cpu_typed::<$t>(&g, Some(out.as_mut_slice()?), None, &factors, per_row)?
        };
    }
    match dtype {
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        DType::BF16 => typed!(bf16),
        DType::F16 => typed!(f16),
        other => return Err(unsupported("scale_grad", other)),
    }
    Ok(out.finish())
}

/// `grad *= grad_output` in place; elements whose factor is exactly 1 are not touched.
fn scale_grad_(kernel: DeviceType, mut grad: Tensor, grad_output: &Tensor) -> Result<()> {
    let (per_row, factors) = check_scale("scale_grad_", kernel, &grad, grad_output, true)?;
    let (dtype, device) = (grad.dtype()?, grad.device()?);
    if device.kind == DeviceType::CUDA {
        return scale_cuda(&grad, &grad, &factors, per_row);
    }
    let src = grad.new_ref()?;
    macro_rules! typed {
        ($t:ty) => {
            scale_cpu_typed::<$t>(&src, None, Some(&mut grad), &factors, per_row)
        };
    }
    match dtype {
        DType::F32 => typed!(f32),
        DType::F64 => typed!(f64),
        DType::BF16 => typed!(bf16),
        DType::F16 => typed!(f16),
        other => Err(unsupported("scale_grad_", other)),
    }
}

// -------------------------------------------------------------------------------- kernels

fn forward_cpu(
    logits: &Tensor,
    target: &Tensor,
    loss: &Loss,
    compute_grad: bool,
) -> Result<(Tensor, Tensor)> {
    match logits.dtype()? {
        DType::F32 => forward_cpu_typed::<f32>(logits, target, loss, compute_grad),
        DType::F64 => forward_cpu_typed::<f64>(logits, target, loss, compute_grad),
        DType::BF16 => forward_cpu_typed::<bf16>(logits, target, loss, compute_grad),
        DType::F16 => forward_cpu_typed::<f16>(logits, target, loss, compute_grad),
        other => Err(unsupported("cross_entropy", other)),
    }
}

/// `torchgraft::cross_entropy` at CPU: `(loss, grad)`; `grad` is empty without `compute_grad`.
pub struct CrossEntropyCpu;
impl Kernel for CrossEntropyCpu {
    type Args = (Tensor, Tensor, i64, i64, f64, bool);
    type Outputs = (Tensor, Tensor);
    fn run((logits, target, ignore, reduction, eps, grad): Self::Args) -> Result<Self::Outputs> {
        CROSS_ENTROPY_CPU.call();
        let loss = Loss::new("cross_entropy", ignore, reduction, eps)?;
        check_logits("cross_entropy", DeviceType::CPU, &logits, &target, false)?;
        forward_cpu(&logits, &target, &loss, grad)
    }
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

/// `torchgraft::cross_entropy_` at CPU: the loss; the gradient replaces the logits.
pub struct CrossEntropyInPlaceCpu;
impl Kernel for CrossEntropyInPlaceCpu {
    type Args = (Tensor, Tensor, i64, i64, f64);
    type Outputs = (Tensor,);
    fn run((mut logits, target, ignore, reduction, eps): Self::Args) -> Result<(Tensor,)> {
        CROSS_ENTROPY_INPLACE_CPU.call();
        let loss = Loss::new("cross_entropy_", ignore, reduction, eps)?;
        check_logits("cross_entropy_", DeviceType::CPU, &logits, &target, true)?;
        let out = match logits.dtype()? {
            DType::F32 => inplace_cpu_typed::<f32>(&mut logits, &target, &loss),
            DType::F64 => inplace_cpu_typed::<f64>(&mut logits, &target, &loss),
            DType::BF16 => inplace_cpu_typed::<bf16>(&mut logits, &target, &loss),
            DType::F16 => inplace_cpu_typed::<f16>(&mut logits, &target, &loss),
            other => Err(unsupported("cross_entropy_", other)),
        }?;
        Ok((out,))
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

/// `torchgraft::scale_grad` at CPU and CUDA (the device is the tensors').
pub struct ScaleGradKernel<const CUDA: bool>;
impl<const CUDA: bool> Kernel for ScaleGradKernel<CUDA> {
    type Args = (Tensor, Tensor);
    type Outputs = (Tensor,);
    fn run((grad, grad_output): Self::Args) -> Result<(Tensor,)> {
        if CUDA {
            SCALE_GRAD_CUDA.call();
        } else {
            SCALE_GRAD_CPU.call();
        }
        Ok((scale_grad(kernel_device(CUDA), &grad, &grad_output)?,))
    }
}

/// `torchgraft::scale_grad_` at CPU and CUDA.
pub struct ScaleGradInPlaceKernel<const CUDA: bool>;
impl<const CUDA: bool> Kernel for ScaleGradInPlaceKernel<CUDA> {
    type Args = (Tensor, Tensor);
    type Outputs = ();
    fn run((grad, grad_output): Self::Args) -> Result<()> {
        if CUDA {
            SCALE_GRAD_INPLACE_CUDA.call();
        } else {
            SCALE_GRAD_INPLACE_CPU.call();
        }
        scale_grad_(kernel_device(CUDA), grad, &grad_output)
    }
}
