//! RoPE on CPU: graft-kernels' kernels on torch's thread pool.

use graft_abi::{DType, DeviceType, Element, Kernel, Result, Tensor};
use graft_kernels::ops::rope::{self, RopeOperand};
use graft_kernels::Float;
use half::{bf16, f16};

use super::Call;
use crate::common::stats::Counters;
use crate::common::tensor::unsupported;
use crate::common::threads::TorchPool;

pub static ROPE_CPU: Counters = Counters::new();
pub static ROPE_BACKWARD_CPU: Counters = Counters::new();

fn run_cpu_typed<T: Float + Element>(call: &mut Call, backward: bool) -> Result<()> {
    let rotary_dim = call.rotary_dim;
    for o in &mut call.ops {
        let operand = RopeOperand {
            sizes: o.sizes,
            x: o.x.as_strided_slice::<T>()?,
            x_strides: o.x_strides,
            cos: o.cos.as_strided_slice::<T>()?,
            cos_strides: o.cos_strides,
            sin: o.sin.as_strided_slice::<T>()?,
            sin_strides: o.sin_strides,
            head_dim: o.head_dim,
            rotary_dim,
        };
        rope::rope(
            &operand,
            backward,
            o.out.as_mut_dense_slice::<T>()?,
            &TorchPool,
        );
    }
    Ok(())
}

fn run_cpu(
    op: &str,
    backward: bool,
    x: [&Tensor; 2],
    cos: &Tensor,
    sin: &Tensor,
    unsqueeze_dim: i64,
) -> Result<(Tensor, Tensor)> {
    let mut call = Call::new(op, DeviceType::CPU, backward, x, cos, sin, unsqueeze_dim)?;
    match call.dtype {
        DType::F32 => run_cpu_typed::<f32>(&mut call, backward)?,
        DType::F64 => run_cpu_typed::<f64>(&mut call, backward)?,
        DType::BF16 => run_cpu_typed::<bf16>(&mut call, backward)?,
        DType::F16 => run_cpu_typed::<f16>(&mut call, backward)?,
        other => return Err(unsupported(op, other)),
    }
    Ok(call.outputs())
}

/// `torchgraft::rope` at CPU.
pub struct RopeCpu;

impl Kernel for RopeCpu {
    type Args = (Tensor, Tensor, Tensor, Tensor, i64);
    type Outputs = (Tensor, Tensor);
    fn run((q, k, cos, sin, dim): Self::Args) -> Result<(Tensor, Tensor)> {
        ROPE_CPU.call();
        run_cpu("rope", false, [&q, &k], &cos, &sin, dim)
    }
}

/// `torchgraft::rope_backward` at CPU.
pub struct RopeBackwardCpu;

impl Kernel for RopeBackwardCpu {
    type Args = (Tensor, Tensor, Tensor, Tensor, i64);
    type Outputs = (Tensor, Tensor);
    fn run((gq, gk, cos, sin, dim): Self::Args) -> Result<(Tensor, Tensor)> {
        ROPE_BACKWARD_CPU.call();
        run_cpu("rope_backward", true, [&gq, &gk], &cos, &sin, dim)
    }
}
