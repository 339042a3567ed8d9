//! RoPE on CUDA: graft-cuda's kernel on PyTorch's current stream of the tensors' device.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{DeviceType, Kernel, Result, Tensor};
use graft_cuda::{RopeArgs, RopeOperand as CudaOperand};

use super::{Call, Operand};
use crate::common::cuda::{cuda_dtype, ptr};
use crate::common::stats::Counters;

pub static ROPE_CUDA: Counters = Counters::new();
pub static ROPE_BACKWARD_CUDA: Counters = Counters::new();

fn cuda_operand(o: &Operand) -> Result<CudaOperand> {
    Ok(CudaOperand {
        x: ptr(&o.x)?,
        out: ptr(o.out.tensor())?,
        sizes: o.sizes,
        x_strides: o.x_strides,
        cos_strides: o.cos_strides,
        sin_strides: o.sin_strides,
        head_dim: o.head_dim,
    })
}

fn run_cuda(
    op: &str,
    backward: bool,
    x: [&Tensor; 2],
    cos: &Tensor,
    sin: &Tensor,
    unsqueeze_dim: i64,
) -> Result<(Tensor, Tensor)> {
    let call = Call::new(op, DeviceType::CUDA, backward, x, cos, sin, unsqueeze_dim)?;
    let _guard = DeviceGuard::new(call.device.index)?;
    let args = |operands: [CudaOperand; 2], o: &Operand| -> Result<RopeArgs> {
        Ok(RopeArgs {
            device: call.device.index,
            stream: current_stream(call.device.index)? as usize,
            dtype: cuda_dtype(op, call.dtype)?,
            backward,
            operands,
            cos: ptr(&o.cos)?,
            sin: ptr(&o.sin)?,
            rotary_dim: call.rotary_dim,
        })
    };
    let [q, k] = &call.ops;
    let (cq, ck) = (cuda_operand(q)?, cuda_operand(k)?);
    let launch =
        |a: RopeArgs| graft_cuda::rope(&a).map_err(|e| graft_abi::Error::msg(e.to_string()));
    if ptr(&q.cos)? == ptr(&k.cos)? && ptr(&q.sin)? == ptr(&k.sin)? {
        launch(args([cq, ck], q)?)?;
    } else {
        // Tables materialized per operand (layouts with more than three leading dimensions).
        launch(args([cq, CudaOperand::default()], q)?)?;
        launch(args([ck, CudaOperand::default()], k)?)?;
    }
    Ok(call.outputs())
}

/// `torchgraft::rope` at CUDA.
pub struct RopeCuda;

impl Kernel for RopeCuda {
    type Args = (Tensor, Tensor, Tensor, Tensor, i64);
    type Outputs = (Tensor, Tensor);
    fn run((q, k, cos, sin, dim): Self::Args) -> Result<(Tensor, Tensor)> {
        ROPE_CUDA.call();
        run_cuda("rope", false, [&q, &k], &cos, &sin, dim)
    }
}

/// `torchgraft::rope_backward` at CUDA.
pub struct RopeBackwardCuda;

impl Kernel for RopeBackwardCuda {
    type Args = (Tensor, Tensor, Tensor, Tensor, i64);
    type Outputs = (Tensor, Tensor);
    fn run((gq, gk, cos, sin, dim): Self::Args) -> Result<(Tensor, Tensor)> {
        ROPE_BACKWARD_CUDA.call();
        run_cuda("rope_backward", true, [&gq, &gk], &cos, &sin, dim)
    }
}
