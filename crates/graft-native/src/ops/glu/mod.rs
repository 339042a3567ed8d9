//! SwiGLU and GeGLU: `torchgraft::swiglu` / `geglu` and their backward ops, on CPU (graft-kernels)
//! and CUDA (graft-cuda); and `torchgraft::swiglu_packed`, SwiGLU over one `gate_up` tensor whose
//! last dimension holds `[gate | up]` (a fused projection's output), with a gradient packed the
//! same way.
//!
//! `gate` and `up` must have the same sizes, dtype (a floating type) and device ([`check`]); a
//! packed `gate_up` a floating dtype and an even last dimension ([`check_packed`]). Any layout is
//! accepted (non-contiguous inputs are copied first). Outputs are contiguous.

pub mod cpu;
pub mod cuda;

use graft_abi::operands::{overlap, Describe, Overlap};
use graft_abi::{ensure, Checked, DeviceType, Operands, Result, Tensor};
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

/// The sizes of either half of a packed `gate_up` (`[..., 2 I]` -> `[..., I]`): it needs a last
/// dimension, of even size (ATen's `glu` messages).
fn halved(op: &str, gate_up: &Tensor) -> Result<Vec<i64>> {
    let sizes = gate_up.sizes()?;
    let Some((&last, lead)) = sizes.split_last() else {
        return Err(graft_abi::Error::msg(format!(
            "{op} does not support scalars because halving size must be even"
        )));
    };
    ensure!(
        last % 2 == 0,
        "{op}: Halving dimension must be even, but dimension {} is size {last}",
        sizes.len() - 1
    );
    Ok([lead, &[last / 2]].concat())
}

/// The forward's operand (`gate_up`, a floating dtype) and the sizes of its output.
fn check_packed(op: &str, kernel: DeviceType, gate_up: &Tensor) -> Result<(Checked, Vec<i64>)> {
    let checked = Operands::new(op, kernel)
        .tensor("gate_up", gate_up)
        .float()
        .check()?;
    Ok((checked, halved(op, gate_up)?))
}

/// The packed backward's operands: `gate_up` (written by the in-place op) and `grad` of its
/// dtype and device, sized like either half of it. Returns the half's sizes too.
fn check_packed_backward(
    op: &str,
    kernel: DeviceType,
    grad: &Tensor,
    gate_up: &Tensor,
    written: bool,
) -> Result<(Checked, Vec<i64>)> {
    let operands = Operands::new(op, kernel);
    let operands = if written {
        operands.written("gate_up", gate_up)
    } else {
        operands.tensor("gate_up", gate_up)
    };
    let checked = operands
        .float()
        .tensor("grad", grad)
        .dtype_like("gate_up")
        .check()?;
    let half = halved(op, gate_up)?;
    Operands::new(op, kernel)
        .tensor("grad", grad)
        .sizes(&half)
        .check()?;
    Ok((checked, half))
}

/// The number of rows and the columns of either half (`gate_up` viewed as `rows x 2 cols`).
fn packed_shape(half: &[i64]) -> (usize, usize) {
    let cols = half.last().copied().unwrap_or(0) as usize;
    let rows = half[..half.len().saturating_sub(1)].iter().product::<i64>() as usize;
    (rows, cols)
}
