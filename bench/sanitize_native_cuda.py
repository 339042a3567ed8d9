"""Drive every path of the native CUDA grafts once, for compute-sanitizer (memcheck, racecheck).

Forward and backward through torchgraft's CUDA kernels over dtypes, widths (vectorized and
scalar paths, non-powers of two), weights (none, same dtype, float32 under a half input),
output masks, layouts and empty inputs; then torchgraft::rms_norm and its backward in each
weight mode (offset 0 and 1, rounding before the weight or not). Each result is checked
against a float64 reference, so the run fails on a wrong value as well as on a sanitizer
report. Run it under the sanitizer with PyTorch's caching allocator off, so that every tensor is
its own allocation and an access past its end is caught:

    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    compute-sanitizer --tool memcheck  --error-exitcode 9 python bench/sanitize_native_cuda.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python bench/sanitize_native_cuda.py
"""

from __future__ import annotations

import itertools
import sys

import torch

import torchgraft

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 4e-3}
SHAPES = [(1, 1), (3, 7), (5, 64), (4, 1000), (2, 4096), (3, 8191), (0, 64), (6, 0), (2, 3, 96)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.cpu().double(), ref.cpu().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def reference(x, w, eps):
    """float64 RMSNorm on the CPU (so the sanitizer watches torchgraft's kernels, not these)."""
    x64 = x.cpu().double()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.cpu().double()


def cuda_randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64).to(dtype).cuda()


def run_case(shape, dtype, weight, mask, transposed) -> None:
    cols = shape[-1]
    x = cuda_randn(*shape, dtype=dtype)
    if transposed and len(shape) == 2 and shape[0] > 1:
        x = x.t().contiguous().t()  # a column-major view
    w = None
    if weight == "same":
        w = cuda_randn(cols, dtype=dtype)
    elif weight == "float32":
        w = cuda_randn(cols, dtype=torch.float32)
    y, rstd = torch.ops.aten._fused_rms_norm(x, [cols], w, 1e-5)
    dy = cuda_randn(*y.shape, dtype=dtype)
    dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, [cols], rstd, w, list(mask))
    torch.cuda.synchronize()
    if x.numel() == 0:
        return
    tol = TOL[dtype]
    if rel_err(y, reference(x, w, 1e-5)) > tol:
        raise AssertionError(f"forward {shape} {dtype} {weight}")
    x64 = x.cpu().double().requires_grad_()
    w64 = None if w is None else w.cpu().double().requires_grad_()
    ref = reference(x64, w64, 1e-5)
    wanted = [t for t in (x64, w64) if t is not None]
    grads = torch.autograd.grad(ref, wanted, dy.cpu().double())
    # dx = rstd * (g - xhat * mean(g * xhat)) cancels (e.g. to ~eps for one column): measure its
    # error against the size of its terms, rstd * g, too.
    g = dy.cpu().double() * (1.0 if w64 is None else w64.detach())
    terms = (g * rstd.cpu().double()).norm()
    if (
        mask[0]
        and float((dx.cpu().double() - grads[0]).norm() / (grads[0].norm() + terms)) > 4 * tol
    ):
        raise AssertionError(f"dx {shape} {dtype} {weight}")
    if mask[1] and w is not None and rel_err(dw, grads[1]) > 4 * tol:
        raise AssertionError(f"dw {shape} {dtype} {weight}")


def run_op_case(shape, dtype, wdtype, offset, cast) -> None:
    """torchgraft::rms_norm (forward and backward ops) in one weight mode."""
    from torchgraft.ops.rms_norm.reference import rms_norm_reference

    cols = shape[-1]
    x = cuda_randn(*shape, dtype=dtype)
    w = cuda_randn(cols, dtype=wdtype)
    y, rstd = torch.ops.torchgraft.rms_norm(x, w, 1e-5, offset, cast)
    dy = cuda_randn(*y.shape, dtype=dtype)
    dx, dw = torch.ops.torchgraft.rms_norm_backward(dy, x, rstd, w, offset, cast, [True, True])
    torch.cuda.synchronize()
    if x.numel() == 0:
        return
    x64 = x.cpu().double().requires_grad_()
    w64 = w.cpu().double().requires_grad_()
    ref = rms_norm_reference(x64, w64, 1e-5, offset, cast)
    gx, gw = torch.autograd.grad(ref, (x64, w64), dy.cpu().double())
    # dx cancels in short rows (one column: dx ~ 0): measured against its terms' size.
    x64 = x64.detach()
    terms = (
        dy.cpu().double()
        * (w64.detach() + offset)
        * torch.rsqrt(x64.square().mean(-1) + 1e-5)[..., None]
    )
    dx_err = float((dx.cpu().double() - gx).norm() / max(gx.norm(), terms.norm()))
    errors = {"y": rel_err(y, ref.detach()), "dx": dx_err, "dw": rel_err(dw, gw)}
    for what, err in errors.items():
        if err > 8 * max(TOL[dtype], TOL[wdtype]):
            raise AssertionError(f"rms_norm {what} {shape} {dtype} {wdtype} {offset} {cast}")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torchgraft.enable(routes=["native"])
    cases = 0
    for shape, dtype, weight, mask, transposed in itertools.product(
        SHAPES,
        DTYPES,
        ["none", "same", "float32"],
        [(True, True), (True, False), (False, True)],
        [False, True],
    ):
        if weight == "float32" and dtype in (torch.float32, torch.float64):
            continue
        run_case(shape, dtype, weight, mask, transposed)
        cases += 1
    stats = torchgraft.stats()
    calls = stats["native/aten::_fused_rms_norm/CUDA"]["calls"]
    if calls != cases:
        raise AssertionError(f"the CUDA graft ran {calls} times for {cases} cases")
    from torchgraft import functional  # noqa: F401  (defines torchgraft::rms_norm)

    for shape, dtype, offset, cast in itertools.product(SHAPES, DTYPES, [0.0, 1.0], [False, True]):
        for wdtype in dict.fromkeys([dtype, torch.float32]):
            if cast and torch.promote_types(dtype, wdtype) != dtype:
                continue  # the op refuses it (functional.rms_norm computes it in two steps)
            run_op_case(shape, dtype, wdtype, offset, cast)
            cases += 1
    print(f"{cases} cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
