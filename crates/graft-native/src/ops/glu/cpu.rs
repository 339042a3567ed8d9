//! SwiGLU and GeGLU on CPU: graft-kernels' kernels on torch's thread pool.

use graft_abi::{
    in_place_views, DType, Device, DeviceType, Element, Kernel, NewTensor, Result, Tensor,
};
use graft_kernels::ops::glu::{self, Activation, GluMath};
use graft_kernels::Float;
use half::{bf16, f16};

use super::{
    apart, backward_by_copy, check, check_in_place, check_packed, check_packed_backward, gelu,
    packed_shape,
};
use crate::common::stats::Counters;
use crate::common::tensor::{contiguous, unsupported};
use crate::common::threads::TorchPool;

pub static SWIGLU_CPU: Counters = Counters::new();
pub static SWIGLU_BACKWARD_CPU: Counters = Counters::new();
pub static GEGLU_CPU: Counters = Counters::new();
pub static GEGLU_BACKWARD_CPU: Counters = Counters::new();
pub static SWIGLU_BACKWARD_INPLACE_CPU: Counters = Counters::new();
pub static GEGLU_BACKWARD_INPLACE_CPU: Counters = Counters::new();
pub static SWIGLU_PACKED_CPU: Counters = Counters::new();
pub static SWIGLU_PACKED_BACKWARD_CPU: Counters = Counters::new();
pub static SWIGLU_PACKED_BACKWARD_INPLACE_CPU: Counters = Counters::new();

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

fn packed_forward_cpu_typed<T: Float + Element>(
    act: Activation,
    gate_up: &Tensor,
    half: &[i64],
) -> Result<Tensor>
where
    T::Acc: GluMath,
{
    let gu = contiguous(gate_up)?;
    let (_, cols) = packed_shape(half);
    let mut y = NewTensor::empty(half, T::DTYPE, Device::CPU)?;
    glu::forward_packed::<T>(act, cols, gu.as_slice()?, y.as_mut_slice()?, &TorchPool);
    Ok(y.finish())
}

fn packed_backward_cpu_typed<T: Float + Element>(
    act: Activation,
    grad: &Tensor,
    gate_up: &Tensor,
    half: &[i64],
) -> Result<Tensor>
where
    T::Acc: GluMath,
{
    let (d, gu) = (contiguous(grad)?, contiguous(gate_up)?);
    let (_, cols) = packed_shape(half);
    let mut out = NewTensor::empty(gate_up.sizes()?, T::DTYPE, Device::CPU)?;
    glu::backward_packed::<T>(
        act,
        cols,
        gu.as_slice()?,
        d.as_slice()?,
        out.as_mut_slice()?,
        &TorchPool,
    );
    Ok(out.finish())
}

fn packed_forward_cpu(op: &str, act: Activation, gate_up: &Tensor) -> Result<Tensor> {
    let (checked, half) = check_packed(op, DeviceType::CPU, gate_up)?;
    match checked.dtype {
        DType::F32 => packed_forward_cpu_typed::<f32>(act, gate_up, &half),
        DType::F64 => packed_forward_cpu_typed::<f64>(act, gate_up, &half),
        DType::BF16 => packed_forward_cpu_typed::<bf16>(act, gate_up, &half),
        DType::F16 => packed_forward_cpu_typed::<f16>(act, gate_up, &half),
        other => Err(unsupported(op, other)),
    }
}

/// The packed gradient in a new tensor (its operands checked, `written` for the in-place op's).
fn packed_backward_cpu(
    op: &str,
    act: Activation,
    grad: &Tensor,
    gate_up: &Tensor,
    written: bool,
) -> Result<Tensor> {
    let (checked, half) = check_packed_backward(op, DeviceType::CPU, grad, gate_up, written)?;
    match checked.dtype {
        DType::F32 => packed_backward_cpu_typed::<f32>(act, grad, gate_up, &half),
        DType::F64 => packed_backward_cpu_typed::<f64>(act, grad, gate_up, &half),
        DType::BF16 => packed_backward_cpu_typed::<bf16>(act, grad, gate_up, &half),
        DType::F16 => packed_backward_cpu_typed::<f16>(act, grad, gate_up, &half),
        other => Err(unsupported(op, other)),
    }
}

fn packed_backward_in_place_cpu_typed<T: Float + Element>(
    act: Activation,
    grad: &Tensor,
    gate_up: &mut Tensor,
    cols: usize,
) -> Result<()>
where
    T::Acc: GluMath,
{
    let dy = grad.as_slice::<T>()?;
    let mut views = in_place_views::<T>(vec![gate_up])?;
    let [gu] = views.as_mut_slice() else {
        unreachable!("one tensor gives one view")
    };
    glu::backward_packed_in_place::<T>(act, cols, gu, dy, &TorchPool);
    Ok(())
}

/// `gate_up <- d_gate_up` on CPU: by the in-place kernel when `gate_up` and `grad` are
/// contiguous and share no memory (no allocation, one pass), else by computing into a new
/// tensor and copying (a strided `gate_up`, or a `grad` that is a view of it).
fn packed_backward_in_place_cpu(
    op: &str,
    act: Activation,
    grad: &Tensor,
    mut gate_up: Tensor,
) -> Result<()> {
    let (checked, half) = check_packed_backward(op, DeviceType::CPU, grad, &gate_up, true)?;
    let contiguous = gate_up.is_contiguous()? && grad.is_contiguous()?;
    if !(contiguous && apart(grad, &gate_up)?) {
        let d_gate_up = packed_backward_cpu(op, act, grad, &gate_up, true)?;
        return gate_up.copy_from(&d_gate_up);
    }
    let (_, cols) = packed_shape(&half);
    match checked.dtype {
        DType::F32 => packed_backward_in_place_cpu_typed::<f32>(act, grad, &mut gate_up, cols),
        DType::F64 => packed_backward_in_place_cpu_typed::<f64>(act, grad, &mut gate_up, cols),
        DType::BF16 => packed_backward_in_place_cpu_typed::<bf16>(act, grad, &mut gate_up, cols),
        DType::F16 => packed_backward_in_place_cpu_typed::<f16>(act, grad, &mut gate_up, cols),
        other => Err(unsupported(op, other)),
    }
}

/// `torchgraft::swiglu_packed` at CPU.
pub struct SwigluPackedCpu;

impl Kernel for SwigluPackedCpu {
    type Args = (Tensor,);
    type Outputs = (Tensor,);
    fn run((gate_up,): Self::Args) -> Result<(Tensor,)> {
        SWIGLU_PACKED_CPU.call();
        Ok((packed_forward_cpu(
            "swiglu_packed",
            Activation::Silu,
            &gate_up,
        )?,))
    }
}

/// `torchgraft::swiglu_packed_backward` at CPU.
pub struct SwigluPackedBackwardCpu;

impl Kernel for SwigluPackedBackwardCpu {
    type Args = (Tensor, Tensor);
    type Outputs = (Tensor,);
    fn run((grad, gate_up): Self::Args) -> Result<(Tensor,)> {
        SWIGLU_PACKED_BACKWARD_CPU.call();
        let op = "swiglu_packed_backward";
        Ok((packed_backward_cpu(
            op,
            Activation::Silu,
            &grad,
            &gate_up,
            false,
        )?,))
    }
}

/// `torchgraft::swiglu_packed_backward_` at CPU.
pub struct SwigluPackedBackwardInPlaceCpu;

impl Kernel for SwigluPackedBackwardInPlaceCpu {
    type Args = (Tensor, Tensor);
    type Outputs = ();
    fn run((grad, gate_up): Self::Args) -> Result<()> {
        SWIGLU_PACKED_BACKWARD_INPLACE_CPU.call();
        packed_backward_in_place_cpu("swiglu_packed_backward_", Activation::Silu, &grad, gate_up)
    }
}
