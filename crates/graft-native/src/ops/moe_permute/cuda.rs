//! MoE token permutation on CUDA: graft-cuda's kernels on PyTorch's current stream of the
//! tensors' device. Index values are not read on the host (see the module's docs).

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{ensure, DType, Device, DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{MoeValid, MoeWeights};

use super::{check_permute, check_sort, check_unpermute, kernel_weights};
use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, to_dtype};

pub static MOE_SORT_CUDA: Counters = Counters::new();
pub static MOE_PERMUTE_CUDA: Counters = Counters::new();
pub static MOE_UNPERMUTE_CUDA: Counters = Counters::new();
pub static MOE_UNPERMUTE_BACKWARD_CUDA: Counters = Counters::new();

fn valid_of(valid: &Tensor) -> Result<(Tensor, MoeValid)> {
    let v = contiguous(valid)?;
    let int64 = v.dtype()? == DType::I64;
    let handle = MoeValid {
        ptr: ptr(&v)?,
        int64,
    };
    Ok((v, handle))
}

/// The weights as the kernels read them ([`kernel_weights`]), with their kind.
fn weights_of(y: DType, weights: Option<&Tensor>) -> Result<(Option<Tensor>, MoeWeights)> {
    let w = kernel_weights(y, weights)?;
    let kind = match &w {
        None => MoeWeights::None,
        Some(w) if w.dtype()? == y => MoeWeights::Same,
        Some(_) => MoeWeights::Acc,
    };
    Ok((w, kind))
}

fn ptr_or_null(t: Option<&Tensor>) -> Result<u64> {
    t.map_or(Ok(0), ptr)
}

/// `torchgraft::moe_sort` at CUDA: two launches and an int32 workspace from torch's allocator;
/// up to `MOE_SORT_MAX_EXPERTS` experts.
pub struct MoeSortCuda;

impl Kernel for MoeSortCuda {
    type Args = (Tensor, i64);
    type Outputs = (Tensor, Tensor, Tensor);
    fn run((expert_ids, num_experts): Self::Args) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "moe_sort";
        MOE_SORT_CUDA.call();
        let (checked, pairs) = check_sort(OP, DeviceType::CUDA, &expert_ids, num_experts)?;
        let most = graft_cuda::MOE_SORT_MAX_EXPERTS;
        ensure!(
            num_experts as usize <= most,
            "{OP}: the CUDA kernel takes at most {most} experts, got {num_experts}"
        );
        let device: Device = checked.device;
        let _guard = DeviceGuard::new(device.index)?;
        let ids = contiguous(&expert_ids)?;
        let experts = num_experts as usize;
        let n = pairs as i64;
        let perm = NewTensor::empty(&[n], DType::I64, device)?.finish();
        let inv_perm = NewTensor::empty(&[n], DType::I64, device)?.finish();
        let offsets = NewTensor::empty(&[num_experts], DType::I32, device)?.finish();
        let ws = graft_cuda::moe_sort_workspace(pairs, experts) as i64;
        let counts = NewTensor::empty(&[ws], DType::I32, device)?.finish();
        graft_cuda::moe_sort(&graft_cuda::MoeSort {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            ids: ptr(&ids)?,
            perm: ptr(&perm)?,
            inv_perm: ptr(&inv_perm)?,
            offsets: ptr(&offsets)?,
            counts: ptr(&counts)?,
            pairs,
            experts,
        })
        .map_err(cuda_error)?;
        Ok((perm, inv_perm, offsets))
    }
}

/// `torchgraft::moe_permute` at CUDA.
pub struct MoePermuteCuda;

impl Kernel for MoePermuteCuda {
    type Args = (Tensor, Tensor, Tensor, i64);
    type Outputs = (Tensor,);
    fn run((hidden, perm, valid, top_k): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "moe_permute";
        MOE_PERMUTE_CUDA.call();
        let (checked, tokens, width) =
            check_permute(OP, DeviceType::CUDA, &hidden, &perm, &valid, top_k)?;
        let device: Device = checked.device;
        let _guard = DeviceGuard::new(device.index)?;
        let (x, perm) = (contiguous(&hidden)?, contiguous(&perm)?);
        let (_valid, valid) = valid_of(&valid)?;
        let pairs = tokens * top_k;
        let out = NewTensor::empty(&[pairs, width], checked.dtype, device)?.finish();
        graft_cuda::moe_permute(&graft_cuda::MoePermute {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: cuda_dtype(OP, checked.dtype)?,
            hidden: ptr(&x)?,
            perm: ptr(&perm)?,
            valid,
            out: ptr(&out)?,
            pairs: pairs as usize,
            width: width as usize,
            top_k: top_k as usize,
        })
        .map_err(cuda_error)?;
        Ok((out,))
    }
}

/// `torchgraft::moe_unpermute` at CUDA.
pub struct MoeUnpermuteCuda;

impl Kernel for MoeUnpermuteCuda {
    type Args = (Tensor, Tensor, Tensor, Option<Tensor>, i64);
    type Outputs = (Tensor,);
    fn run((y, inv_perm, valid, weights, top_k): Self::Args) -> Result<(Tensor,)> {
        const OP: &str = "moe_unpermute";
        MOE_UNPERMUTE_CUDA.call();
        let weights = Tensor::defined(weights)?;
        let (checked, tokens, width) = check_unpermute(
            OP,
            DeviceType::CUDA,
            None,
            &y,
            None,
            &inv_perm,
            &valid,
            weights.as_ref(),
            top_k,
        )?;
        let device = checked.device;
        let _guard = DeviceGuard::new(device.index)?;
        let (y, inv_perm) = (contiguous(&y)?, contiguous(&inv_perm)?);
        let (_valid, valid) = valid_of(&valid)?;
        let (w, weights_kind) = weights_of(checked.dtype, weights.as_ref())?;
        let out = NewTensor::empty(&[tokens, width], checked.dtype, device)?.finish();
        graft_cuda::moe_unpermute(&graft_cuda::MoeUnpermute {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: cuda_dtype(OP, checked.dtype)?,
            y: ptr(&y)?,
            inv_perm: ptr(&inv_perm)?,
            valid,
            weights_kind,
            weights: ptr_or_null(w.as_ref())?,
            out: ptr(&out)?,
            pairs: (tokens * top_k) as usize,
            width: width as usize,
            top_k: top_k as usize,
        })
        .map_err(cuda_error)?;
        Ok((out,))
    }
}

/// `torchgraft::moe_unpermute_backward` at CUDA: `inv_perm` is checked with the other operands
/// but not read (the kernel walks the slots through `perm`).
pub struct MoeUnpermuteBackwardCuda;

impl Kernel for MoeUnpermuteBackwardCuda {
    type Args = (Tensor, Tensor, Tensor, Tensor, Tensor, Option<Tensor>, i64);
    type Outputs = (Tensor, Tensor);
    fn run(
        (grad, y, perm, inv_perm, valid, weights, top_k): Self::Args,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "moe_unpermute_backward";
        MOE_UNPERMUTE_BACKWARD_CUDA.call();
        let weights = Tensor::defined(weights)?;
        let (checked, tokens, width) = check_unpermute(
            OP,
            DeviceType::CUDA,
            Some(&grad),
            &y,
            Some(&perm),
            &inv_perm,
            &valid,
            weights.as_ref(),
            top_k,
        )?;
        let device = checked.device;
        let _guard = DeviceGuard::new(device.index)?;
        let (g, y, perm) = (contiguous(&grad)?, contiguous(&y)?, contiguous(&perm)?);
        let (_valid, valid) = valid_of(&valid)?;
        let (w, weights_kind) = weights_of(checked.dtype, weights.as_ref())?;
        let pairs = tokens * top_k;
        let dy = NewTensor::empty(&[pairs, width], checked.dtype, device)?.finish();
        let dw = match (&w, weights_kind.dtype(cuda_dtype(OP, checked.dtype)?)) {
            (Some(w), Some(_)) => NewTensor::empty(&[tokens, top_k], w.dtype()?, device)?,
            _ => NewTensor::empty(&[0], checked.dtype, device)?,
        }
        .finish();
        graft_cuda::moe_unpermute_backward(&graft_cuda::MoeUnpermuteBackward {
            device: device.index,
            stream: current_stream(device.index)? as usize,
            dtype: cuda_dtype(OP, checked.dtype)?,
            grad: ptr(&g)?,
            y: ptr(&y)?,
            perm: ptr(&perm)?,
            valid,
            weights_kind,
            weights: ptr_or_null(w.as_ref())?,
            dy: ptr(&dy)?,
            dweights: if w.is_some() { ptr(&dw)? } else { 0 },
            pairs: pairs as usize,
            width: width as usize,
            top_k: top_k as usize,
        })
        .map_err(cuda_error)?;
        // The weights' gradient in the weights' dtype (computed in the kernels' weight type).
        let dw = match &weights {
            Some(orig) => to_dtype(&dw, orig.dtype()?)?,
            None => dw,
        };
        Ok((dy, dw))
    }
}
