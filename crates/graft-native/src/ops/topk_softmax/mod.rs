//! Mixture-of-experts routing: `torchgraft::topk_softmax` (softmax over each row of router
//! logits, the `k` largest probabilities and their experts, optionally renormalized) and its
//! backward, on CPU (graft-kernels) and CUDA (graft-cuda).
//!
//! `logits` is `(rows, experts)` of a floating dtype; the weights are float32 (float64 for
//! float64 logits), the indices int64, both `(rows, k)` and contiguous.

pub mod cpu;
pub mod cuda;

use graft_abi::{ensure, Checked, DType, DeviceType, Operands, Result, Tensor};

use crate::common::tensor::acc_dtype;

/// The forward's operands; `k` within `1..=experts` (torch.topk's rule).
fn check_forward(op: &str, kernel: DeviceType, logits: &Tensor, k: i64) -> Result<Checked> {
    let checked = Operands::new(op, kernel)
        .tensor("logits", logits)
        .float()
        .dims(2)
        .check()?;
    let experts = logits.sizes()?[1];
    ensure!(
        (1..=experts).contains(&k),
        "{op}: selected index k out of range (k = {k}, experts = {experts})"
    );
    Ok(checked)
}

/// The backward's operands: `(rows, k)` gradient and weights in the weights' dtype, int64
/// indices, `(rows, experts)` logits, one device.
fn check_backward(
    op: &str,
    kernel: DeviceType,
    grad_weights: &Tensor,
    logits: &Tensor,
    weights: &Tensor,
    indices: &Tensor,
) -> Result<Checked> {
    let dims = logits.sizes()?.to_vec();
    let checked = Operands::new(op, kernel)
        .tensor("logits", logits)
        .float()
        .dims(2)
        .check()?;
    ensure!(dims.len() == 2, "{op}: logits must be 2-D");
    let routed = weights.sizes()?.to_vec();
    ensure!(
        routed.len() == 2 && routed[0] == dims[0] && (1..=dims[1]).contains(&routed[1]),
        "{op}: expected weights of size [{}, k] with 1 <= k <= {}, got {routed:?}",
        dims[0],
        dims[1]
    );
    Operands::new(op, kernel)
        .tensor("logits", logits)
        .tensor("grad_weights", grad_weights)
        .dtype(acc_dtype(checked.dtype))
        .sizes(&routed)
        .tensor("weights", weights)
        .dtype(acc_dtype(checked.dtype))
        .sizes(&routed)
        .tensor("indices", indices)
        .dtype(DType::I64)
        .sizes(&routed)
        .check()?;
    Ok(checked)
}
