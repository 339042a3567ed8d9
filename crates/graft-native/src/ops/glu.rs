//! SwiGLU and GeGLU: `torchgraft::swiglu` / `geglu` and their backward ops, on CPU (graft-kernels)
//! and CUDA (graft-cuda).
//!
//! `gate` and `up` must have the same sizes, dtype (a floating type) and device; any layout is
//! accepted (non-contiguous inputs are copied first). Outputs are contiguous.

use graft_abi::cuda::{current_stream, DeviceGuard};
use graft_abi::{
    ensure, in_place_views, DType, Device, Element, Kernel, NewTensor, Result, Tensor,
};
use graft_cuda::{GluActivation, GluBackward, GluForward};
use graft_kernels::ops::glu::{self, Activation, GluMath};
use graft_kernels::Float;
use half::{bf16, f16};

use crate::rms_norm::contiguous;
use crate::stats::Counters;
use crate::threads::TorchPool;

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

/// Checks the inputs like the eager `act(gate) * up` would (same device, a floating dtype),
/// and that they have one shape (no broadcasting).
fn check(op: &str, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let (_, first) = tensors[0];
    let (sizes, dtype, device) = (first.sizes()?, first.dtype()?, first.device()?);
    ensure!(
        dtype.is_float(),
        "\"{op}\" not implemented for '{}'",
        dtype.name()
    );
    for (name, t) in &tensors[1..] {
        let d = t.device()?;
        ensure!(
            d == device,
            "Expected all tensors to be on the same device, but found at least two devices, \
             {device} and {d}!"
        );
        ensure!(
            t.dtype()? == dtype,
            "{op}: expected {name} to have dtype {}, got {}",
            dtype.name(),
            t.dtype()?.name()
        );
        ensure!(
            t.sizes()? == sizes,
            "{op}: expected {name} of size {sizes:?}, got {:?}",
            t.sizes()?
        );
    }
    Ok(())
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
    check(op, &[("gate", gate), ("up", up)])?;
    match gate.dtype()? {
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
    check(op, &[("gate", gate), ("up", up), ("grad", grad)])?;
    match gate.dtype()? {
        DType::F32 => backward_cpu_typed::<f32>(act, grad, gate, up),
        DType::F64 => backward_cpu_typed::<f64>(act, grad, gate, up),
        DType::BF16 => backward_cpu_typed::<bf16>(act, grad, gate, up),
        DType::F16 => backward_cpu_typed::<f16>(act, grad, gate, up),
        other => Err(unsupported(op, other)),
    }
}

fn unsupported(op: &str, dtype: DType) -> graft_abi::Error {
    graft_abi::Error::msg(format!("\"{op}\" not implemented for '{}'", dtype.name()))
}

// ----------------------------------------------------------------------------------- CUDA

fn cuda_dtype(op: &str, dtype: DType) -> Result<graft_cuda::DType> {
    Ok(match dtype {
        DType::F32 => graft_cuda::DType::F32,
        DType::F64 => graft_cuda::DType::F64,
        DType::BF16 => graft_cuda::DType::BF16,
        DType::F16 => graft_cuda::DType::F16,
        other => return Err(unsupported(op, other)),
    })
}

fn ptr(t: &Tensor) -> Result<u64> {
    Ok(t.data_ptr()? as u64)
}

fn cuda_error(e: graft_cuda::CudaError) -> graft_abi::Error {
    graft_abi::Error::msg(e.to_string())
}

fn forward_cuda(op: &str, act: GluActivation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check(op, &[("gate", gate), ("up", up)])?;
    let device = gate.device()?;
    let _guard = DeviceGuard::new(device.index)?;
    let dtype = gate.dtype()?;
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
    check(op, &[("gate", gate), ("up", up), ("grad", grad)])?;
    let device = gate.device()?;
    let _guard = DeviceGuard::new(device.index)?;
    let dtype = gate.dtype()?;
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

/// The bytes a contiguous tensor's elements occupy, `[start, end)`.
fn byte_range(t: &Tensor) -> Result<(u64, u64)> {
    let start = t.data_ptr()? as u64;
    let bytes = (t.numel()? * t.dtype()?.size().unwrap_or(1)) as u64;
    Ok((start, start + bytes))
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// The in-place backward's checks: the forward's, and `gate` and `up` apart in memory (for
/// strided views, which may interleave without sharing an element, only a shared first element
/// is caught).
fn check_in_place(op: &str, grad: &Tensor, gate: &Tensor, up: &Tensor) -> Result<()> {
    check(op, &[("gate", gate), ("up", up), ("grad", grad)])?;
    if gate.numel()? > 0 {
        let dense = gate.is_contiguous()? && up.is_contiguous()?;
        let shared = if dense {
            overlap(byte_range(gate)?, byte_range(up)?)
        } else {
            gate.data_ptr()? == up.data_ptr()?
        };
        ensure!(
            !shared,
            "{op}: gate and up must not overlap (each receives its own gradient)"
        );
    }
    Ok(())
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
/// three are contiguous and `grad` is either `gate`/`up` itself or apart from both.
fn backward_in_place_cuda(
    op: &str,
    act: GluActivation,
    grad: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<()> {
    check_in_place(op, grad, gate, up)?;
    let n = gate.numel()?;
    if n == 0 {
        return Ok(());
    }
    let contiguous_all = gate.is_contiguous()? && up.is_contiguous()? && grad.is_contiguous()?;
    let g = byte_range(grad)?;
    let grad_apart = [byte_range(gate)?, byte_range(up)?]
        .iter()
        .all(|&r| r == g || !overlap(r, g));
    if !(contiguous_all && grad_apart) {
        return backward_by_copy(|| backward_cuda(op, act, grad, gate, up), gate, up);
    }
    let device = gate.device()?;
    let _guard = DeviceGuard::new(device.index)?;
    graft_cuda::glu_backward(&GluBackward {
        device: device.index,
        stream: current_stream(device.index)? as usize,
        dtype: cuda_dtype(op, gate.dtype()?)?,
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
    check_in_place(op, grad, &gate, &up)?;
    let contiguous = gate.is_contiguous()? && up.is_contiguous()? && grad.is_contiguous()?;
    let apart = gate.numel()? == 0 || {
        let dy = byte_range(grad)?;
        !overlap(dy, byte_range(&gate)?) && !overlap(dy, byte_range(&up)?)
    };
    if !(contiguous && apart) {
        let backward = || backward_cpu(op, act, grad, &gate, &up);
        return backward_by_copy(backward, &gate, &up);
    }
    match gate.dtype()? {
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
