"""Routed experts for N tokens at once, and the MoE layer around them.

Each token picks its own top-k experts (`route`, `moe_route`); the (token, slot) pairs are grouped by expert so every
selected expert's gate/up/down weights are read once per pass, whatever N is (`moe_experts`), by the products its
experts were bound to when the model was built (`bind_experts`, engine.ops.experts_bound: the native kernels, Triton's
on CUDA, torch integer Q8_0 products, dequantized weights; an expert cache's slots on an accelerator). Every product is
one independent row product (as in engine.ops.linear) and the k expert outputs of a token are reduced in top-k slot
order, so a pass over N tokens is bit-identical to N passes of one. `moe_ffn` runs a whole layer in one native call
where its experts allow it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGMLQuantizationType as QT

from engine.ops import native
from engine.ops.backend import OpEvent
from engine.ops.delta_rule import pointwise
from engine.ops.experts_bound import Experts, Shared, bind_experts, float32_weight
from engine.ops.experts_pairs import reduce_slots
from engine.ops.linear import Linear
from engine.ops.linear import linear as ops_linear
from engine.storage.qtensor import QTensor

__all__ = ["Experts", "MoEOut", "Shared", "bind_experts", "moe_experts", "moe_ffn", "moe_route", "reduce_slots",
           "route"]


@dataclass(frozen=True)
class MoEOut:
    """A MoE layer's output and its routing: y [n, d], router logits [n, E], top-k weights and ids [n, k]."""

    y: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor
    idx: torch.Tensor


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top-k, renormalised (llama.cpp build_moe_ffn with norm_w, SOFTMAX): the torch form."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, k, dim=-1, sorted=True)
    return w / w.sum(dim=-1, keepdim=True), idx


def moe_route(x: torch.Tensor, router: Linear, shared_inp: Linear | None, k: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A MoE layer's routing: router logits [n, E], top-k weights and ids [n, k], and the shared expert's gate
    sigmoid(gate input · x) [n, 1] (None without one). Natively (moe.c moe_route, the routing moe_ffn's one call
    runs, so the op-by-op layer routes with its bits) where the router and gate input are float32 on a native
    backend's CPU; else the router's product, `route` and a sigmoid in torch."""
    rw = float32_weight(router)
    si = float32_weight(shared_inp) if shared_inp is not None else None
    if router.backend.native and rw is not None and rw.shape[0] <= native.MAX_EXPERTS and (shared_inp is None or si is not None) \
            and x.is_cpu and x.dtype is torch.float32 and not x.requires_grad:
        return native.moe_route(rw, si.reshape(-1) if si is not None else None, x.contiguous(), k,
                                router.backend.n_threads(x.shape[0] * router.n_rows * router.n_cols))
    gates = _triton_gates(router, shared_inp)
    if gates is not None:
        from engine.ops import triton_route

        return triton_route.route(x, gates, router.n_rows, k)
    logits = ops_linear(x, router)
    weights, idx = route(logits, k)
    sgate = pointwise(torch.sigmoid, ops_linear(x, shared_inp)) if shared_inp is not None else None
    return logits, weights, idx, sgate


def _triton_gates(router: Linear, shared_inp: Linear | None) -> torch.Tensor | None:
    """The float32 router's rows with the shared gate input's stacked (made once, kept with the router) where the
    routing runs in engine.ops.triton_route's kernels: the Triton backend, float32 weights on one device."""
    parts = (router,) if shared_inp is None else (router, shared_inp)
    if router.backend.kind != "triton" or router.backend.observer is not None or any(
            not isinstance(p.weight, QTensor) or p.weight.qtype != QT.F32 or p.weight.raw.device != router.weight.raw.device
            for p in parts):
        return None
    key = ("gates", id(shared_inp))
    if key not in router.forms:
        from engine.ops import triton_route

        rows = [p.weight.raw.view(torch.float32).view(p.n_rows, p.n_cols) for p in parts]  # type: ignore[union-attr]
        router.forms[key] = triton_route.gate_matrix(rows[0], rows[1] if len(rows) > 1 else None)
    return router.forms[key]


def moe_ffn(x: torch.Tensor, router: Linear, ex: Experts, shared: Shared | None, k: int,
            twin: Callable[[torch.Tensor], MoEOut]) -> MoEOut:
    """A whole MoE layer: routing (softmax over the router's logits, top k, renormalised), the routed experts and
    the shared expert weighted by sigmoid(gate input · x). In one native call (engine/native/moe.c moe_layer) where
    the backend runs every piece of it (native routed experts without an expert cache, float32 router and shared
    gate input, a native shared expert); else `twin(x)`, the model's description of the same math in ops calls.
    The choice is made once per layer."""
    one = ex.one_call(router, shared)
    if one is None:
        return twin(x)
    obs = ex.backend.observer
    t0 = time.perf_counter() if obs is not None else 0.0
    xc = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    threads = ex.backend.n_threads(x.shape[0] * k * ex.expert_bytes())
    for st in (*one.stacks, *one.shared):
        st.threads = threads
    y, logits, wts, idx = native.moe_layer(one.router, one.shared_inp, one.shared or None, one.stacks, xc, k,
                                           ex.backend.level)
    if obs is not None:
        distinct = int(torch.unique(idx).numel())
        obs(OpEvent("moe_experts", ex.expert_bytes() * distinct + one.nbytes, x.shape[0],
                    time.perf_counter() - t0, distinct))
    return MoEOut(y, logits, wts, idx)


def moe_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ex: Experts,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = Σ_s w[t,s] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = idx[t,s], summed in slot order s; with
    `shared_gate` [N, 1] (when `ex.runs_shared`), y also holds the shared expert weighted by it."""
    if shared_gate is not None and not ex.runs_shared:
        raise ValueError("the shared expert runs with the routed ones only on the torch integer CPU path")
    obs = ex.backend.observer
    if obs is None:
        return ex.run(x, idx, w, shared_gate)
    distinct = int(torch.unique(idx).numel())
    t0 = time.perf_counter()
    y = ex.run(x, idx, w, shared_gate)
    obs(OpEvent("moe_experts", ex.expert_bytes() * distinct, x.shape[0], time.perf_counter() - t0, distinct))
    return y
