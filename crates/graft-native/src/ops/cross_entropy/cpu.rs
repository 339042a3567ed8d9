//! Cross-entropy on CPU: graft-kernels' row kernels on torch's thread pool.

use graft_abi::{
    in_place_views, DType, Device, DeviceType, Element, Error, Kernel, NewTensor, Result, Tensor,
};
use graft_kernels::ops::cross_entropy::{self as ce, CeMath, Scale};
use graft_kernels::{Acc, Float};
use half::{bf16, f16};

use super::{
    bad_target, check_logits, empty_row_loss, grad_scale, private_copy, row_len, without_classes,
    Loss, Reduction,
};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, unsupported};
use crate::common::threads::TorchPool;

pub static CROSS_ENTROPY_CPU: Counters = Counters::new();
pub static CROSS_ENTROPY_INPLACE_CPU: Counters = Counters::new();

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

/// Checks the targets of a CPU call; returns the rows not ignored.
pub(crate) fn count_cpu(target: &Tensor, cols: usize, ignore_index: i64) -> Result<usize> {
    ce::count_valid(target.as_slice::<i64>()?, cols, ignore_index).map_err(bad_target)
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

pub(super) fn scale_cpu_typed<T>(
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
