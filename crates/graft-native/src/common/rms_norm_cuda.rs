//! The RMSNorm CUDA backward launch and weight operand, shared by the aten graft
//! (`grafts::rms_norm`) and torchgraft's own `rms_norm` op (`ops::rms_norm`), so that neither
//! imports the other.

use graft_abi::cuda::current_stream;
use graft_abi::{DType, Device, NewTensor, Result, Tensor};
use graft_cuda::{RmsNormBackward, Weight, WeightMode};

use super::cuda::{cuda_error, kernel_dtype, ptr};
use super::tensor::{acc_dtype, contiguous, to_dtype};

/// The tensors of one RMSNorm backward launch (`dx` / `dw`: those asked for).
pub struct BackwardOperands<'a> {
    pub dy: &'a Tensor,
    pub x: &'a Tensor,
    pub rstd: &'a Tensor,
    pub weight: Weight,
    pub dx: Option<&'a Tensor>,
    pub dw: Option<&'a Tensor>,
}

/// Launches the backward kernels over `rows` x `cols` (both nonzero) on the current stream of
/// `device`, with the dw partials' scratch when dw is asked for.
pub fn launch_backward(
    device: Device,
    dtype: DType,
    t: BackwardOperands<'_>,
    rows: usize,
    cols: usize,
    mode: WeightMode,
) -> Result<()> {
    let want_dw = t.dw.is_some();
    let workspace_bytes = graft_cuda::rms_norm_backward_workspace_bytes_for(
        device.index,
        kernel_dtype(dtype),
        rows,
        cols,
        want_dw,
    )
    .map_err(cuda_error)?;
    // Scratch for the dw partials; without dw the kernels never touch it.
    let workspace = want_dw
        .then(|| NewTensor::empty(&[workspace_bytes.max(16) as i64], DType::U8, device))
        .transpose()?
        .map(NewTensor::finish);
    graft_cuda::rms_norm_backward(&RmsNormBackward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: kernel_dtype(dtype),
        dy: ptr(t.dy)?,
        x: ptr(t.x)?,
        rstd: ptr(t.rstd)?,
        weight: t.weight,
        dx: t.dx.map(ptr).transpose()?,
        dw: t.dw.map(ptr).transpose()?,
        workspace: workspace.as_ref().map(ptr).transpose()?.unwrap_or(0),
        workspace_bytes,
        rows,
        cols,
        mode,
    })
    .map_err(cuda_error)
}

/// A contiguous weight the kernels can read: in the input's dtype, or else in the accumulation
/// dtype (converted; rare: F.rms_norm only reaches the op with matching dtypes).
pub fn kernel_weight(weight: Option<&Tensor>, dtype: DType) -> Result<(Option<Tensor>, Weight)> {
    let Some(weight) = weight else {
        return Ok((None, Weight::None));
    };
    if weight.dtype()? == dtype {
        let w = contiguous(weight)?;
        let p = ptr(&w)?;
        Ok((Some(w), Weight::Same(p)))
    } else {
        let w = contiguous(&to_dtype(weight, acc_dtype(dtype))?)?;
        let p = ptr(&w)?;
        Ok((Some(w), Weight::Acc(p)))
    }
}
