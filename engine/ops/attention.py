"""Causal attention of a pass's queries over the KV cache: one native call per layer and pass, or its torch twin.

Each (query, head) computes its scores, softmax and weighted sum over exactly the keys it sees, the same
operations whatever the number of queries or threads, so a verify pass gives each row the bits of a decode step.
"""
from __future__ import annotations

import time

import torch

from engine.ops import native
from engine.ops.backend import Backend, OpEvent


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float,
              backend: Backend) -> torch.Tensor:
    """Queries q [n, H, D] at positions pos…pos+n−1 over the cache rows k [≥ pos + n, H_kv, D], v [·, H_kv, D_v]
    (query head h reads KV head h // (H / H_kv)): out [n, H·D_v]."""
    if backend.observer is None:
        return _attention(q, k, v, pos, scale, backend)
    t0 = time.perf_counter()
    out = _attention(q, k, v, pos, scale, backend)
    backend.observer(OpEvent("attention", 0, q.shape[0], time.perf_counter() - t0))
    return out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float,
               backend: Backend) -> torch.Tensor:
    if backend.native and _floats(q, k, v) and k.is_contiguous() and v.is_contiguous():
        n, h, dk = q.shape
        work = n * h * (pos + n) * (dk + v.shape[2])
        return native.attention(q, k, v, pos, scale, backend.n_threads(work), backend.level)
    return attention_torch(q, k, v, pos, scale)


def _floats(*ts: torch.Tensor) -> bool:
    """float32 on the CPU, no autograd: what the native float kernels take."""
    return all(t.is_cpu and t.dtype is torch.float32 and not t.requires_grad for t in ts)


def attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    """The torch twin. One query at a time over exactly the keys it sees: the same ops whether the pass has 1 or N
    tokens (a masked batch would change reduction lengths and so the rounding)."""
    n, n_head, d = q.shape
    n_kv, dv = v.shape[1], v.shape[2]
    group = n_head // n_kv
    out = torch.empty(n, n_head * dv, dtype=q.dtype, device=q.device)
    keys = k[:pos + n].permute(1, 2, 0)  # [H_kv, D, t]
    vals = v[:pos + n].transpose(0, 1)  # [H_kv, t, Dv]
    rows = zip(q.reshape(n, n_kv, group, d).unbind(0), out.view(n, n_kv, group, dv).unbind(0))
    for i, (qi, oi) in enumerate(rows):
        t = pos + i + 1
        probs = torch.softmax(torch.bmm(qi, keys[:, :, :t]) * scale, dim=-1)
        torch.bmm(probs, vals[:, :t], out=oi)
    return out
