//! Mixture-of-experts routing with sigmoid scores and group-limited top-k (DeepSeek-V3's and
//! GLM-4-MoE's routers): `torchgraft::topk_sigmoid` and its backward, on CPU (graft-kernels)
//! and CUDA (graft-cuda). The semantics are graft-kernels' `ops::topk_sigmoid`.
//!
//! `logits` is `(rows, experts)` of a floating dtype, `bias` (optional) `(experts,)` in the
//! accumulation dtype (float32, float64 for float64 logits); the weights are in that dtype, the
//! indices int64, both `(rows, k)` and contiguous.

pub mod cpu;
pub mod cuda;

use graft_abi::{ensure, Checked, DType, DeviceType, Operands, Result, Tensor};

use crate::common::tensor::acc_dtype;

/// The forward's choice: `k` experts from the `topk_groups` best of `groups` groups.
pub(super) struct Grouping {
    pub k: usize,
    pub groups: usize,
    pub topk_groups: usize,
}

/// The forward's operands: 2-D floating logits, a bias of `experts` values in the weights'
/// dtype, `groups` dividing the experts into groups of at least two, `1 <= topk_groups <=
/// groups` and `1 <= k <= topk_groups * experts / groups`.
pub(super) fn check_forward(
    op: &str,
    kernel: DeviceType,
    logits: &Tensor,
    bias: Option<&Tensor>,
    k: i64,
    groups: i64,
    topk_groups: i64,
) -> Result<(Checked, Grouping)> {
    let checked = Operands::new(op, kernel)
        .tensor("logits", logits)
        .float()
        .dims(2)
        .check()?;
    let experts = logits.sizes()?[1];
    Operands::new(op, kernel)
        .tensor("logits", logits)
        .optional("bias", bias)
        .dtype(acc_dtype(checked.dtype))
        .sizes(&[experts])
        .check()?;
    ensure!(
        groups >= 1 && experts % groups == 0 && experts / groups >= 2,
        "{op}: expected groups to split the {experts} experts into groups of at least 2, \
         got groups = {groups}"
    );
    ensure!(
        (1..=groups).contains(&topk_groups),
        "{op}: expected 1 <= topk_groups <= groups = {groups}, got topk_groups = {topk_groups}"
    );
    let candidates = topk_groups * (experts / groups);
    ensure!(
        (1..=candidates).contains(&k),
        "{op}: selected index k out of range (k = {k}, experts in the kept groups = {candidates})"
    );
    let grouping = Grouping {
        k: k as usize,
        groups: groups as usize,
        topk_groups: topk_groups as usize,
    };
    Ok((checked, grouping))
}

/// The backward's operands: the `(rows, k)` gradient in the weights' dtype, `(rows, k)` int64
/// indices, `(rows, experts)` logits with `1 <= k <= experts`, one device.
pub(super) fn check_backward(
    op: &str,
    kernel: DeviceType,
    grad_weights: &Tensor,
    logits: &Tensor,
    indices: &Tensor,
) -> Result<Checked> {
    let checked = Operands::new(op, kernel)
        .tensor("logits", logits)
        .float()
        .dims(2)
        .check()?;
    let dims = logits.sizes()?.to_vec();
    let routed = indices.sizes()?.to_vec();
    ensure!(
        routed.len() == 2 && routed[0] == dims[0] && (1..=dims[1]).contains(&routed[1]),
        "{op}: expected indices of size [{}, k] with 1 <= k <= {}, got {routed:?}",
        dims[0],
        dims[1]
    );
    Operands::new(op, kernel)
        .tensor("logits", logits)
        .tensor("grad_weights", grad_weights)
        .dtype(acc_dtype(checked.dtype))
        .sizes(&routed)
        .tensor("indices", indices)
        .dtype(DType::I64)
        .check()?;
    Ok(checked)
}
