//! Sigmoid group-limited MoE routing on CUDA: graft-cuda's kernels on PyTorch's current stream
//! of the logits' device.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{Checked, DType, DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{TopkSigmoidBackward, TopkSigmoidForward};

use super::{check_backward, check_forward, Grouping};
use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous};

pub static TOPK_SIGMOID_CUDA: Counters = Counters::new();
pub static TOPK_SIGMOID_BACKWARD_CUDA: Counters = Counters::new();

/// `torchgraft::topk_sigmoid` at CUDA.
pub struct TopkSigmoidCuda;

impl Kernel for TopkSigmoidCuda {
    type Args = (Tensor, Option<Tensor>, i64, i64, i64, bool, f64);
    type Outputs = (Tensor, Tensor);
    fn run(
        (logits, bias, k, groups, topk_groups, renormalize, scale): Self::Args,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "topk_sigmoid";
        TOPK_SIGMOID_CUDA.call();
        let bias = Tensor::defined(bias)?;
        let (Checked { device, dtype }, grouping) = check_forward(
            OP,
            DeviceType::CUDA,
            &logits,
            bias.as_ref(),
            k,
            groups,
            topk_groups,
        )?;
        let Grouping {
            k,
            groups,
            topk_groups,
        } = grouping;
        let kernel_dtype = cuda_dtype(OP, dtype)?;
        let _guard = DeviceGuard::new(device.index)?;
        let sizes = logits.sizes()?;
        let (rows, experts) = (sizes[0] as usize, sizes[1] as usize);
        let x = contiguous(&logits)?;
        let b = bias.as_ref().map(contiguous).transpose()?;
        let out = [rows as i64, k as i64];
        let weights = NewTensor::empty(&out, acc_dtype(dtype), device)?.finish();
        let indices = NewTensor::empty(&out, DType::I64, device)?.finish();
        graft_cuda::topk_sigmoid_forward(&TopkSigmoidForward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: kernel_dtype,
            logits: ptr(&x)?,
            bias: b.as_ref().map_or(Ok(0), ptr)?,
            weights: ptr(&weights)?,
            indices: ptr(&indices)?,
            rows,
            experts,
            k,
            groups,
            topk_groups,
            renormalize,
            scale,
        })
        .map_err(cuda_error)?;
        Ok((weights, indices))
    }
}

/// `torchgraft::topk_sigmoid_backward` at CUDA.
pub struct TopkSigmoidBackwardCuda;

impl Kernel for TopkSigmoidBackwardCuda {
    type Args = (Tensor, Tensor, Tensor, bool, f64);
    type Outputs = (Tensor,);
    fn run((g, logits, indices, renormalize, scale): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "topk_sigmoid_backward";
        TOPK_SIGMOID_BACKWARD_CUDA.call();
        let Checked { device, dtype } =
            check_backward(OP, DeviceType::CUDA, &g, &logits, &indices)?;
        let kernel_dtype = cuda_dtype(OP, dtype)?;
        let _guard = DeviceGuard::new(device.index)?;
        let sizes = logits.sizes()?;
        let (rows, experts) = (sizes[0] as usize, sizes[1] as usize);
        let k = indices.sizes()?[1] as usize;
        let (g, x, i) = (contiguous(&g)?, contiguous(&logits)?, contiguous(&indices)?);
        let grad = NewTensor::empty(sizes, dtype, device)?.finish();
        graft_cuda::topk_sigmoid_backward(&TopkSigmoidBackward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: kernel_dtype,
            grad_weights: ptr(&g)?,
            logits: ptr(&x)?,
            indices: ptr(&i)?,
            grad_logits: ptr(&grad)?,
            rows,
            experts,
            k,
            renormalize,
            scale,
        })
        .map_err(cuda_error)?;
        Ok((grad,))
    }
}
