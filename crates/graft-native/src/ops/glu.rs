//! SwiGLU and GeGLU: `torchgraft::swiglu` / `geglu` and their backward ops, on CPU (graft-kernels)
//! and CUDA (graft-cuda).
//!
//! `gate` and `up` must have the same sizes, dtype (a floating type) and device ([`check`]); any
//! layout is accepted (non-contiguous inputs are copied first). Outputs are contiguous.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::operands::{overlap, Describe, Overlap};
use graft_abi::{
    in_place_views, Checked, DType, Device, DeviceType, Element, Kernel, NewTensor, Operands,
    Result, Tensor,
};
use graft_cuda::{GluActivation, GluBackward, GluForward};
use graft_kernels::ops::glu::{self, Activation, GluMath};
use graft_kernels::Float;
use half::{bf16, f16};

use crate::common::cuda::{cuda_dtype, cuda_error, ptr};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, unsupported};
use crate::common::threads::TorchPool;

pub static SWIGLU_CPU: Counters = Counters::new();
pub static SWIGLU_CUDA: Counters = Counters::new();
pub static SWIGLU_BACKWARD_CPU: Counters = Counters::new();
pub static SWIGLU_BACKWARD_CUDA: Counters = Counters::new();
pub static GEGLU_CPU: Counters = Counters::new();
pub static GEGLU_CUDA: Counters = Counters::new();
pub static GEGLU_BACKWARD_CPU: Counters = Counters::new();
pub static GEGLU_BACKWARD_CUDA: Counters = Counters::new();
pub static SWIGLU_BACKWARD_INPLACE_CPU: Counters = Counters::new();
pub static SWIGLU_BACKWARD_INPLACE_CUDA: Counters = Counters::new();
pub static GEGLU_BACKWARD_INPLACE_CPU: Counters = Counters::new();
pub static GEGLU_BACKWARD_INPLACE_CUDA: Counters = Counters::new();

fn gelu(tanh: bool) -> Activation {
    if tanh {
        Activation::GeluTanh
    } else {
        Activation::GeluErf
    }
}

/// The operands of the forward (`gate`, `up`) and of the backward (and `grad`): one floating
/// dtype, one shape (no broadcasting), one device.
fn check(
    op: &str,
    kernel: DeviceType,
    gate: &Tensor,
    up: &Tensor,
    grad: Option<&Tensor>,
) -> Result<Checked> {
    Operands::new(op, kernel)
        .tensor("gate", gate)
        .float()
        .tensor("up", up)
        .like("gate")
        .optional("grad", grad)
        .like("gate")
        .check()
}

/// The in-place backward's operands: the backward's, with `gate` and `up` written (each gets
/// its own gradient: they share no memory, and `grad` is one of them or apart from both).
fn check_in_place(
    op: &str,
    kernel: DeviceType,
    grad: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<Checked> {
    Operands::new(op, kernel)
        .written("gate", gate)
        .float()
        .written("up", up)
        .like("gate")
        .tensor("grad", grad)
        .like("gate")
        .check()
}

/// Whether `a` and `b` share no memory.
fn apart(a: &Tensor, b: &Tensor) -> Result<bool> {
    Ok(overlap(&a.describe()?, &b.describe()?) == Overlap::No)
}

// ------------------------------------------------------------------------------------ CPU

fn forward_cpu_typed<T: Float + Element>(
    act: Activation,
    gate: &Tensor,
    up: &Tensor,
) -> Result<Tensor>
where
    T::Acc: GluMath,
{
    let (g, u) = (contiguous(gate)?, contiguous(up)?);
    let mut y = NewTensor::empty(gate.sizes()?, T::DTYPE, Device::CPU)?;
    glu::forward::<T>(
        act,
        g.as_slice()?,
        u.as_slice()?,
        y.as_mut_slice()?,
        &TorchPool,
    );
    Ok(y.finish())
}

fn backward_cpu_typed<T: Float + Element>(
    act: Activation,
    grad: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)>
where
    T::Acc: GluMath,
{
    let (d, g, u) = (contiguous(grad)?, contiguous(gate)?, contiguous(up)?);
    let sizes = gate.sizes()?;
    let mut dg = NewTensor::empty(sizes, T::DTYPE, Device::CPU)?;
    let mut du = NewTensor::empty(sizes, T::DTYPE, Device::CPU)?;
    glu::backward::<T>(
        act,
        g.as_slice()?,
        u.as_slice()?,
        d.as_slice()?,
        dg.as_mut_slice()?,
        du.as_mut_slice()?,
        &TorchPool,
    );
    Ok((dg.finish(), du.finish()))
}

fn forward_cpu(op: &str, act: Activation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    match check(op, DeviceType::CPU, gate, up, None)?.dtype {
        DType::F32 => forward_cpu_typed::<f32>(act, gate, up),
        DType::F64 => forward_cpu_typed::<f64>(act, gate, up),
        DType::BF16 => forward_cpu_typed::<bf16>(act, gate, up),
        DType::F16 => forward_cpu_typed::<f16>(act, gate, up),
        other => Err(unsupported(op, other)),
    }
}

fn backward_cpu(
    op: &str,
    act: Activation,
    grad: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)> {
    match check(op, DeviceType::CPU, gate, up, Some(grad))?.dtype {
        DType::F32 => backward_cpu_typed::<f32>(act, grad, gate, up),
        DType::F64 => backward_cpu_typed::<f64>(act, grad, gate, up),
        DType::BF16 => backward_cpu_typed::<bf16>(act, grad, gate, up),
        DType::F16 => backward_cpu_typed::<f16>(act, grad, gate, up),
        other => Err(unsupported(op, other)),
    }
}

// ----------------------------------------------------------------------------------- CUDA

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

/// `gate <- dgate`, `up <- dup`, computing into new tensors and copying (layouts the in-place
/// kernels do not take).
fn backward_by_copy(
    backward: impl FnOnce() -> Result<(Tensor, Tensor)>,
    gate: &Tensor,
    up: &Tensor,
) -> Result<()> {
    let (dg, du) = backward()?;
    gate.copy_from(&dg)?;
    up.copy_from(&du)
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

// -------------------------------------------------------------------------------- kernels

/// `torchgraft::swiglu` at CPU (`inplace_backward` only matters to the autograd formula).
pub struct SwigluCpu;
impl Kernel for SwigluCpu {
    type Args = (Tensor, Tensor, bool);
    type Outputs = (Tensor,);
    fn run((gate, up, _inplace_backward): Self::Args) -> Result<(Tensor,)> {
        SWIGLU_CPU.call();
        Ok((forward_cpu("swiglu", Activation::Silu, &gate, &up)?,))
    }
}

/// `torchgraft::swiglu_backward` at CPU.
pub struct SwigluBackwardCpu;
impl Kernel for SwigluBackwardCpu {
    type Args = (Tensor, Tensor, Tensor);
    type Outputs = (Tensor, Tensor);
    fn run((grad, gate, up): Self::Args) -> Result<(Tensor, Tensor)> {
        SWIGLU_BACKWARD_CPU.call();
        backward_cpu("swiglu_backward", Activation::Silu, &grad, &gate, &up)
    }
}

/// `torchgraft::geglu` at CPU.
pub struct GegluCpu;
impl Kernel for GegluCpu {
    type Args = (Tensor, Tensor, bool, bool);
    type Outputs = (Tensor,);
    fn run((gate, up, tanh, _inplace_backward): Self::Args) -> Result<(Tensor,)> {
        GEGLU_CPU.call();
        Ok((forward_cpu("geglu", gelu(tanh), &gate, &up)?,))
    }
}

/// `torchgraft::geglu_backward` at CPU.
pub struct GegluBackwardCpu;
impl Kernel for GegluBackwardCpu {
    type Args = (Tensor, Tensor, Tensor, bool);
    type Outputs = (Tensor, Tensor);
    fn run((grad, gate, up, tanh): Self::Args) -> Result<(Tensor, Tensor)> {
        GEGLU_BACKWARD_CPU.call();
        backward_cpu("geglu_backward", gelu(tanh), &grad, &gate, &up)
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

fn backward_in_place_cpu_typed<T: Float + Element>(
    act: Activation,
    grad: &Tensor,
    gate: &mut Tensor,
    up: &mut Tensor,
) -> Result<()>
where
    T::Acc: GluMath,
{
    let dy = grad.as_slice::<T>()?;
    let mut views = in_place_views::<T>(vec![gate, up])?;
    let [g, u] = views.as_mut_slice() else {
        unreachable!("two tensors give two views")
    };
    glu::backward_in_place::<T>(act, g, u, dy, &TorchPool);
    Ok(())
}

/// `gate <- dgate`, `up <- dup` on CPU: by the in-place kernel when `gate`, `up` and `grad` are
/// contiguous and `grad` shares memory with neither (no allocation, one pass), else by
/// computing into new tensors and copying.
fn backward_in_place_cpu(
    op: &str,
    act: Activation,
    grad: &Tensor,
    mut gate: Tensor,
    mut up: Tensor,
) -> Result<()> {
    let dtype = check_in_place(op, DeviceType::CPU, grad, &gate, &up)?.dtype;
    let contiguous = gate.is_contiguous()? && up.is_contiguous()? && grad.is_contiguous()?;
    if !(contiguous && apart(grad, &gate)? && apart(grad, &up)?) {
        let backward = || backward_cpu(op, act, grad, &gate, &up);
        return backward_by_copy(backward, &gate, &up);
    }
    match dtype {
        DType::F32 => backward_in_place_cpu_typed::<f32>(act, grad, &mut gate, &mut up),
        DType::F64 => backward_in_place_cpu_typed::<f64>(act, grad, &mut gate, &mut up),
        DType::BF16 => backward_in_place_cpu_typed::<bf16>(act, grad, &mut gate, &mut up),
        DType::F16 => backward_in_place_cpu_typed::<f16>(act, grad, &mut gate, &mut up),
        other => Err(unsupported(op, other)),
    }
}

/// `torchgraft::swiglu_backward_` at CPU.
pub struct SwigluBackwardInPlaceCpu;
impl Kernel for SwigluBackwardInPlaceCpu {
    type Args = (Tensor, Tensor, Tensor);
    type Outputs = ();
    fn run((grad, gate, up): Self::Args) -> Result<()> {
        SWIGLU_BACKWARD_INPLACE_CPU.call();
        backward_in_place_cpu("swiglu_backward_", Activation::Silu, &grad, gate, up)
    }
}

/// `torchgraft::geglu_backward_` at CPU.
pub struct GegluBackwardInPlaceCpu;
impl Kernel for GegluBackwardInPlaceCpu {
    type Args = (Tensor, Tensor, Tensor, bool);
    type Outputs = ();
    fn run((grad, gate, up, tanh): Self::Args) -> Result<()> {
        GEGLU_BACKWARD_INPLACE_CPU.call();
        backward_in_place_cpu("geglu_backward_", gelu(tanh), &grad, gate, up)
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
