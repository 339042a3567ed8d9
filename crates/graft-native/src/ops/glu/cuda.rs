//! SwiGLU and GeGLU on CUDA: graft-cuda's kernels on PyTorch's current stream of the tensors'
//! device.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{Checked, DeviceType, Kernel, NewTensor, Result, Tensor};
use graft_cuda::{GluActivation, GluBackward, GluForward, GluPackedBackward, GluPackedForward};

use super::{
    apart, backward_by_copy, check, check_in_place, check_packed, check_packed_backward,
    packed_shape,
};
use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::contiguous;

pub static SWIGLU_CUDA: Counters = Counters::new();
pub static SWIGLU_BACKWARD_CUDA: Counters = Counters::new();
pub static GEGLU_CUDA: Counters = Counters::new();
pub static GEGLU_BACKWARD_CUDA: Counters = Counters::new();
pub static SWIGLU_BACKWARD_INPLACE_CUDA: Counters = Counters::new();
pub static GEGLU_BACKWARD_INPLACE_CUDA: Counters = Counters::new();
pub static SWIGLU_PACKED_CUDA: Counters = Counters::new();
pub static SWIGLU_PACKED_BACKWARD_CUDA: Counters = Counters::new();
pub static SWIGLU_PACKED_BACKWARD_INPLACE_CUDA: Counters = Counters::new();

fn forward_cuda(op: &str, act: GluActivation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let Checked { device, dtype } = check(op, DeviceType::CUDA, gate, up, None)?;
    let _guard = DeviceGuard::new(device.index)?;
    let (g, u) = (contiguous(gate)?, contiguous(up)?);
    let y = NewTensor::empty(gate.sizes()?, dtype, device)?.finish();
    graft_cuda::glu_forward(&GluForward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: cuda_dtype(op, dtype)?,
        activation: act,
        gate: ptr(&g)?,
        up: ptr(&u)?,
        y: ptr(&y)?,
        n: gate.numel()?,
    })
    .map_err(cuda_error)?;
    Ok(y)
}

fn backward_cuda(
    op: &str,
    act: GluActivation,
    grad: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let Checked { device, dtype } = check(op, DeviceType::CUDA, gate, up, Some(grad))?;
    let _guard = DeviceGuard::new(device.index)?;
    let (d, g, u) = (contiguous(grad)?, contiguous(gate)?, contiguous(up)?);
    let sizes = gate.sizes()?;
    let dg = NewTensor::empty(sizes, dtype, device)?.finish();
    let du = NewTensor::empty(sizes, dtype, device)?.finish();
    graft_cuda::glu_backward(&GluBackward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: cuda_dtype(op, dtype)?,
        activation: act,
        gate: ptr(&g)?,
        up: ptr(&u)?,
        dy: ptr(&d)?,
        dgate: ptr(&dg)?,
        dup: ptr(&du)?,
        n: gate.numel()?,
    })
    .map_err(cuda_error)?;
    Ok((dg, du))
}

/// The in-place backward on CUDA: the kernel reads each element of `gate`, `up` and `grad`
/// before writing the same element of `gate` and `up`, so it runs over them directly when all
/// three are contiguous (`grad` is then `gate`, `up`, or apart from both: checked).
fn backward_in_place_cuda(
    op: &str,
    act: GluActivation,
    grad: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<()> {
    let Checked { device, dtype } = check_in_place(op, DeviceType::CUDA, grad, gate, up)?;
    let n = gate.numel()?;
    if n == 0 {
        return Ok(());
    }
    if !(gate.is_contiguous()? && up.is_contiguous()? && grad.is_contiguous()?) {
        return backward_by_copy(|| backward_cuda(op, act, grad, gate, up), gate, up);
    }
    let _guard = DeviceGuard::new(device.index)?;
    graft_cuda::glu_backward(&GluBackward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: cuda_dtype(op, dtype)?,
        activation: act,
        gate: ptr(gate)?,
        up: ptr(up)?,
        dy: ptr(grad)?,
        dgate: ptr(gate)?,
        dup: ptr(up)?,
        n,
    })
    .map_err(cuda_error)
}

fn cuda_gelu(tanh: bool) -> GluActivation {
    if tanh {
        GluActivation::GeluTanh
    } else {
        GluActivation::GeluErf
    }
}

/// `torchgraft::swiglu` at CUDA.
pub struct SwigluCuda;

impl Kernel for SwigluCuda {
    type Args = (Tensor, Tensor, bool);
    type Outputs = (Tensor,);
    fn run((gate, up, _inplace_backward): Self::Args) -> Result<(Tensor,)> {
        SWIGLU_CUDA.call();
        Ok((forward_cuda("swiglu", GluActivation::Silu, &gate, &up)?,))
    }
}

/// `torchgraft::swiglu_backward` at CUDA.
pub struct SwigluBackwardCuda;

impl Kernel for SwigluBackwardCuda {
    type Args = (Tensor, Tensor, Tensor);
    type Outputs = (Tensor, Tensor);
    fn run((grad, gate, up): Self::Args) -> Result<(Tensor, Tensor)> {
        SWIGLU_BACKWARD_CUDA.call();
        backward_cuda("swiglu_backward", GluActivation::Silu, &grad, &gate, &up)
    }
}

/// `torchgraft::geglu` at CUDA.
pub struct GegluCuda;

impl Kernel for GegluCuda {
    type Args = (Tensor, Tensor, bool, bool);
    type Outputs = (Tensor,);
    fn run((gate, up, tanh, _inplace_backward): Self::Args) -> Result<(Tensor,)> {
        GEGLU_CUDA.call();
        Ok((forward_cuda("geglu", cuda_gelu(tanh), &gate, &up)?,))
    }
}

/// `torchgraft::geglu_backward` at CUDA.
pub struct GegluBackwardCuda;

impl Kernel for GegluBackwardCuda {
    type Args = (Tensor, Tensor, Tensor, bool);
    type Outputs = (Tensor, Tensor);
    fn run((grad, gate, up, tanh): Self::Args) -> Result<(Tensor, Tensor)> {
        GEGLU_BACKWARD_CUDA.call();
        backward_cuda("geglu_backward", cuda_gelu(tanh), &grad, &gate, &up)
    }
}

/// `torchgraft::swiglu_backward_` at CUDA.
pub struct SwigluBackwardInPlaceCuda;

impl Kernel for SwigluBackwardInPlaceCuda {
    type Args = (Tensor, Tensor, Tensor);
    type Outputs = ();
    fn run((grad, gate, up): Self::Args) -> Result<()> {
        SWIGLU_BACKWARD_INPLACE_CUDA.call();
        backward_in_place_cuda("swiglu_backward_", GluActivation::Silu, &grad, &gate, &up)
    }
}

/// `torchgraft::geglu_backward_` at CUDA.
pub struct GegluBackwardInPlaceCuda;

impl Kernel for GegluBackwardInPlaceCuda {
    type Args = (Tensor, Tensor, Tensor, bool);
    type Outputs = ();
    fn run((grad, gate, up, tanh): Self::Args) -> Result<()> {
        GEGLU_BACKWARD_INPLACE_CUDA.call();
        backward_in_place_cuda("geglu_backward_", cuda_gelu(tanh), &grad, &gate, &up)
    }
}

/// SwiGLU over packed rows (graft-cuda's packed kernels are SiLU's).
fn packed_forward_cuda(op: &str, gate_up: &Tensor) -> Result<Tensor> {
    let (Checked { device, dtype }, half) = check_packed(op, DeviceType::CUDA, gate_up)?;
    let _guard = DeviceGuard::new(device.index)?;
    let gu = contiguous(gate_up)?;
    let y = NewTensor::empty(&half, dtype, device)?.finish();
    let (rows, cols) = packed_shape(&half);
    graft_cuda::glu_packed_forward(&GluPackedForward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: cuda_dtype(op, dtype)?,
        gate_up: ptr(&gu)?,
        y: ptr(&y)?,
        rows,
        cols,
    })
    .map_err(cuda_error)?;
    Ok(y)
}

/// The packed gradient in a new tensor (operands checked, `written` for the in-place op's).
fn packed_backward_cuda(
    op: &str,
    grad: &Tensor,
    gate_up: &Tensor,
    written: bool,
) -> Result<Tensor> {
    let (Checked { device, dtype }, half) =
        check_packed_backward(op, DeviceType::CUDA, grad, gate_up, written)?;
    let _guard = DeviceGuard::new(device.index)?;
    let (d, gu) = (contiguous(grad)?, contiguous(gate_up)?);
    let out = NewTensor::empty(gate_up.sizes()?, dtype, device)?.finish();
    let (rows, cols) = packed_shape(&half);
    graft_cuda::glu_packed_backward(&GluPackedBackward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: cuda_dtype(op, dtype)?,
        gate_up: ptr(&gu)?,
        dy: ptr(&d)?,
        d_gate_up: ptr(&out)?,
        rows,
        cols,
    })
    .map_err(cuda_error)?;
    Ok(out)
}

/// The in-place packed backward on CUDA: the kernel reads each element's gate, up and grad
/// before writing its gradients over the same gate and up, so it runs over `gate_up` directly
/// when it and `grad` are contiguous and apart (else: compute into a new tensor and copy).
fn packed_backward_in_place_cuda(op: &str, grad: &Tensor, gate_up: &Tensor) -> Result<()> {
    let (Checked { device, dtype }, half) =
        check_packed_backward(op, DeviceType::CUDA, grad, gate_up, true)?;
    let (rows, cols) = packed_shape(&half);
    if rows * cols == 0 {
        return Ok(());
    }
    if !(gate_up.is_contiguous()? && grad.is_contiguous()? && apart(grad, gate_up)?) {
        return gate_up.copy_from(&packed_backward_cuda(op, grad, gate_up, true)?);
    }
    let _guard = DeviceGuard::new(device.index)?;
    graft_cuda::glu_packed_backward(&GluPackedBackward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: cuda_dtype(op, dtype)?,
        gate_up: ptr(gate_up)?,
        dy: ptr(grad)?,
        d_gate_up: ptr(gate_up)?,
        rows,
        cols,
    })
    .map_err(cuda_error)
}

/// `torchgraft::swiglu_packed` at CUDA.
pub struct SwigluPackedCuda;

impl Kernel for SwigluPackedCuda {
    type Args = (Tensor,);
    type Outputs = (Tensor,);
    fn run((gate_up,): Self::Args) -> Result<(Tensor,)> {
        SWIGLU_PACKED_CUDA.call();
        Ok((packed_forward_cuda("swiglu_packed", &gate_up)?,))
    }
}

/// `torchgraft::swiglu_packed_backward` at CUDA.
pub struct SwigluPackedBackwardCuda;

impl Kernel for SwigluPackedBackwardCuda {
    type Args = (Tensor, Tensor);
    type Outputs = (Tensor,);
    fn run((grad, gate_up): Self::Args) -> Result<(Tensor,)> {
        SWIGLU_PACKED_BACKWARD_CUDA.call();
        Ok((packed_backward_cuda(
            "swiglu_packed_backward",
            &grad,
            &gate_up,
            false,
        )?,))
    }
}

/// `torchgraft::swiglu_packed_backward_` at CUDA.
pub struct SwigluPackedBackwardInPlaceCuda;

impl Kernel for SwigluPackedBackwardInPlaceCuda {
    type Args = (Tensor, Tensor);
    type Outputs = ();
    fn run((grad, gate_up): Self::Args) -> Result<()> {
        SWIGLU_PACKED_BACKWARD_INPLACE_CUDA.call();
        packed_backward_in_place_cuda("swiglu_packed_backward_", &grad, &gate_up)
    }
}
