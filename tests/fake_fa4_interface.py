"""A stand-in for ``flash_attn.cute.interface`` (FA4) in eager PyTorch, for CPU tests.

It implements the two entry points torchgraft calls, with FA4's conventions and the checks
FA4 makes: ``(batch, seq, heads, dim)`` tensors with a contiguous last dim, grouped key/value
heads, a bottom-right causal mask, a float32 natural-log ``lse`` of shape
``(batch, heads, seq_q)``, an optional preallocated ``out``. The backward uses the ``lse`` it
is given (as FA4 does), so a wrong ``lse`` gives wrong gradients. ``CALLS`` counts the calls.
"""

import math

import torch

CALLS = {"fwd": 0, "bwd": 0}


def _scores(q, k, scale, causal):
    sq, h = q.shape[1], q.shape[2]
    group = h // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        sk = kf.shape[2]
        i = torch.arange(sq).view(-1, 1)
        j = torch.arange(sk).view(1, -1)
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    return s


def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, return_lse=False, out=None, **kw):
    assert not kw, kw
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "last dim must be contiguous"
    b, sq, h, d = q.shape
    assert q.shape[2] % k.shape[2] == 0 and k.shape == v.shape[:3] + k.shape[3:]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    vf = v.float().repeat_interleave(h // v.shape[2], dim=2).transpose(1, 2)
    o = (torch.softmax(s, dim=-1) @ vf).transpose(1, 2)
    if out is None:
        out = torch.empty(b, sq, h, v.shape[3], dtype=q.dtype, device=q.device)
    assert out.shape == (b, sq, h, v.shape[3]) and out.stride(-1) == 1
    out.copy_(o)
    CALLS["fwd"] += 1
    return out, lse.contiguous(), None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, **kw):
    assert set(kw) <= {"deterministic"}, kw
    b, sq, h, d = q.shape
    assert out.shape == (b, sq, h, v.shape[3]) and dout.shape == out.shape
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    group = h // k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    s = _scores(q, k, scale, causal)
    p = torch.exp(s - lse.unsqueeze(-1))
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    do = dout.float().transpose(1, 2)
    o = out.float().transpose(1, 2)
    dv = p.transpose(-1, -2) @ do
    dp = do @ vf.transpose(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ qf * scale

    def fold(t):  # sum each group of query heads into its key/value head
        t = t.transpose(1, 2)
        return t.reshape(b, t.shape[1], h // group, group, t.shape[3]).sum(3)

    CALLS["bwd"] += 1
    return (
        dq.transpose(1, 2).to(q.dtype).contiguous(),
        fold(dk).to(k.dtype).contiguous(),
        fold(dv).to(v.dtype).contiguous(),
    )
