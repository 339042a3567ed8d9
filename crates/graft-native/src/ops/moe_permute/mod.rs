//! Mixture-of-experts token permutation: `torchgraft::moe_sort` (the `(token, k)` pairs
//! grouped by expert), `torchgraft::moe_permute` (the pairs' hidden rows gathered into expert
//! order), `torchgraft::moe_unpermute` (the experts' output rows put back and summed per token
//! with the routing weights) and its backward, on CPU (graft-kernels) and CUDA (graft-cuda).
//! `moe_permute`'s backward is `moe_unpermute` without weights (Python's autograd calls it).
//!
//! Operands (`T` tokens, `K = top_k`, `S = T * K` pairs, pair `p = t * K + k`): `perm` and
//! `inv_perm` `(S,)` int64 (slot `s` holds pair `perm[s]`; pair `p` sits at slot `inv_perm[p]`),
//! `valid` a one-element int32 or int64 tensor (slots at or beyond it are sentinels: zero rows,
//! counted for nothing), all on one device. The kernels read `valid` where it lives: no host
//! synchronisation on CUDA.
//!
//! Index values: `valid` is clamped to `0..=S` everywhere (as the reference's `slot < valid`
//! reads it). On CPU an index outside `0..S`, or (backward) a `perm` and `inv_perm` that are not
//! inverse permutations, raise an error. On CUDA they are not checked (that would synchronise
//! with the host): a slot or pair whose index is outside `0..S` counts as a sentinel (its rows
//! are zero, its weight gradient zero), so no access leaves the tensors; with `perm` and
//! `inv_perm` that are not inverse permutations the values are meaningless (a pair no slot names
//! keeps an unwritten weight gradient).

pub mod cpu;
pub mod cuda;

use graft_abi::{ensure, Checked, DType, DeviceType, Operands, Result, Tensor};

use crate::common::tensor::{acc_dtype, contiguous, to_dtype};

/// The routing weights as the kernels read them, contiguous: of `y`'s dtype when they have it,
/// else converted to `y`'s accumulation dtype (`None`: no weights).
fn kernel_weights(y: DType, weights: Option<&Tensor>) -> Result<Option<Tensor>> {
    let Some(w) = weights else {
        return Ok(None);
    };
    let dtype = if w.dtype()? == y { y } else { acc_dtype(y) };
    Ok(Some(contiguous(&to_dtype(w, dtype)?)?))
}

/// `moe_permute`'s operands; returns the check and `(tokens, hidden)`.
fn check_permute(
    op: &str,
    kernel: DeviceType,
    hidden: &Tensor,
    perm: &Tensor,
    valid: &Tensor,
    top_k: i64,
) -> Result<(Checked, i64, i64)> {
    let checked = Operands::new(op, kernel)
        .tensor("hidden", hidden)
        .float()
        .dims(2)
        .tensor("perm", perm)
        .dtype(DType::I64)
        .dims(1)
        .tensor("valid", valid)
        .numel(1)
        .check()?;
    check_valid_dtype(op, valid)?;
    ensure!(top_k >= 1, "{op}: top_k must be at least 1, got {top_k}");
    let (tokens, width) = (hidden.sizes()?[0], hidden.sizes()?[1]);
    let pairs = perm.sizes()?[0];
    ensure!(
        tokens.checked_mul(top_k) == Some(pairs),
        "{op}: expected perm of size [{}] (tokens * top_k), got [{pairs}]",
        tokens.saturating_mul(top_k)
    );
    Ok((checked, tokens, width))
}

/// The operands `moe_unpermute` and its backward share: `y` `(S, hidden)` with `S` a multiple of
/// `top_k`, `(S,)` int64 index tensors, `valid`, and optional `(T, K)` floating weights;
/// `grad` (backward) `(T, hidden)` of `y`'s dtype. Returns the check and `(tokens, hidden)`.
#[allow(clippy::too_many_arguments)]
fn check_unpermute(
    op: &str,
    kernel: DeviceType,
    grad: Option<&Tensor>,
    y: &Tensor,
    perm: Option<&Tensor>,
    inv_perm: &Tensor,
    valid: &Tensor,
    weights: Option<&Tensor>,
    top_k: i64,
) -> Result<(Checked, i64, i64)> {
    let mut ops = Operands::new(op, kernel);
    if let Some(grad) = grad {
        ops = ops.tensor("grad", grad).float().dims(2);
    }
    ops = ops.tensor("y", y).float().dims(2);
    if grad.is_some() {
        ops = ops.dtype_like("grad");
    }
    let checked = ops
        .optional("perm", perm)
        .dtype(DType::I64)
        .dims(1)
        .tensor("inv_perm", inv_perm)
        .dtype(DType::I64)
        .dims(1)
        .tensor("valid", valid)
        .numel(1)
        .optional("weights", weights)
        .float()
        .dims(2)
        .check()?;
    check_valid_dtype(op, valid)?;
    ensure!(top_k >= 1, "{op}: top_k must be at least 1, got {top_k}");
    let (pairs, width) = (y.sizes()?[0], y.sizes()?[1]);
    ensure!(
        pairs % top_k == 0,
        "{op}: expected the rows of y ({pairs}) to be a multiple of top_k ({top_k})"
    );
    let tokens = pairs / top_k;
    let mut sizes = Operands::new(op, kernel);
    if let Some(grad) = grad {
        sizes = sizes.tensor("grad", grad).sizes(&[tokens, width]);
    }
    sizes
        .optional("perm", perm)
        .sizes(&[pairs])
        .tensor("inv_perm", inv_perm)
        .sizes(&[pairs])
        .optional("weights", weights)
        .sizes(&[tokens, top_k])
        .check()?;
    Ok((checked, tokens, width))
}

/// `moe_sort`'s operands: int64 expert ids of any shape, at least one expert, at most
/// `i32::MAX` ids (the offsets are int32). Returns the check and the number of ids.
fn check_sort(
    op: &str,
    kernel: DeviceType,
    expert_ids: &Tensor,
    num_experts: i64,
) -> Result<(Checked, usize)> {
    let checked = Operands::new(op, kernel)
        .tensor("expert_ids", expert_ids)
        .dtype(DType::I64)
        .check()?;
    ensure!(
        num_experts >= 1,
        "{op}: num_experts must be at least 1, got {num_experts}"
    );
    let pairs = expert_ids.numel()?;
    ensure!(
        i32::try_from(pairs).is_ok(),
        "{op}: {pairs} expert ids are too many: the offsets are int32"
    );
    Ok((checked, pairs))
}

/// `valid` is int32 (what `offsets[-1:]` of grouped GEMM offsets is) or int64.
fn check_valid_dtype(op: &str, valid: &Tensor) -> Result<()> {
    let dtype = valid.dtype()?;
    ensure!(
        dtype == DType::I32 || dtype == DType::I64,
        "{op}: expected valid to have dtype Int or Long, got {}",
        dtype.name()
    );
    Ok(())
}
