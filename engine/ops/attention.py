"""Causal attention of a pass's queries over the KV cache: one native call per layer and pass, or its torch twin.

Each (query, head) computes its scores, softmax and weighted sum over exactly the keys it sees, the same
operations whatever the number of queries or threads, so a verify pass gives each row the bits of a decode step.
A pass's positions are a `Positions`: known on the host (eager passes), or only on the device (a captured step,
engine.models.step_graph, replayed at every position), where the Triton kernel (engine.ops.triton_attention) reads
them itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.ops import native
from engine.ops.backend import Backend, OpEvent


@dataclass
class Positions:
    """Where a pass's n rows sit: pos … pos+n−1 with `start` = pos known on the host, or (start None) only as
    `rows` on the device, [n] int64, which a captured step's replays refill."""
    n: int
    start: int | None = None
    rows: torch.Tensor | None = None
    _on: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> torch.Tensor:
        """The positions as int64 [n] on `device` (made once per device)."""
        r = self._on.get(device)
        if r is None:
            if self.start is not None:
                r = torch.arange(self.start, self.start + self.n, device=device)
            else:
                assert self.rows is not None
                r = self.rows.to(device)
            self._on[device] = r
        return r


def rope_rows(tables: tuple[torch.Tensor, torch.Tensor], at: Positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the cos/sin tables [n_ctx, n_rot/2] at a pass's positions: a slice, or a gather on the device."""
    if at.start is not None:
        return tables[0][at.start:at.start + at.n], tables[1][at.start:at.start + at.n]
    rows = at.on(tables[0].device)
    return tables[0].index_select(0, rows), tables[1].index_select(0, rows)


def kv_write(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: Positions) -> None:
    """A pass's keys and values into the cache rows of its positions."""
    if at.start is not None:
        cache_k[at.start:at.start + at.n] = k
        cache_v[at.start:at.start + at.n] = v
    else:
        rows = at.on(cache_k.device)
        cache_k.index_copy_(0, rows, k.to(cache_k.dtype))
        cache_v.index_copy_(0, rows, v.to(cache_v.dtype))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int | Positions, scale: float,
              backend: Backend) -> torch.Tensor:
    """Queries q [n, H, D] at positions pos…pos+n−1 over the cache rows k [≥ pos + n, H_kv, D], v [·, H_kv, D_v]
    (query head h reads KV head h // (H / H_kv)): out [n, H·D_v]. On the Triton backend one kernel over positions on
    the device (whether or not the host knows them: the same bits either way); elsewhere the host's start."""
    at = pos if isinstance(pos, Positions) else Positions(q.shape[0], pos)
    if backend.observer is None:
        return _attention(q, k, v, at, scale, backend)
    t0 = time.perf_counter()
    out = _attention(q, k, v, at, scale, backend)
    backend.observer(OpEvent("attention", 0, q.shape[0], time.perf_counter() - t0))
    return out


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: Positions, scale: float,
               backend: Backend) -> torch.Tensor:
    if backend.kind == "triton" and _triton_floats(q, k, v):
        from engine.ops import triton_attention

        return triton_attention.attention_rows(q, k, v, at.on(q.device), scale)
    if at.start is None:
        raise ValueError("attention at positions known only on the device runs on the Triton backend")
    pos = at.start
    if backend.native and _floats(q, k, v) and k.is_contiguous() and v.is_contiguous():
        n, h, dk = q.shape
        work = n * h * (pos + n) * (dk + v.shape[2])
        return native.attention(q, k, v, pos, scale, backend.n_threads(work), backend.level)
    return attention_torch(q, k, v, pos, scale)


def _triton_floats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """What the Triton kernel takes: float32 cache rows, contiguous, without autograd, beside the queries."""
    return all(t.dtype is torch.float32 and not t.requires_grad and t.device == q.device for t in (q, k, v)) \
        and k.is_contiguous() and v.is_contiguous()


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
