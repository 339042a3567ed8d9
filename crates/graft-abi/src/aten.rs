//! ATen functions that [`crate::dispatch::call`] cannot reach because their schemas take
//! `Scalar`s (which `torch_call_dispatcher` does not convert), called through the AOTInductor C
//! shim that libtorch exports. Each one still goes through the dispatcher inside libtorch.

use crate::error::{check, Error, Result};
use crate::sys::api;
use crate::tensor::Tensor;

/// `out = beta * input + alpha * (mat1 @ mat2)` (`aten::addmm.out`; `out` may be `input`, which
/// accumulates in place). cuBLAS on CUDA, ATen's CPU BLAS on the CPU.
///
/// # Errors
/// ATen's, or when this libtorch does not export `aoti_torch_addmm_out`.
pub fn addmm_out(
    out: &Tensor,
    input: &Tensor,
    mat1: &Tensor,
    mat2: &Tensor,
    beta: f32,
    alpha: f32,
) -> Result<()> {
    let addmm = api()?.aoti_torch_addmm_out.ok_or_else(|| {
        Error::msg("this libtorch does not export aoti_torch_addmm_out, which torchgraft needs")
    })?;
    // SAFETY: every handle is valid for the call and borrowed (the shim takes no ownership).
    let code = unsafe {
        addmm(
            out.as_raw(),
            input.as_raw(),
            mat1.as_raw(),
            mat2.as_raw(),
            beta,
            alpha,
        )
    };
    check(code, "aoti_torch_addmm_out")
}
