"""Routed-expert execution for N tokens at once, grouped by expert.

Each token picks its own top-k experts; the (token, slot) pairs are grouped by expert so every
selected expert's gate/up/down weights are dequantized and read once per pass, whatever N is. Each
product is computed row by row (`rowwise` products in engine.quant) and the k expert outputs of a
token are reduced in top-k slot order, so a pass over N tokens is bit-identical to N passes of one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.quant import QTensor
from engine.rowwise import rowwise_matmul


@dataclass
class ExpertWeights:
    gate: QTensor  # (E, F, d)
    up: QTensor  # (E, F, d)
    down: QTensor  # (E, d, F)


@dataclass
class RoutingStats:
    """Per-layer expert usage counts, accumulated across passes (the app's heat map on CPU runs)."""

    counts: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, layer: int, experts: torch.Tensor, n_expert: int) -> None:
        c = torch.bincount(experts.reshape(-1).cpu(), minlength=n_expert)
        if layer in self.counts:
            self.counts[layer] += c
        else:
            self.counts[layer] = c


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, top-k, renormalised (llama.cpp build_moe_ffn with norm_w, SOFTMAX)."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, k, dim=-1, sorted=True)
    return w / w.sum(dim=-1, keepdim=True), idx


def run_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    """y[t] = Σ_s w[t,s] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = idx[t,s], summed in slot order s."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tokens = order // k
    out = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    # One iteration per *selected* expert (≤ k for a single token): its weights are dequantized once
    # and applied to all of its tokens in one rowwise product.
    for e, c in zip(experts.tolist(), counts.tolist()):
        rows = order[start:start + c]
        xe = x[tokens[start:start + c]]
        h = F.silu(rowwise_matmul(xe, ew.gate[e])) * rowwise_matmul(xe, ew.up[e])
        out[rows] = rowwise_matmul(h, ew.down[e])
        start += c
    y = out.view(n, k, -1)
    acc = y[:, 0] * w[:, 0:1]
    for s in range(1, k):  # fixed slot order: identical sums whatever the grouping was
        acc = acc + y[:, s] * w[:, s:s + 1]
    return acc
