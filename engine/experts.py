"""Routed-expert execution for N tokens at once, grouped by expert.

Each token picks its own top-k experts; the (token, slot) pairs are grouped by expert so every
selected expert's gate/up/down weights are read once per pass, whatever N is: by the native K-quant
kernels (one call per projection for all pairs), by the Q8_0 integer products, or gathered and
dequantized (one kernel call for a whole group of experts). Every product is one independent [1, in] × [in, out]
row product (as in engine.rowwise) and the k expert outputs of a token are reduced in top-k slot
order, so a pass over N tokens is bit-identical to N passes of one.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.expert_cache import ExpertCache
from engine import kquant, nativelib, q8dot
from engine.quant import QTensor
from engine.rowwise import Weight, round_activations


@dataclass
class ExpertWeights:
    gate: Weight  # (E, F, d)
    up: Weight  # (E, F, d)
    down: Weight  # (E, d, F)


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


# Dequantized expert weights handled at once per projection: bounds memory on big models (a 35B
# expert is 1M values per projection) while a decode step's k experts take one kernel call.
GROUP_ELEMENTS = 1 << 23


def gather_experts(w: Weight, experts: list[int]) -> torch.Tensor:
    """Float weights [U, rows, cols] of the listed experts: one gather of their blocks, one dequant call."""
    if isinstance(w, torch.Tensor):
        return w[torch.tensor(experts, dtype=torch.long, device=w.device)]
    e_all = w.shape[0]
    rows = w.n_rows // e_all
    sel = torch.tensor(experts, dtype=torch.long, device=w.raw.device)
    raw = w.raw.view(e_all, rows, -1).index_select(0, sel).reshape(len(experts) * rows, -1)
    return QTensor(raw, w.qtype, (len(experts) * rows, w.n_cols)).dequantize().view(len(experts), rows, w.n_cols)


def _bmm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, 1, in] × w [B, out, in]ᵀ → [B, out]: one independent row product per batch item."""
    return torch.bmm(x, w.transpose(1, 2)).squeeze(1)


@dataclass
class SharedExpert:
    """The shared expert run inside the routed experts' products (q8dot.expert_planes): `slices` extra experts
    every token selects, each weighted by the token's shared-expert gate σ(w_gate · x) [N, 1]."""

    weights: tuple[QTensor, QTensor, QTensor]  # gate, up, down
    slices: int
    gate: torch.Tensor


def run_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ew: ExpertWeights,
                cache: ExpertCache | None = None, shared: SharedExpert | None = None) -> torch.Tensor:
    """y[t] = Σ_s w[t,s] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = idx[t,s], summed in slot order s.

    Experts run where their bytes are: on x's device when resident there, on the CPU when they live on
    the CPU (x's rows are moved, not the weights), or from `cache` slots on the accelerator for cached
    experts. Each (token, slot) product is independent, so splitting the experts between devices does not
    change which bits a device computes. `shared` (Q8_0 on the CPU, no cache): the shared expert's slices
    run as extra slots after the top-k, so y also holds the gated shared expert."""
    kq = all(kquant.usable(t, x) for t in (ew.gate, ew.up, ew.down))
    q8 = not kq and all(q8dot.usable(t, x) for t in (ew.gate, ew.up, ew.down))
    if shared is not None and not (q8 and cache is None):
        raise ValueError("the shared expert runs with the routed ones only on the torch integer CPU path")
    if q8 and cache is None:  # the common CPU case without the native library, without a device split
        if shared is not None:
            n, e_all, s_n = idx.shape[0], ew.gate.shape[0], shared.slices
            idx = torch.cat([idx, q8dot.ARANGE[e_all:e_all + s_n].expand(n, s_n)], 1)
            w = torch.cat([w, shared.gate.expand(n, s_n)], 1)
        planes = q8dot.expert_planes(ew.gate, ew.up, ew.down, shared.weights if shared else None)  # type: ignore[arg-type]
        if idx.shape[0] == 1:  # one token (a decode step, a draft): its experts are distinct, nothing to group
            return _one_token(x, idx[0], w, planes)
    n, k = idx.shape
    if kq and cache is None and n == 1:  # one token: the slots are the pairs, in expert groups of one
        out = torch.empty(k, x.shape[1])
        _KQGrouped(x, _ZEROS[:k], q8dot.ARANGE[:k], q8dot.ARANGE[:k + 1], out).run(
            (ew.gate, ew.up, ew.down), idx[0])  # type: ignore[arg-type]
        return _reduce_slots(out.view(1, k, -1), w)
    starts = None
    if nativelib.available() and idx.device.type == "cpu" and idx.dtype == torch.long:
        g = nativelib.group_pairs(idx, ew.gate.shape[0] + (shared.slices if shared else 0))
        order, tokens, experts, counts, starts = g.order, g.tokens, g.experts, g.counts, g.starts
    else:
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        tokens = order // k
    if kq and cache is None:
        out = torch.empty(n * k, x.shape[1])
        _KQGrouped(x, tokens, order, starts, out).run((ew.gate, ew.up, ew.down), experts)  # type: ignore[arg-type]
        return _reduce_slots(out.view(n, k, -1), w)
    out = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
    if isinstance(ew.gate, torch.Tensor):
        if x.device.type != "cpu":
            return _run_experts_dense(x, idx, w, ew)
        return _run_experts_float(x, idx, w, ew, order, experts, counts, tokens)
    if q8 and cache is None:
        local = torch.repeat_interleave(torch.arange(experts.numel()), counts)
        gate_up, down = q8dot.select(*planes, experts)
        out[order] = q8dot.experts(q8dot.quantize_rows(x), tokens, local, counts.tolist(), gate_up, down)
        return _reduce_slots(out.view(n, k, -1), w)
    experts_l, counts_l = experts.tolist(), counts.tolist()
    starts_l = starts.tolist() if starts is not None else [0, *itertools.accumulate(counts_l)]
    run = _Q8Grouped(x, tokens, order, starts_l, counts_l, out) if q8 else _KQGrouped(x, tokens, order, starts, out) \
        if kq else _float_grouped(x, ew, tokens, order, starts_l, counts_l, out)
    host = ew.gate.raw.device
    pos = {e: j for j, e in enumerate(experts_l)}

    def from_host(sel: list[int]):  # type: ignore[no-untyped-def]
        if kq:  # the stacks themselves: the kernels read the selected experts' blocks in place
            return (ew.gate, ew.up, ew.down), torch.tensor([experts_l[j] for j in sel], dtype=torch.long)
        if q8:
            at = torch.tensor([experts_l[j] for j in sel], dtype=torch.long)
            return q8dot.select(*q8dot.expert_planes(ew.gate, ew.up, ew.down), at)
        return tuple(gather_experts(t, [experts_l[j] for j in sel]) for t in (ew.gate, ew.up, ew.down))

    def from_slots(sel: list[int]):  # type: ignore[no-untyped-def]
        if slots and kq:
            ws = cache.weights([hits[experts_l[j]] for j in sel])
            return tuple(QTensor(q.raw, q.qtype, (len(sel), *shape)) for q, (_, shape) in zip(ws, cache.meta)), \
                q8dot.ARANGE[:len(sel)]
        g, u, d = (q8dot.unpack(q.raw, (len(sel), *shape)) if slots else q.dequantize().view(len(sel), *shape)
                   for q, (_, shape) in zip(cache.weights([hits[experts_l[j]] for j in sel]), cache.meta))
        if slots:
            return q8dot.stack_experts(g, u, d)
        return g, u, d

    if cache is None:
        run(list(range(len(experts_l))), from_host, host)
        return _reduce_slots(out.view(n, k, -1), w)
    hits, misses = cache.lookup(experts_l)
    if cache.miss_policy == "load":  # wait for the copies, then everything runs on the accelerator
        hits.update(cache.load(misses, set(experts_l)))
    on_cpu = [pos[e] for e in experts_l if e not in hits]
    cached = [pos[e] for e in experts_l if e in hits]
    slots = cache.device.type == "cpu" and (q8 or kq)  # CPU stand-ins for an accelerator: the same integer path
    if cached:
        crun = run if slots else _float_grouped(x, ew, tokens, order, starts_l, counts_l, out)
        crun(cached, from_slots, cache.device)
    if on_cpu:
        run(on_cpu, from_host, host)
        if cache.miss_policy == "cpu":  # computed on the CPU this time; cached for the next passes
            cache.load([experts_l[j] for j in on_cpu], set(experts_l))
    return _reduce_slots(out.view(n, k, -1), w)


_ZEROS = torch.zeros(1 << 12, dtype=torch.long)


def _one_token(x: torch.Tensor, at: torch.Tensor, w: torch.Tensor, planes: tuple[q8dot.Planes, q8dot.Planes]) -> torch.Tensor:
    """A decode step's (or a draft's) experts: one row, distinct experts `at` in slot order, so the pairs are the
    slots themselves (no sort, no scatter). Same products, same bits as the grouped path."""
    k = at.shape[0]
    gate_up, down = q8dot.select(*planes, at)
    y = q8dot.experts(q8dot.quantize_rows(x), _ZEROS[:k], q8dot.ARANGE[:k], [1] * k, gate_up, down)
    return _reduce_slots(y.view(1, k, -1), w)


class _KQGrouped:
    """Runs a subset of a pass's experts on the CPU in the native kernels (engine.kquant: K-quants and Q8_0): each
    selected expert's blocks are read once for all its tokens, three kernel calls per subset."""

    def __init__(self, x: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, starts: torch.Tensor | None,
                 out: torch.Tensor):
        assert starts is not None, "the native kernels come with the native grouping (nativelib.group_pairs)"
        self.x, self.tokens, self.order, self.starts, self.out = x, tokens, order, starts, out

    def __call__(self, positions: list[int], gather, dev: torch.device) -> None:  # type: ignore[no-untyped-def]
        """positions: indices into the pass's sorted experts; gather(positions) → the (gate, up, down) stacks and
        the positions' expert ids in them."""
        stacks, ids = gather(positions)
        self.run(stacks, ids, positions)

    def run(self, stacks: tuple[QTensor, QTensor, QTensor], ids: torch.Tensor, positions: list[int] | None = None) -> None:
        """The experts at `positions` (None: all of the pass's), expert ids[j] of the stacks for position j."""
        gate, up, down = stacks
        if positions is None:
            pairs, starts = None, self.starts
        else:
            at = torch.tensor(positions, dtype=torch.long)
            pairs = torch.cat([torch.arange(int(self.starts[p]), int(self.starts[p + 1])) for p in positions])
            starts = torch.zeros(len(positions) + 1, dtype=torch.long)
            torch.cumsum(self.starts[at + 1] - self.starts[at], 0, out=starts[1:])
        tokens = self.tokens if pairs is None else self.tokens[pairs]
        g = kquant.matmul_pairs(kquant.quantize_for(self.x, gate.qtype), gate, tokens, ids, starts)
        u = kquant.matmul_pairs(kquant.quantize_for(self.x, up.qtype), up, tokens, ids, starts)
        h = F.silu(g).mul_(u)
        y = kquant.matmul_pairs(kquant.quantize_for(h, down.qtype), down, q8dot.ARANGE[:h.shape[0]], ids, starts)
        self.out[self.order if pairs is None else self.order[pairs]] = y


def _float_grouped(x: torch.Tensor, ew: ExpertWeights, tokens: torch.Tensor, order: torch.Tensor, starts: list[int],
                   counts: list[int], out: torch.Tensor) -> _Grouped:
    xg = round_activations(x, ew.gate.qtype.name)
    xu = xg if ew.up.qtype == ew.gate.qtype else round_activations(x, ew.up.qtype.name)
    per_expert = ew.gate.n_rows // ew.gate.shape[0] * ew.gate.n_cols
    return _Grouped(xg, xu, tokens, order, starts, counts, ew.down.qtype.name, out,
                    max(1, GROUP_ELEMENTS // per_expert))


class _Q8Grouped:
    """Runs a subset of a pass's experts on the CPU in integers (engine.q8dot), from their int8 planes."""

    def __init__(self, x: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, starts: list[int],
                 counts: list[int], out: torch.Tensor):
        self.xr, self.tokens, self.order, self.starts, self.counts, self.out = \
            q8dot.quantize_rows(x), tokens, order, starts, counts, out

    def __call__(self, positions: list[int], gather, dev: torch.device) -> None:  # type: ignore[no-untyped-def]
        pairs = torch.cat([torch.arange(self.starts[p], self.starts[p + 1]) for p in positions])
        counts = [self.counts[p] for p in positions]
        local = torch.repeat_interleave(torch.arange(len(positions)), torch.tensor(counts))
        gate_up, down = gather(positions)
        self.out[self.order[pairs]] = q8dot.experts(self.xr, self.tokens[pairs], local, counts, gate_up, down)


class _Grouped:
    """Runs a subset of a pass's experts (positions into its sorted expert list) on one device."""

    def __init__(self, xg: torch.Tensor, xu: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor,
                 starts: list[int], counts: list[int], down_t: str, out: torch.Tensor, step: int):
        self.xg, self.xu, self.tokens, self.order, self.step = xg, xu, tokens, order, step
        self.starts, self.counts, self.down_t, self.out = starts, counts, down_t, out

    def __call__(self, positions: list[int], gather, dev: torch.device) -> None:  # type: ignore[no-untyped-def]
        out, starts, counts = self.out, self.starts, self.counts
        moved = dev != out.device
        xg = self.xg.to(dev) if moved else self.xg
        xu = xg if self.xu is self.xg else (self.xu.to(dev) if moved else self.xu)
        tokens = self.tokens.to(dev) if moved else self.tokens
        for g0 in range(0, len(positions), self.step):
            group = positions[g0:g0 + self.step]
            wg, wu, wd = gather(group)
            # Experts with one token (all of them in a decode step, most of them in a verify pass) run as
            # one batched product over distinct weights; the rest one expert at a time over its tokens.
            single = [j for j, p in enumerate(group) if counts[p] == 1]
            if single:
                at = torch.tensor([starts[group[j]] for j in single], dtype=torch.long, device=dev)
                tok = tokens[at]
                if len(single) == len(group):  # no copy of the weights when the whole group is single
                    sg, su, sd = wg, wu, wd
                else:
                    sel = torch.tensor(single, dtype=torch.long, device=dev)
                    sg, su, sd = wg[sel], wu[sel], wd[sel]
                h = F.silu(_bmm_t(xg[tok].unsqueeze(1), sg)) * _bmm_t(xu[tok].unsqueeze(1), su)
                y = _bmm_t(round_activations(h, self.down_t).unsqueeze(1), sd)
                out[self.order[at.to(out.device)]] = y.to(out.device) if moved else y
            for j, p in enumerate(group):
                a, b = starts[p], starts[p + 1]
                c = b - a
                if c == 1:
                    continue
                tok = tokens[a:b]
                h = F.silu(_bmm_t(xg[tok].unsqueeze(1), wg[j].expand(c, -1, -1))) * \
                    _bmm_t(xu[tok].unsqueeze(1), wu[j].expand(c, -1, -1))
                y = _bmm_t(round_activations(h, self.down_t).unsqueeze(1), wd[j].expand(c, -1, -1))
                out[self.order[a:b]] = y.to(out.device) if moved else y


def _reduce_slots(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_s w[:, s] · y[:, s] over the top-k slots [N, k, d], one sum over the slot dim (a reduction across
    rows of d values: each element's k terms added in slot order, whatever N and the grouping were)."""
    return (y * w.unsqueeze(-1)).sum(1)


def _run_experts_float(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ew: ExpertWeights,
                       order: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                       tokens: torch.Tensor) -> torch.Tensor:
    """Training path (float parameter weights, autograd): same grouping and reduction, plain matmuls."""
    n, k = idx.shape
    parts, start = [], 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        xe = x[tokens[start:start + c]]
        h = F.silu(xe @ ew.gate[e].t()) * (xe @ ew.up[e].t())
        parts.append(h @ ew.down[e].t())
        start += c
    out = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
    out = out.index_put((order,), torch.cat(parts))
    return _reduce_slots(out.view(n, k, -1), w)


def _run_experts_dense(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    """Training on an accelerator: every expert on every token in three large products, each expert's output
    weighted by its routing weight (zero when not selected) — the same sum as the grouped path, in a few
    kernels instead of a loop over experts, which on a GPU costs less than the launches it saves."""
    n, e_all = x.shape[0], ew.gate.shape[0]
    route_w = torch.zeros(n, e_all, dtype=x.dtype, device=x.device).scatter(1, idx, w.to(x.dtype))
    h = F.silu(torch.einsum("nd,efd->enf", x, ew.gate)) * torch.einsum("nd,efd->enf", x, ew.up)
    h = h * route_w.t()[:, :, None]
    return torch.einsum("enf,edf->nd", h, ew.down)
