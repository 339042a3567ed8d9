"""A stand-in for ``quack.gemm_interface`` (quack's GEMMs) in eager PyTorch, for CPU tests.

It implements the entry point torchgraft calls, the GEMM runner ``gemm_tuned.fn`` under quack's
autotuner, for the varlen cases with quack's conventions: an explicit ``config``;
``cu_seqlens_m`` / ``cu_seqlens_k`` int32 with a leading zero; a preallocated ``out`` written in
place; rows past the last offset left alone (varlen M); an empty group's product written as
zeros (varlen K). ``CALLS`` records each call's kind and operand strides.
"""

import itertools

import torch

CALLS: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []


def gemm(A, B, out, *, cu_seqlens_m=None, cu_seqlens_k=None, config=None, **unused):
    assert config == "sm90 default" and not unused
    assert (cu_seqlens_m is None) != (cu_seqlens_k is None)
    cu = cu_seqlens_m if cu_seqlens_m is not None else cu_seqlens_k
    assert cu.dtype == torch.int32 and int(cu[0]) == 0
    bounds = cu.tolist()
    a, b = A.float(), B.float()
    if cu_seqlens_m is not None:
        CALLS.append(("varlen_m", A.stride(), B.stride()))
        for group, (start, end) in enumerate(itertools.pairwise(bounds)):
            out[start:end] = (a[start:end] @ b[group]).to(out.dtype)
    else:
        CALLS.append(("varlen_k", A.stride(), B.stride()))
        for group, (start, end) in enumerate(itertools.pairwise(bounds)):
            out[group] = (a[:, start:end] @ b[start:end]).to(out.dtype)
    return out


class _Autotuned:
    """quack's autotuner object: ``fn`` is the function under it."""

    fn = staticmethod(lambda *args, **kwargs: gemm(*args, **kwargs))


gemm_tuned = _Autotuned()
