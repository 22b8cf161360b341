"""Training forms of the inference layers: the same math on float parameters, differentiable, and over several
independent sequences in one pass. `ModelParams.build` swaps them into a model built by engine.models.build, so
training runs the inference layers' weights and hooks; no inference module imports this one."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine import ops
from engine.cache import CapturedStates, GDNState, KVLayer
from engine.models.qwen35 import GatedAttention, GatedDeltaNet, Hook, MoE, Qwen35Model
from engine.ops.experts import reduce_slots
from engine.ops.norms import l2_norm_torch as l2_norm, rms_norm_torch as rms_norm


class TrainingAttention(GatedAttention):
    """Whole sequences from position 0 without a cache: one causal SDPA call instead of per-query steps."""

    def __init__(self, layer: GatedAttention, n_seq: int):
        super().__init__(layer.hp, layer.w, layer.il, layer.backend)
        self.n_seq = n_seq  # the pass holds this many independent sequences of equal length

    def __call__(self, x: torch.Tensor, kv: KVLayer, at: ops.Positions, rope: tuple[torch.Tensor, torch.Tensor],
                 cb: Hook) -> torch.Tensor:
        assert at.start == 0, "training runs whole sequences"
        hp, n, B = self.hp, x.shape[0], self.n_seq
        q, k, v, gate = self.qkv(x, at, rope, cb)
        qb, kb, vb = (t.view(B, n // B, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.scale, enable_gqa=True)
        out = o.transpose(1, 2).reshape(n, hp.n_head * hp.head_dim_v) * torch.sigmoid(gate)
        return ops.linear(out, self.w.o)


class TrainingDeltaNet(GatedDeltaNet):
    """The chunk-parallel delta rule with a chunk of the trainer's choosing; B > 1 independent sequences run as
    extra heads of one chunked pass, each from a zero state."""

    def __init__(self, layer: GatedDeltaNet, n_seq: int, chunk: int):
        super().__init__(layer.hp, layer.w, layer.il, layer.backend, chunk)
        self.n_seq = n_seq

    def __call__(self, x: torch.Tensor, st: GDNState, cb: Hook, capture: CapturedStates | None,
                 chunked: bool) -> torch.Tensor:
        if self.n_seq == 1:
            return super().__call__(x, st, cb, capture, chunked)
        hp, w, il, B = self.hp, self.w, self.il, self.n_seq
        Hk, Hv, dk, dv, K = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim, hp.ssm_conv_kernel
        mixed, z, b, a = ops.linear_many(x, (w.qkv, w.gate, w.beta, w.alpha))
        n, C = mixed.shape
        T = n // B
        window = F.pad(mixed.view(B, T, C), (0, 0, K - 1, 0))  # zero conv state before each sequence
        taps = self.taps()
        conv = window[:, 0:T] * taps[0]
        for j in range(1, K):
            conv = conv + window[:, j:j + T] * taps[j]
        u = F.silu(conv).view(n, C)
        cb("conv_output_silu", il, u)
        q = l2_norm(u[:, :Hk * dk].reshape(n, Hk, dk), hp.rms_eps) * (1.0 / math.sqrt(dk))
        k = l2_norm(u[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk), hp.rms_eps)
        v = u[:, 2 * Hk * dk:].reshape(n, Hv, dv)
        q, k = ops.tiled(q, k, Hv)
        beta = torch.sigmoid(b)
        g = w.a * F.softplus(a + w.dt_bias)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B·T, Hv, ·] → [T, B·Hv, ·]
            return t.view(B, T, Hv, -1).transpose(0, 1).reshape(T, B * Hv, t.shape[-1])

        S0 = torch.zeros(B * Hv, dk, dv, dtype=mixed.dtype, device=mixed.device)
        o, _ = ops.delta_rule_chunked(heads(q), heads(k), heads(v), heads(beta[..., None])[..., 0],
                                      heads(g[..., None])[..., 0], S0, self.chunk)
        o = o.view(T, B, Hv, dv).transpose(0, 1).reshape(n, Hv, dv)
        cb("attn_output", il, o)
        o = rms_norm(o, w.norm, hp.rms_eps) * F.silu(z.view(n, Hv, dv))
        return ops.linear(o.reshape(n, Hv * dv), w.out)


class TrainingMoE(MoE):
    """Routed experts over float parameters: grouped plain matmuls on the CPU, every expert on every token on an
    accelerator (the same sum)."""

    def __init__(self, layer: MoE):
        super().__init__(layer.hp, layer.w, layer.il, layer.stats)

    def experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                shared_gate: torch.Tensor | None) -> torch.Tensor:
        ex = self.w.experts
        if x.device.type != "cpu":
            return run_experts_dense(x, idx, weights, ex.gate, ex.up, ex.down)  # type: ignore[arg-type]
        return run_experts_float(x, idx, weights, ex.gate, ex.up, ex.down)  # type: ignore[arg-type]


def run_experts_float(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor) -> torch.Tensor:
    """The experts' grouped sum with plain matmuls per expert (autograd), reduced in slot order."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tokens = order // k
    parts, start = [], 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        xe = x[tokens[start:start + c]]
        h = F.silu(xe @ gate[e].t()) * (xe @ up[e].t())
        parts.append(h @ down[e].t())
        start += c
    out = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
    out = out.index_put((order,), torch.cat(parts))
    return reduce_slots(out.view(n, k, -1), w)


def run_experts_dense(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor) -> torch.Tensor:
    """Training on an accelerator: every expert on every token in three large products, each expert's output
    weighted by its routing weight (zero when not selected) — the same sum as the grouped path, in a few
    kernels instead of a loop over experts, which on a GPU costs less than the launches it saves."""
    n, e_all = x.shape[0], gate.shape[0]
    route_w = torch.zeros(n, e_all, dtype=x.dtype, device=x.device).scatter(1, idx, w.to(x.dtype))
    h = F.silu(torch.einsum("nd,efd->enf", x, gate)) * torch.einsum("nd,efd->enf", x, up)
    h = h * route_w.t()[:, :, None]
    return torch.einsum("enf,edf->nd", h, down)


def for_training(model: Qwen35Model, n_seq: int = 1, gdn_chunk: int = 64) -> Qwen35Model:
    """Swap the training forms into a model built over float parameters (its MTP block too)."""
    for layer in model.layers + ([model.mtp.layer] if model.mtp is not None else []):
        if isinstance(layer.mixer, GatedAttention):
            layer.mixer = TrainingAttention(layer.mixer, n_seq)
        else:
            layer.mixer = TrainingDeltaNet(layer.mixer, n_seq, gdn_chunk)
        if isinstance(layer.ffn, MoE):
            layer.ffn = TrainingMoE(layer.ffn)
    return model
