//! Whether this process can run the CUDA kernels, and what every launch through graft-cuda needs:
//! dtypes, device pointers, errors.

use graft_abi::{DType, Result, Tensor};

use super::tensor::unsupported;

/// Whether the CUDA grafts and op kernels can be registered in this process: Ok(number of GPUs),
/// or why not.
pub fn cuda_status() -> std::result::Result<usize, String> {
    if !graft_cuda::kernels_built() {
        return Err("this build has no CUDA kernels (nvcc was not found when it was built)".into());
    }
    if !graft_abi::cuda::torch_has_cuda() {
        return Err("this torch has no CUDA support loaded".into());
    }
    match graft_cuda::device_count() {
        Ok(0) => Err("the CUDA driver sees no GPU".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no CUDA driver: {e}")),
    }
}

/// graft-cuda's dtype of a float dtype the caller has already checked.
pub fn kernel_dtype(dtype: DType) -> graft_cuda::DType {
    match dtype {
        DType::F32 => graft_cuda::DType::F32,
        DType::F64 => graft_cuda::DType::F64,
        DType::BF16 => graft_cuda::DType::BF16,
        _ => graft_cuda::DType::F16,
    }
}

/// graft-cuda's dtype of `dtype`, or ATen's message for `op` when no kernel takes it.
pub fn cuda_dtype(op: &str, dtype: DType) -> Result<graft_cuda::DType> {
    Ok(match dtype {
        DType::F32 => graft_cuda::DType::F32,
        DType::F64 => graft_cuda::DType::F64,
        DType::BF16 => graft_cuda::DType::BF16,
        DType::F16 => graft_cuda::DType::F16,
        other => return Err(unsupported(op, other)),
    })
}

/// `t`'s device address, as graft-cuda takes it.
pub fn ptr(t: &Tensor) -> Result<u64> {
    Ok(t.data_ptr()? as u64)
}

/// A graft-cuda error as the error the kernel's caller raises.
pub fn cuda_error(e: graft_cuda::CudaError) -> graft_abi::Error {
    graft_abi::Error::msg(e.to_string())
}
