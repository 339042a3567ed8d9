"""torchgraft's fused operators as functions, differentiable and ``torch.compile``-able.

Each runs one ``torch.ops.torchgraft.*`` custom operator (Rust kernels on CPU, CUDA C++ on CUDA)
in place of a chain of aten ops that the dispatcher cannot fuse. Importing this module defines
those operators (it needs the compiled extension); it imports no DSL.

The kernels compute the real floating dtypes (float32, float64, bfloat16, float16). A call they
do not take (integer, boolean or complex tensors, and the few argument forms each function
names) runs the eager expression the function stands for, so it gets PyTorch's own results and
errors (``NotImplementedError`` for a dtype ATen does not implement, ``IndexError`` for a
dimension out of range). Everything else is checked once, by the op's native entry (and its fake
function for meta tensors), which raises ``RuntimeError`` with ATen's messages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchgraft.common.operands import FLOATS as _FLOATS
from torchgraft.ops.cross_entropy import autograd as _ce
from torchgraft.ops.cross_entropy.fake import eager as _ce_eager
from torchgraft.ops.cross_entropy.reference import cross_entropy_eager, rows_of
from torchgraft.ops.glu import autograd as _glu
from torchgraft.ops.glu.reference import geglu_eager, swiglu_eager, swiglu_packed_eager
from torchgraft.ops.linear_cross_entropy import autograd as _lce  # noqa: F401  (autograd)
from torchgraft.ops.linear_cross_entropy.reference import linear_cross_entropy_eager
from torchgraft.ops.moe_permute import autograd as _moe
from torchgraft.ops.moe_permute.reference import (
    moe_permute_reference,
    moe_sort_reference,
    moe_unpermute_reference,
)
from torchgraft.ops.rms_norm import autograd as _rms_norm
from torchgraft.ops.rms_norm.reference import acc_dtype as _acc_dtype
from torchgraft.ops.rms_norm.reference import rms_norm_eager
from torchgraft.ops.rope import autograd as _rope
from torchgraft.ops.rope.reference import rope_eager
from torchgraft.ops.topk_sigmoid import autograd as _topk_sigmoid
from torchgraft.ops.topk_sigmoid.reference import topk_sigmoid_reference
from torchgraft.ops.topk_softmax import autograd as _topk
from torchgraft.ops.topk_softmax.reference import topk_softmax_reference

__all__ = [
    "cross_entropy",
    "geglu",
    "linear_cross_entropy",
    "moe_permute",
    "moe_sort",
    "moe_unpermute",
    "rms_norm",
    "rope",
    "swiglu",
    "swiglu_packed",
    "topk_sigmoid",
    "topk_softmax",
]

_GELU_APPROXIMATIONS = ("none", "tanh")
# The devices whose kernels run here and have an autocast state.
_AUTOCAST_DEVICES = ("cpu", "cuda")
# The devices the routing kernels (topk_softmax, topk_sigmoid) run on (meta tensors take the
# reference too).
_TOPK_DEVICES = ("cpu", "cuda")


def _glu_kernel_takes(gate: Tensor, up: Tensor) -> bool:
    """Whether the fused GLU kernels take ``gate`` and ``up``: one real floating dtype, one
    shape. Mixed dtypes (promoted), broadcasting shapes and other dtypes get the eager
    expression."""
    return gate.dtype in _FLOATS and up.dtype == gate.dtype and up.shape == gate.shape


def swiglu(gate: Tensor, up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    """``F.silu(gate) * up`` in one pass (computed in float32, float64 for float64 inputs).

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
        inplace_backward: Write the gradients of ``gate`` and ``up`` over ``gate`` and ``up``
            in the backward instead of allocating them (Liger-Kernel's trick: the backward
            then needs no memory of its own). Only for callers that own ``gate`` and ``up``:
            intermediate results (e.g. an MLP's fresh gate and up projections) that nothing
            reads after the backward. Autograd raises if another recorded op saved them (their
            version counter moves); leaves, tensors that do not require grad and
            non-contiguous tensors get ordinary allocated gradients. On CPU the kernel
            computes into temporaries and copies: the memory saving is on the GPU.

    Other dtypes, mixed dtypes and shapes that broadcast compute ``F.silu(gate) * up``.
    """
    if not _glu_kernel_takes(gate, up):
        return swiglu_eager(gate, up)
    return _glu.swiglu(gate, up, inplace_backward=inplace_backward)


def swiglu_packed(gate_up: Tensor, *, inplace_backward: bool = False) -> Tensor:
    """SwiGLU of a packed gate-and-up projection in one pass: ``gate, up = gate_up.chunk(2,
    dim=-1)``, then ``F.silu(gate) * up`` (computed in float32, float64 for float64 inputs), as
    transformers' MoE experts apply their gate. The backward writes one packed gradient
    ``[d_gate | d_up]``, so no ``cat`` follows it.

    Args:
        gate_up: The fused projection, shape ``(..., 2 * I)``, a floating dtype: the last
            dimension holds ``[gate | up]`` and must be even. Returns shape ``(..., I)``.
        inplace_backward: Write the gradient of ``gate_up`` over ``gate_up`` in the backward
            instead of allocating it, as for [`swiglu`][]. Only for callers that own
            ``gate_up``: an intermediate result (e.g. a grouped matmul's fresh output) that
            nothing reads after the backward. Autograd raises if another recorded op saved it
            (its version counter moves); a leaf, a tensor that does not require grad and a
            non-contiguous tensor get an ordinary allocated gradient, and so does every call
            under ``torch.compile`` (the op's registered formula runs there).

    Other dtypes compute the eager expression (an odd last dimension raises ``RuntimeError``
    there too).
    """
    if gate_up.dtype not in _FLOATS:
        return swiglu_packed_eager(gate_up)
    if inplace_backward:
        return _glu.swiglu_packed_inplace_backward(gate_up)
    return _glu.swiglu_packed(gate_up)


def geglu(
    gate: Tensor, up: Tensor, approximate: str = "none", *, inplace_backward: bool = False
) -> Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in one pass.

    Args:
        gate: The gate projection, any shape, a floating dtype.
        up: The up projection: the same shape, dtype and device as ``gate``.
        approximate: ``"none"`` (exact, erf) or ``"tanh"``, as for ``F.gelu``.
        inplace_backward: As for [`swiglu`][]: the backward writes the gradients over ``gate``
            and ``up`` (only for callers that own them and never read them afterwards).

    Other dtypes, mixed dtypes and shapes that broadcast compute ``F.gelu(gate) * up``.
    """
    if approximate not in _GELU_APPROXIMATIONS:
        raise RuntimeError(f"approximate argument must be either none or tanh, got {approximate!r}")
    if not _glu_kernel_takes(gate, up):
        return geglu_eager(gate, up, approximate)
    return _glu.geglu(gate, up, approximate == "tanh", inplace_backward=inplace_backward)


def rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of ``q`` and ``k`` in one pass: transformers'
    ``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, ``rotate_half`` mapping the
    last dimension's halves ``[x1, x2]`` to ``[-x2, x1]``).

    ``cos`` and ``sin`` are unsqueezed at ``unsqueeze_dim`` and broadcast against ``q`` and
    ``k``: ``(B, S, D)`` tables with ``(B, H, S, D)`` heads (``unsqueeze_dim=1``, the default) or
    ``(B, S, H, D)`` heads (``unsqueeze_dim=2``). ``q`` and ``k`` may have different head counts
    (grouped-query attention) and any strides (e.g. transposed views of the projections): they
    are read in place. When ``cos.size(-1)`` is smaller than the head dimension, only the leading
    ``cos.size(-1)`` elements of each head are rotated and the rest pass through (partial rotary
    embeddings, as Phi-3 and GPT-NeoX apply them). The interleaved (GPT-J) convention is not
    this one.

    Each output has its input's strides when the input is dense (as eager's elementwise ops
    give), else it is contiguous. Arithmetic is in float32 (float64 for float64), each element
    rounded once; inputs of different dtypes are computed in their promoted dtype, as eager
    promotes them. Other dtypes, an ``unsqueeze_dim`` out of the tables' range and tables of two
    shapes get the eager expression (``rope_eager``), with its results and errors.

    Args:
        q: Queries, ``(..., D)``, a floating dtype.
        k: Keys, ``(..., D)``, on ``q``'s device.
        cos: Cosine table; its last size (even, at most ``D``) is the rotary dimension.
        sin: Sine table, the size of ``cos``.
        unsqueeze_dim: Where ``cos`` and ``sin`` get the dimension they broadcast over.

    Returns:
        ``(q_embed, k_embed)``, shaped like ``q`` and ``k``.
    """
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, int):
        raise TypeError(f"unsqueeze_dim must be an int, got {type(unsqueeze_dim).__name__}")
    rank = cos.dim()
    takes = -rank - 1 <= unsqueeze_dim <= rank and sin.shape == cos.shape
    if q.dtype == k.dtype == cos.dtype == sin.dtype and q.dtype in _FLOATS and takes:
        return _rope.rope(q, k, cos, sin, unsqueeze_dim)
    floats = all(t.dtype in _FLOATS for t in (q, k, cos, sin))
    if not (floats and takes):
        return rope_eager(q, k, cos, sin, unsqueeze_dim)
    q_dtype = torch.promote_types(q.dtype, torch.promote_types(cos.dtype, sin.dtype))
    k_dtype = torch.promote_types(k.dtype, torch.promote_types(cos.dtype, sin.dtype))
    common = torch.promote_types(q_dtype, k_dtype)
    q_embed, k_embed = _rope.rope(
        q.to(common), k.to(common), cos.to(common), sin.to(common), unsqueeze_dim
    )
    return q_embed.to(q_dtype), k_embed.to(k_dtype)


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


def _reduction(reduction: str) -> int:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")
    return _REDUCTIONS[reduction]


def _rows_target(target: Tensor, rows: int) -> Tensor:
    """``target`` as the ``(rows,)`` int64 vector the ops take, checked as ATen checks it."""
    flat = target.reshape(-1)
    if flat.shape[0] != rows:
        raise ValueError(
            f"Expected input batch_size ({rows}) to match target batch_size ({flat.shape[0]})."
        )
    return flat.long() if flat.dtype == torch.uint8 else flat


def _index_error(exc: RuntimeError) -> Exception:
    """ATen raises IndexError for an out-of-range target; the native kernels' errors are
    RuntimeErrors with the same text."""
    message = str(exc)
    if message.startswith("Target ") and message.endswith(" is out of bounds."):
        return IndexError(message)
    return exc


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    inplace_backward: bool = False,
) -> Tensor:
    """``F.cross_entropy(logits.float(), target, ...)`` in one pass over the logits.

    The logits are read in their own dtype (no float32 copy); the loss is float32 (float64 for
    float64 logits). The gradient is computed in the same pass and kept for the backward, which
    only multiplies it by the upstream gradient.

    Args:
        logits: ``(..., V)`` scores, a floating dtype; the leading dimensions are flattened into
            rows (as language models do before their loss; ``F.cross_entropy`` would read a 3-D
            input's dimension 1 as the classes).
        target: Class indices (int64 or uint8) with as many elements as there are rows; rows
            whose target is ``ignore_index`` count for nothing. Any other target outside
            ``[0, V)`` raises ``IndexError`` on the CPU and fails a device-side assertion on
            CUDA, as in ATen.
        ignore_index: Target value of rows to skip.
        reduction: ``"mean"`` (over the rows not ignored; NaN if there are none), ``"sum"`` or
            ``"none"`` (one loss per row, shaped like ``target``).
        label_smoothing: In ``[0, 1]``, as for ``F.cross_entropy`` (negative values mean none).
        inplace_backward: Write the gradient over ``logits`` instead of a new buffer: no memory
            beyond the logits' own. Safe only when the caller owns ``logits`` and nothing reads
            them after this call: not the caller (the values are gone), not another loss or
            metric, not an autograd node that saved them for its backward (their version counter
            is bumped, so such a node raises instead of computing a wrong gradient), and when the
            backward runs at most once (a second one raises). ``logits`` must not be a leaf that
            requires grad. Ignored (a new buffer is used) under ``torch.compile`` or any
            tracing, without gradients, and for non-contiguous logits.

    Logits of another dtype (integer, boolean, complex) get ``F.cross_entropy`` itself.
    """
    red = _reduction(reduction)
    if logits.dim() < 1:
        raise ValueError(f"Expected 1 or more dimensions (got {logits.dim()})")
    if logits.dtype not in _FLOATS:
        return cross_entropy_eager(logits, target, ignore_index, reduction, label_smoothing)
    rows = rows_of(logits)
    flat_target = _rows_target(target, rows.shape[0])
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    in_place = inplace_backward and compute_grad and rows.is_contiguous() and _ce_eager(rows)
    if in_place and logits.is_leaf:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation."
        )
    try:
        if in_place:
            loss = _ce.CrossEntropyInPlace.apply(
                rows, flat_target, ignore_index, red, label_smoothing
            )
        else:
            loss, _ = torch.ops.torchgraft.cross_entropy(
                rows, flat_target, ignore_index, red, label_smoothing, compute_grad
            )
    except RuntimeError as exc:
        raise _index_error(exc) from None
    return loss.reshape(target.shape) if red == 0 else loss


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """``F.cross_entropy((hidden @ weight.T + bias).float(), target, ...)`` without the logits.

    The full ``(N, V)`` logits never exist. With ``chunk_size``, the rows are processed in
    chunks: each chunk's logits are computed into one reused buffer, turned into their gradient
    in place, and multiplied into the gradients of ``hidden``, ``weight`` and ``bias`` right away
    (those that require grad). With ``TORCHGRAFT_LCE_SCHEME=two-pass`` in the environment,
    groups of rows run two passes over blocks of the vocabulary instead (statistics, then
    gradients, each block's logits computed twice): one more matmul, buffers within the logits
    chunk Liger-Kernel would hold; less memory than Liger-Kernel's and faster, slower than row
    chunks (docs/losses.md has the H100 figures). The weight gradient accumulates in the
    weight's dtype (one rounding per chunk or group of rows, as Liger-Kernel's default). The
    loss is float32 (float64 for float64 inputs). Under autocast the matmul's operands are cast
    as ``F.linear`` casts them.

    Args:
        hidden: ``(..., H)`` hidden states; the leading dimensions are flattened into rows.
        weight: ``(V, H)`` lm-head weight, the dtype and device of ``hidden``.
        target: Class indices with one element per row; see :func:`cross_entropy`.
        bias: Optional ``(V,)`` bias.
        ignore_index: Target value of rows to skip.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (then the backward runs the chunks again
            with each row's upstream gradient).
        chunk_size: Rows per chunk; by default a logits buffer about the size of ``hidden``
            (at least 1024 rows). Larger chunks are
            faster and round the weight gradient fewer times, and cost ``chunk_size * V``
            elements.

    ``hidden`` of another dtype (integer, boolean, complex) and a bias of another dtype or of
    another shape than ``(V,)`` (that broadcasts) get the eager expression,
    ``F.cross_entropy(F.linear(hidden, weight, bias), target)``.
    """
    red = _reduction(reduction)
    if hidden.dim() < 1:
        raise ValueError(f"Expected 1 or more dimensions (got {hidden.dim()})")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if hidden.dtype not in _FLOATS or not _lce_bias_fits(hidden, weight, bias):
        return linear_cross_entropy_eager(hidden, weight, target, bias, ignore_index, reduction)
    rows = rows_of(hidden)
    flat_target = _rows_target(target, rows.shape[0])
    device = rows.device.type
    # Only devices with autocast state (torch.amp.is_autocast_available is not traceable by
    # dynamo before 2.12, and is_autocast_enabled raises for "meta").
    if device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        # As F.linear under autocast: the matmul's operands in the autocast dtype.
        dtype = torch.get_autocast_dtype(device)
        rows, weight = rows.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    grad = torch.is_grad_enabled()
    mask = [
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    ]
    try:
        loss = torch.ops.torchgraft.linear_cross_entropy(
            rows, weight, flat_target, bias, ignore_index, red, chunk_size or 0, mask
        )[0]
    except RuntimeError as exc:
        raise _index_error(exc) from None
    return loss.reshape(target.shape) if red == 0 else loss


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = False,
) -> Tensor:
    """RMSNorm over the last dimension with a model's own numerics, in one kernel each way.

    With ``xhat = x * rsqrt(mean(x^2) + eps)`` computed in float32 (float64 for float64 ``x``)
    and ``scale = offset + weight`` (added in float32, or float64 where ``x`` or the result is
    float64):

    - ``cast_before_weight=True``, as Llama, Mistral, Qwen and most transformers models write
      ``weight * xhat.to(x.dtype)``: ``xhat`` is rounded to ``x``'s dtype, then multiplied by
      ``scale`` and rounded to the dtype that expression returns (``x``'s, or a wider weight's:
      a float32 weight under a bfloat16 ``x`` gives float32, computed then as a normalization
      kernel and a multiply);
    - ``cast_before_weight=False``, as Gemma (``offset=1``: ``(xhat * (1 + weight.float()))``)
      and OLMo2 (``(weight * xhat)``) write it before ``.to(x.dtype)``: ``xhat * scale`` is
      rounded once to ``x``'s dtype; with a weight of ``x``'s dtype and ``offset=0`` this is
      ``F.rms_norm(x, [x.shape[-1]], weight, eps)``;
    - without a weight: ``xhat`` rounded to ``x``'s dtype (``offset`` must be 0).

    The backward computes dx and dw together (dw in the weight's dtype, summed in float32 in
    a fixed order: the same bits every run), taking the rounding's derivative as 1, as autograd
    does for ``.to()``: dw sums ``dy * xhat.to(x.dtype)`` where the forward rounded first.

    Args:
        x: The input, normalized over its last dimension; float16, bfloat16, float32 or
            float64, any shape with at least one dimension.
        weight: 1-D, ``x.shape[-1]`` elements, a floating dtype, on ``x``'s device; or None.
        eps: Added to the mean square; None: the machine epsilon of the accumulation dtype
            (as ``F.rms_norm``).
        offset: Added to the weight (Gemma: 1.0).
        cast_before_weight: Round ``xhat`` to ``x``'s dtype before the weight multiply.

    Other dtypes, a 0-dim ``x`` and a weight of another shape that broadcasts compute the eager
    expression (``rms_norm_eager``).
    """
    if eps is None:
        eps = torch.finfo(_acc_dtype(x.dtype)).eps
    if weight is None and offset != 0:
        raise ValueError(f"rms_norm: offset={offset} needs a weight (offset + weight)")
    if not _rms_norm_kernel_takes(x, weight):
        return rms_norm_eager(x, weight, eps, offset, cast_before_weight)
    if weight is None:
        return _rms_norm.rms_norm(x, None, eps, 0.0, False)[0]
    if cast_before_weight:
        out = torch.promote_types(x.dtype, weight.dtype)
        if out != x.dtype:
            # The product is wider than x: normalize in one kernel, multiply in the wider dtype
            # (which checks the weight's device as eager's product does).
            xhat = _rms_norm.rms_norm(x, None, eps, 0.0, False)[0]
            scale = weight.to(out) + offset if offset != 0 else weight.to(out)
            return xhat.to(out) * scale
    return _rms_norm.rms_norm(x, weight, eps, offset, cast_before_weight)[0]


def _lce_bias_fits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether the fused kernels take ``bias``: none, or ``(V,)`` of ``hidden``'s dtype."""
    return bias is None or (bias.dtype == hidden.dtype and bias.shape == weight.shape[:1])


def _rms_norm_kernel_takes(x: Tensor, weight: Tensor | None) -> bool:
    """Whether the RMSNorm kernels take the call: a real floating ``x`` with at least one
    dimension, and no weight or a real floating one of ``x``'s last size."""
    if x.dtype not in _FLOATS or x.dim() == 0:
        return False
    return weight is None or (weight.dtype in _FLOATS and weight.shape == x.shape[-1:])


def topk_softmax(logits: Tensor, k: int, *, renormalize: bool = False) -> tuple[Tensor, Tensor]:
    """Mixture-of-experts routing in one pass: ``softmax(logits)`` over the experts, the ``k``
    largest probabilities (largest first, the lower expert first among equals) and their
    experts, divided by their sum when ``renormalize`` (transformers' ``norm_topk_prob``).

    Args:
        logits: The router's logits, ``(tokens, experts)``, a floating dtype.
        k: Experts per token, ``1 <= k <= experts``.
        renormalize: Make each token's ``k`` weights sum to one.

    Returns:
        ``(weights, indices)``, both ``(tokens, k)``: the weights in float32 (float64 for
        float64 logits), as the models' ``softmax(..., dtype=torch.float)`` gives them, and the
        experts as int64. The weights are differentiable with respect to ``logits``.

    The kernels run on the CPU (Rust) and CUDA (one warp per token); other devices, other
    dtypes, other shapes and an out-of-range ``k`` compute the same with torch's ops
    (``softmax``, ``topk``), so their errors are torch's.
    """
    takes = (
        logits.dtype in _FLOATS
        and logits.dim() == 2
        and logits.device.type in _TOPK_DEVICES
        and 1 <= k <= logits.shape[1]
    )
    if not takes:
        return topk_softmax_reference(logits, k, renormalize)
    return _topk.topk_softmax(logits, k, renormalize)


def topk_sigmoid(
    logits: Tensor,
    k: int,
    *,
    bias: Tensor | None = None,
    groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = False,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Mixture-of-experts routing with sigmoid scores and group-limited top-k, in one pass
    (DeepSeek-V3's and GLM-4-MoE's routers): scores ``sigmoid(logits)``; the experts split into
    ``groups`` equal groups of adjacent experts, each scored by the sum of its two best
    ``scores + bias``; the ``k`` best ``scores + bias`` among the experts of the
    ``topk_groups`` best groups (largest first, the lower expert first among equals); their
    scores, divided by their sum plus 1e-20 when ``renormalize``, times ``scale``.

    Args:
        logits: The router's logits, ``(tokens, experts)``, a floating dtype.
        k: Experts per token, ``1 <= k <= topk_groups * experts / groups``.
        bias: The router's ``e_score_correction_bias``, ``(experts,)``: it steers the choice
            only (no gradient reaches it), as in the models.
        groups: Groups of experts (``n_group``); 1 disables the group limit.
        topk_groups: Groups kept per token (``topk_group``).
        renormalize: Divide each token's weights by their sum (``norm_topk_prob``).
        scale: Multiply the weights by this (``routed_scaling_factor``).

    Returns:
        ``(weights, indices)``, both ``(tokens, k)``: the weights in float32 (float64 for
        float64 logits) and differentiable with respect to ``logits``, the experts as int64.

    The kernels run on the CPU (Rust) and CUDA; other devices, dtypes and shapes, and choices
    the kernels do not take (groups that do not split the experts, ``k`` beyond the kept
    groups), compute the same with torch's ops, so their errors and results are torch's.
    """
    experts = logits.shape[-1] if logits.dim() else 0
    device = logits.device
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    takes = (
        logits.dtype in _FLOATS
        and logits.dim() == 2
        and device.type in _TOPK_DEVICES
        and groups >= 1
        and experts % groups == 0
        and experts // groups >= 2
        and 1 <= topk_groups <= groups
        and 1 <= k <= topk_groups * (experts // groups)
        and (
            bias is None
            or (bias.dtype in _FLOATS and bias.shape == (experts,) and bias.device == device)
        )
    )
    if not takes:
        return topk_sigmoid_reference(logits, bias, k, groups, topk_groups, renormalize, scale)
    if bias is not None:
        # The models add the bias to float32 scores: a bfloat16 bias widens exactly.
        bias = bias.to(dtype)
    return _topk_sigmoid.topk_sigmoid(
        logits, bias, k, groups, topk_groups, renormalize, float(scale)
    )


# The devices the MoE permutation kernels run on, and the dtypes they read `valid` in.
_MOE_DEVICES = ("cpu", "cuda")
# The most experts moe_sort's CUDA kernel takes (graft-cuda's MOE_SORT_MAX_EXPERTS).
_MOE_SORT_CUDA_EXPERTS = 2048
_MOE_VALID_DTYPES = (torch.int32, torch.int64)


def _moe_indices_fit(index: Tensor, valid: Tensor, device: torch.device, pairs: int) -> bool:
    """Whether the permutation kernels take ``index`` and ``valid`` next to rows on ``device``:
    ``(pairs,)`` int64, a one-element int32 or int64 ``valid``, all on that device."""
    return (
        device.type in _MOE_DEVICES
        and index.dtype == torch.int64
        and index.shape == (pairs,)
        and index.device == device
        and valid.dtype in _MOE_VALID_DTYPES
        and valid.numel() == 1
        and valid.device == device
    )


def moe_sort(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ``(token, k)`` pairs of ``expert_ids`` ``(T, K)`` int64 grouped by expert, with
    torch's ops on their device: no host synchronisation, safe under CUDA graphs and
    ``torch.compile``.

    Returns:
        ``(perm, inv_perm, offsets, valid)``: ``perm`` ``(T*K,)`` int64, the pairs (``p = t * K
        + k``) in expert order, stably (within an expert in token order); ``inv_perm`` its
        inverse (pair ``p`` sits at slot ``inv_perm[p]``); ``offsets`` ``(num_experts,)`` int32,
        the end of each expert's slots (``torch._grouped_mm``'s ``offs``); ``valid`` ``(1,)``
        int32, ``offsets[-1:]``, the number of slots of local experts. Ids outside ``[0,
        num_experts)`` (experts of other ranks under expert parallelism) sort last, into the
        sentinel slots at or beyond ``valid``.

    One counting sort (Rust on CPU; two launches on CUDA, up to 2048 experts); int64 ids on
    other devices, and more experts on CUDA, run torch's ops (a stable sort and a search).
    """
    if num_experts < 1:
        raise ValueError(f"moe_sort: num_experts must be at least 1, got {num_experts}")
    takes = (
        expert_ids.dtype == torch.int64
        and expert_ids.device.type in _MOE_DEVICES
        and (expert_ids.device.type == "cpu" or num_experts <= _MOE_SORT_CUDA_EXPERTS)
        and expert_ids.numel() < 2**31
    )
    if not takes:
        return moe_sort_reference(expert_ids, num_experts)
    perm, inv_perm, offsets = torch.ops.torchgraft.moe_sort(expert_ids, num_experts)
    return perm, inv_perm, offsets, offsets[-1:]


def moe_permute(hidden: Tensor, perm: Tensor, valid: Tensor, top_k: int) -> Tensor:
    """The hidden rows of the ``(token, k)`` pairs in expert order, in one pass:
    ``out[s] = hidden[perm[s] // top_k]`` for ``s < valid``, zero beyond.

    Args:
        hidden: ``(T, H)``, a floating dtype.
        perm: ``(T * top_k,)`` int64 from [`moe_sort`][]: slot ``s`` holds pair ``perm[s]``.
        valid: One-element int32 or int64 tensor on ``hidden``'s device (``moe_sort``'s), read
            there: the call never waits for the host.
        top_k: Experts per token.

    Returns:
        ``(T * top_k, H)`` of ``hidden``'s dtype; differentiable with respect to ``hidden`` (its
        gradient sums each token's real slots, in float32, without atomics).

    The kernels run on CPU (Rust) and CUDA; other dtypes, devices and shapes compute
    ``hidden[perm // top_k]`` with the sentinel rows zeroed in torch's ops, so their errors are
    torch's. On CPU an index out of range raises; on CUDA it reads as a sentinel (no host check).
    """
    takes = (
        hidden.dtype in _FLOATS
        and hidden.dim() == 2
        and top_k >= 1
        and _moe_indices_fit(perm, valid, hidden.device, hidden.shape[0] * top_k)
    )
    if not takes:
        return moe_permute_reference(hidden, perm, valid, top_k)
    return _moe.moe_permute(hidden, perm, valid, top_k)


def moe_unpermute(
    y: Tensor, inv_perm: Tensor, valid: Tensor, weights: Tensor | None, top_k: int
) -> Tensor:
    """The experts' output rows put back in token order and summed with the routing weights, in
    one pass: ``out[t] = sum_k weights[t, k] * y[inv_perm[t * top_k + k]]`` over the pairs whose
    slot is below ``valid`` (transformers' ``weighted_out[inv_perm].view(T, K, H).sum(1)``).

    Args:
        y: ``(T * top_k, H)`` in expert order (the grouped GEMMs' output), a floating dtype.
        inv_perm: ``(T * top_k,)`` int64 from [`moe_sort`][]: pair ``p`` sits at slot
            ``inv_perm[p]``.
        valid: One-element int32 or int64 tensor on ``y``'s device, read there.
        weights: ``(T, top_k)`` routing weights of any floating dtype, or None (all 1).
        top_k: Experts per token.

    Returns:
        ``(T, H)`` of ``y``'s dtype: summed in float32 (float64 for float64) and rounded once.
        Differentiable with respect to ``y`` and ``weights`` (one backward pass computes both;
        the weights' gradient in their dtype).

    Other dtypes, devices and shapes compute the same in torch's ops (errors are torch's).
    """
    takes = (
        y.dtype in _FLOATS
        and y.dim() == 2
        and top_k >= 1
        and y.shape[0] % top_k == 0
        and _moe_indices_fit(inv_perm, valid, y.device, y.shape[0])
        and (
            weights is None
            or (
                weights.dtype in _FLOATS
                and weights.shape == (y.shape[0] // top_k, top_k)
                and weights.device == y.device
            )
        )
    )
    if not takes:
        return moe_unpermute_reference(y, inv_perm, valid, weights, top_k)
    return _moe.moe_unpermute(y, inv_perm, valid, weights, top_k)
