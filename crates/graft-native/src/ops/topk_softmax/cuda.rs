//! MoE routing on CUDA: graft-cuda's kernels on PyTorch's current stream of the logits' device.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{Checked, DType, DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{TopkSoftmaxBackward, TopkSoftmaxForward};

use super::{check_backward, check_forward};
use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{acc_dtype, contiguous};

pub static TOPK_SOFTMAX_CUDA: Counters = Counters::new();
pub static TOPK_SOFTMAX_BACKWARD_CUDA: Counters = Counters::new();

/// `torchgraft::topk_softmax` at CUDA.
pub struct TopkSoftmaxCuda;

impl Kernel for TopkSoftmaxCuda {
    type Args = (Tensor, i64, bool);
    type Outputs = (Tensor, Tensor);
    fn run((logits, k, renormalize): Self::Args) -> Result<(Tensor, Tensor)> {
        const OP: &str = "topk_softmax";
        TOPK_SOFTMAX_CUDA.call();
        let Checked { device, dtype } = check_forward(OP, DeviceType::CUDA, &logits, k)?;
        let kernel_dtype = cuda_dtype(OP, dtype)?;
        let _guard = DeviceGuard::new(device.index)?;
        let sizes = logits.sizes()?;
        let (rows, experts) = (sizes[0] as usize, sizes[1] as usize);
        let x = contiguous(&logits)?;
        let out = [rows as i64, k];
        let weights = NewTensor::empty(&out, acc_dtype(dtype), device)?.finish();
        let indices = NewTensor::empty(&out, DType::I64, device)?.finish();
        graft_cuda::topk_softmax_forward(&TopkSoftmaxForward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: kernel_dtype,
            logits: ptr(&x)?,
            weights: ptr(&weights)?,
            indices: ptr(&indices)?,
            rows,
            experts,
            k: k as usize,
            renormalize,
        })
        .map_err(cuda_error)?;
        Ok((weights, indices))
    }
}

/// `torchgraft::topk_softmax_backward` at CUDA.
pub struct TopkSoftmaxBackwardCuda;

impl Kernel for TopkSoftmaxBackwardCuda {
    type Args = (Tensor, Tensor, Tensor, Tensor, bool);
    type Outputs = (Tensor,);
    fn run((g, logits, w, indices, renormalize): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "topk_softmax_backward";
        TOPK_SOFTMAX_BACKWARD_CUDA.call();
        let Checked { device, dtype } =
            check_backward(OP, DeviceType::CUDA, &g, &logits, &w, &indices)?;
        let kernel_dtype = cuda_dtype(OP, dtype)?;
        let _guard = DeviceGuard::new(device.index)?;
        let sizes = logits.sizes()?;
        let (rows, experts) = (sizes[0] as usize, sizes[1] as usize);
        let k = w.sizes()?[1] as usize;
        let (g, x, w, i) = (
            contiguous(&g)?,
            contiguous(&logits)?,
            contiguous(&w)?,
            contiguous(&indices)?,
        );
        let grad = NewTensor::empty(sizes, dtype, device)?.finish();
        graft_cuda::topk_softmax_backward(&TopkSoftmaxBackward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: kernel_dtype,
            grad_weights: ptr(&g)?,
            logits: ptr(&x)?,
            weights: ptr(&w)?,
            indices: ptr(&i)?,
            grad_logits: ptr(&grad)?,
            rows,
            experts,
            k,
            renormalize,
        })
        .map_err(cuda_error)?;
        Ok((grad,))
    }
}
