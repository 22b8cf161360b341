"""A MoE layer's routing on CUDA in two Triton launches, where torch takes about ten (a float32 GEMV with split-K,
softmax, top-k's gather and sort, the renormalising sum and division, the shared expert gate's product and sigmoid).

  - `_gate_logits`: logits[t, e] = G[e] · x[t] for the float32 router with the shared expert's gate input as one
    more row (stacked once per layer), BE rows a program, the row read in 256-value tiles in order.
  - `_top_k`: one program a token: softmax over the experts, the k largest probabilities in descending order (ties:
    the lower id, as an argmax finds it), renormalised to sum 1, and sigmoid of the gate input's logit.
A token's arithmetic does not depend on the other rows of the pass (batch invariance). Imported only where
engine.ops.triton_q is (CUDA, or the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BE = 16  # router rows a program of _gate_logits
BK = 256  # values of a row per step


@triton.jit
def _gate_logits(w_ptr, x_ptr, y_ptr, n_rows, d, x_stride, y_stride, BE: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.program_id(1)
    rows = pid * BE + tl.arange(0, BE)
    rmask = rows < n_rows
    cols = tl.arange(0, BK)
    acc = tl.zeros([BE, BK], dtype=tl.float32)
    for k0 in range(0, d, BK):
        m = k0 + cols < d
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * d + k0 + cols[None, :], mask=rmask[:, None] & m[None, :],
                    other=0.0)
        x = tl.load(x_ptr + t * x_stride + k0 + cols, mask=m, other=0.0)
        acc += w * x[None, :]
    tl.store(y_ptr + t * y_stride + rows, tl.sum(acc, axis=1), mask=rmask)


@triton.jit
def _top_k(l_ptr, w_ptr, i_ptr, g_ptr, n_expert, l_stride, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
           HAS_GATE: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK)
    m = e < n_expert
    logit = tl.load(l_ptr + t * l_stride + e, mask=m, other=-float("inf"))
    z = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(m, z / tl.sum(z, axis=0), -1.0)
    slot = tl.arange(0, KP)
    ws = tl.zeros([KP], dtype=tl.float32)
    ids = tl.zeros([KP], dtype=tl.int64)
    for j in tl.static_range(K):  # the largest left, then taken out
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, e, BLOCK), axis=0)
        ws = tl.where(slot == j, best, ws)
        ids = tl.where(slot == j, at.to(tl.int64), ids)
        p = tl.where(e == at, -1.0, p)
    tl.store(w_ptr + t * K + slot, ws / tl.sum(ws, axis=0), mask=slot < K)
    tl.store(i_ptr + t * K + slot, ids, mask=slot < K)
    if HAS_GATE:
        s = tl.load(l_ptr + t * l_stride + n_expert)
        tl.store(g_ptr + t, 1.0 / (1.0 + tl.exp(-s)))


def gate_matrix(router: torch.Tensor, shared_inp: torch.Tensor | None) -> torch.Tensor:
    """The router's rows [E, d] and the shared expert's gate input row [1, d] stacked, float32, contiguous."""
    rows = router if shared_inp is None else torch.cat([router, shared_inp.reshape(1, -1)])
    return rows.float().contiguous()


def route(x: torch.Tensor, gates: torch.Tensor, n_expert: int, k: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Router logits [n, E], top-k weights (renormalised) and ids [n, k], and the shared gate sigmoid [n, 1] (None
    when `gates` holds only the router's E rows), for x [n, d]."""
    n, d = x.shape
    rows = gates.shape[0]
    xc = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    logits = torch.empty(n, rows, dtype=torch.float32, device=x.device)
    _gate_logits[(triton.cdiv(rows, BE), n)](gates, xc, logits, rows, d, xc.stride(0), logits.stride(0), BE=BE, BK=BK)
    w = torch.empty(n, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(n, k, dtype=torch.long, device=x.device)
    has_gate = rows > n_expert
    g = torch.empty(n, 1, dtype=torch.float32, device=x.device) if has_gate else w
    _top_k[(n,)](logits, w, idx, g, n_expert, logits.stride(0), K=k, KP=triton.next_power_of_2(k), BLOCK=triton.next_power_of_2(n_expert),
                 HAS_GATE=has_gate)
    return logits[:, :n_expert], w, idx, (g if has_gate else None)


def signatures() -> list[tuple[object, dict[str, str], dict[str, int], str]]:
    """Launch forms for the ahead-of-time build: the 35B-A3B's 256 experts (and 128, 512), top 8."""
    logits = {"w_ptr": "*fp32", "x_ptr": "*fp32", "y_ptr": "*fp32", "n_rows": "i32", "d": "i32", "x_stride": "i64",
              "y_stride": "i64", "BE": "constexpr", "BK": "constexpr"}
    top = {"l_ptr": "*fp32", "w_ptr": "*fp32", "i_ptr": "*i64", "g_ptr": "*fp32", "n_expert": "i32",
           "l_stride": "i64", "K": "constexpr", "KP": "constexpr", "BLOCK": "constexpr", "HAS_GATE": "constexpr"}
    return [(_gate_logits, logits, {"BE": BE, "BK": BK}, "f32")] + [
        (_top_k, top, {"K": 8, "KP": 8, "BLOCK": b, "HAS_GATE": True}, f"{b}x8") for b in (128, 256, 512)]
