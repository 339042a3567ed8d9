//! SwiGLU and GeGLU: `torchgraft::swiglu` / `geglu` and their backward ops, on CPU (graft-kernels)
//! and CUDA (graft-cuda).
//!
//! `gate` and `up` must have the same sizes, dtype (a floating type) and device ([`check`]); any
//! layout is accepted (non-contiguous inputs are copied first). Outputs are contiguous.

pub mod cpu;
pub mod cuda;

use graft_abi::operands::{overlap, Describe, Overlap};
use graft_abi::{Checked, DeviceType, Operands, Result, Tensor};
use graft_kernels::ops::glu::Activation;

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
