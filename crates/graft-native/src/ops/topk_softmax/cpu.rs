//! MoE routing on CPU: graft-kernels' kernels on torch's thread pool.

use graft_abi::{DType, Device, DeviceType, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::ops::topk_softmax::{self, Routing, RoutingMath};
use graft_kernels::Float;
use half::{bf16, f16};

use super::{check_backward, check_forward};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, unsupported};
use crate::common::threads::TorchPool;

pub static TOPK_SOFTMAX_CPU: Counters = Counters::new();
pub static TOPK_SOFTMAX_BACKWARD_CPU: Counters = Counters::new();

fn routing(logits: &Tensor, k: usize, renormalize: bool) -> Result<Routing> {
    let sizes = logits.sizes()?;
    Ok(Routing {
        rows: sizes[0] as usize,
        experts: sizes[1] as usize,
        k,
        renormalize,
    })
}

fn forward_typed<T: Float + Element>(
    logits: &Tensor,
    k: usize,
    renormalize: bool,
) -> Result<(Tensor, Tensor)>
where
    T::Acc: RoutingMath + Element,
{
    let shape = routing(logits, k, renormalize)?;
    let x = contiguous(logits)?;
    let out = [shape.rows as i64, k as i64];
    let mut weights = NewTensor::empty(&out, <T::Acc as Element>::DTYPE, Device::CPU)?;
    let mut indices = NewTensor::empty(&out, DType::I64, Device::CPU)?;
    topk_softmax::forward::<T>(
        shape,
        x.as_slice()?,
        weights.as_mut_slice()?,
        indices.as_mut_slice()?,
        &TorchPool,
    );
    Ok((weights.finish(), indices.finish()))
}

fn backward_typed<T: Float + Element>(
    grad_weights: &Tensor,
    logits: &Tensor,
    weights: &Tensor,
    indices: &Tensor,
    renormalize: bool,
) -> Result<Tensor>
where
    T::Acc: RoutingMath + Element,
{
    let k = weights.sizes()?[1] as usize;
    let shape = routing(logits, k, renormalize)?;
    let (g, x, w, i) = (
        contiguous(grad_weights)?,
        contiguous(logits)?,
        contiguous(weights)?,
        contiguous(indices)?,
    );
    let mut grad = NewTensor::empty(logits.sizes()?, T::DTYPE, Device::CPU)?;
    topk_softmax::backward::<T>(
        shape,
        g.as_slice()?,
        x.as_slice()?,
        w.as_slice()?,
        i.as_slice()?,
        grad.as_mut_slice()?,
        &TorchPool,
    );
    Ok(grad.finish())
}

/// `torchgraft::topk_softmax` at CPU.
pub struct TopkSoftmaxCpu;

impl Kernel for TopkSoftmaxCpu {
    type Args = (Tensor, i64, bool);
    type Outputs = (Tensor, Tensor);
    fn run((logits, k, renormalize): Self::Args) -> Result<(Tensor, Tensor)> {
        const OP: &str = "topk_softmax";
        TOPK_SOFTMAX_CPU.call();
        let dtype = check_forward(OP, DeviceType::CPU, &logits, k)?.dtype;
        let k = k as usize;
        match dtype {
            DType::F32 => forward_typed::<f32>(&logits, k, renormalize),
            DType::F64 => forward_typed::<f64>(&logits, k, renormalize),
            DType::BF16 => forward_typed::<bf16>(&logits, k, renormalize),
            DType::F16 => forward_typed::<f16>(&logits, k, renormalize),
            other => Err(unsupported(OP, other)),
        }
    }
}

/// `torchgraft::topk_softmax_backward` at CPU.
pub struct TopkSoftmaxBackwardCpu;

impl Kernel for TopkSoftmaxBackwardCpu {
    type Args = (Tensor, Tensor, Tensor, Tensor, bool);
    type Outputs = (Tensor,);
    fn run((g, logits, w, indices, renormalize): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "topk_softmax_backward";
        TOPK_SOFTMAX_BACKWARD_CPU.call();
        let dtype = check_backward(OP, DeviceType::CPU, &g, &logits, &w, &indices)?.dtype;
        let grad = match dtype {
            DType::F32 => backward_typed::<f32>(&g, &logits, &w, &indices, renormalize),
            DType::F64 => backward_typed::<f64>(&g, &logits, &w, &indices, renormalize),
            DType::BF16 => backward_typed::<bf16>(&g, &logits, &w, &indices, renormalize),
            DType::F16 => backward_typed::<f16>(&g, &logits, &w, &indices, renormalize),
            other => Err(unsupported(OP, other)),
        }?;
        Ok((grad,))
    }
}
