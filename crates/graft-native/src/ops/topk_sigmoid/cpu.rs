//! Sigmoid group-limited MoE routing on CPU: graft-kernels' kernels on torch's thread pool.

use graft_abi::{DType, Device, DeviceType, Element, Kernel, NewTensor, Result, Tensor};
use graft_kernels::ops::topk_sigmoid::{self, GroupedRouting, RoutingMath};
use graft_kernels::Float;
use half::{bf16, f16};

use super::{check_backward, check_forward, Grouping};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, unsupported};
use crate::common::threads::TorchPool;

pub static TOPK_SIGMOID_CPU: Counters = Counters::new();
pub static TOPK_SIGMOID_BACKWARD_CPU: Counters = Counters::new();

fn routing(logits: &Tensor, g: &Grouping, renormalize: bool, scale: f64) -> Result<GroupedRouting> {
    let sizes = logits.sizes()?;
    Ok(GroupedRouting {
        rows: sizes[0] as usize,
        experts: sizes[1] as usize,
        k: g.k,
        groups: g.groups,
        topk_groups: g.topk_groups,
        renormalize,
        scale,
    })
}

fn forward_typed<T: Float + Element>(
    logits: &Tensor,
    bias: Option<&Tensor>,
    grouping: &Grouping,
    renormalize: bool,
    scale: f64,
) -> Result<(Tensor, Tensor)>
where
    T::Acc: RoutingMath + Element,
{
    let shape = routing(logits, grouping, renormalize, scale)?;
    let x = contiguous(logits)?;
    let b = bias.map(contiguous).transpose()?;
    let out = [shape.rows as i64, shape.k as i64];
    let mut weights = NewTensor::empty(&out, <T::Acc as Element>::DTYPE, Device::CPU)?;
    let mut indices = NewTensor::empty(&out, DType::I64, Device::CPU)?;
    topk_sigmoid::forward::<T>(
        shape,
        x.as_slice()?,
        b.as_ref().map(|b| b.as_slice()).transpose()?,
        weights.as_mut_slice()?,
        indices.as_mut_slice()?,
        &TorchPool,
    );
    Ok((weights.finish(), indices.finish()))
}

fn backward_typed<T: Float + Element>(
    grad_weights: &Tensor,
    logits: &Tensor,
    indices: &Tensor,
    renormalize: bool,
    scale: f64,
) -> Result<Tensor>
where
    T::Acc: RoutingMath + Element,
{
    let sizes = logits.sizes()?;
    let shape = GroupedRouting {
        rows: sizes[0] as usize,
        experts: sizes[1] as usize,
        k: indices.sizes()?[1] as usize,
        groups: 1,
        topk_groups: 1,
        renormalize,
        scale,
    };
    let (g, x, i) = (
        contiguous(grad_weights)?,
        contiguous(logits)?,
        contiguous(indices)?,
    );
    let mut grad = NewTensor::empty(sizes, T::DTYPE, Device::CPU)?;
    topk_sigmoid::backward::<T>(
        shape,
        g.as_slice()?,
        x.as_slice()?,
        i.as_slice()?,
        grad.as_mut_slice()?,
        &TorchPool,
    );
    Ok(grad.finish())
}

/// `torchgraft::topk_sigmoid` at CPU.
pub struct TopkSigmoidCpu;

impl Kernel for TopkSigmoidCpu {
    type Args = (Tensor, Option<Tensor>, i64, i64, i64, bool, f64);
    type Outputs = (Tensor, Tensor);
    fn run(
        (logits, bias, k, groups, topk_groups, renormalize, scale): Self::Args,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "topk_sigmoid";
        TOPK_SIGMOID_CPU.call();
        let bias = Tensor::defined(bias)?;
        let (checked, g) = check_forward(
            OP,
            DeviceType::CPU,
            &logits,
            bias.as_ref(),
            k,
            groups,
            topk_groups,
        )?;
        let b = bias.as_ref();
        match checked.dtype {
            DType::F32 => forward_typed::<f32>(&logits, b, &g, renormalize, scale),
            DType::F64 => forward_typed::<f64>(&logits, b, &g, renormalize, scale),
            DType::BF16 => forward_typed::<bf16>(&logits, b, &g, renormalize, scale),
            DType::F16 => forward_typed::<f16>(&logits, b, &g, renormalize, scale),
            other => Err(unsupported(OP, other)),
        }
    }
}

/// `torchgraft::topk_sigmoid_backward` at CPU.
pub struct TopkSigmoidBackwardCpu;

impl Kernel for TopkSigmoidBackwardCpu {
    type Args = (Tensor, Tensor, Tensor, bool, f64);
    type Outputs = (Tensor,);
    fn run((g, logits, indices, renormalize, scale): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "topk_sigmoid_backward";
        TOPK_SIGMOID_BACKWARD_CPU.call();
        let dtype = check_backward(OP, DeviceType::CPU, &g, &logits, &indices)?.dtype;
        let grad = match dtype {
            DType::F32 => backward_typed::<f32>(&g, &logits, &indices, renormalize, scale),
            DType::F64 => backward_typed::<f64>(&g, &logits, &indices, renormalize, scale),
            DType::BF16 => backward_typed::<bf16>(&g, &logits, &indices, renormalize, scale),
            DType::F16 => backward_typed::<f16>(&g, &logits, &indices, renormalize, scale),
            other => Err(unsupported(OP, other)),
        }?;
        Ok((grad,))
    }
}
