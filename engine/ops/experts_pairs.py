"""A pass's routed (token, slot) pairs grouped by expert, and the parts that run some of its experts.

Grouping puts the pairs of one expert together so its matrices are read once for all its tokens (natively in one
call where the backend is native and the ids are int64 on the CPU, else by a stable argsort). A part runs the experts
at some positions of the pass's sorted expert list, given a `Gather` (positions → their weights in the part's form:
a stack's experts, an expert cache's slots), and writes each pair's output row where the pair is:
  - NativePart: the native pairs products (engine/native: three kernel calls per subset);
  - TritonPart: engine.ops.triton_q's grouped GEMV, one (token, expert) pair per program;
  - Int8Part: torch integer Q8_0 products from int8 planes;
  - DequantPart: dequantized weights in batched float products, a group of experts at a time.
Every pair's product is an independent row product and `reduce_slots` adds a token's k outputs in slot order, so
neither the grouping nor the split into parts changes a bit.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.ops import indices, native, torch_int8
from engine.ops.activations import quantize, round_for
from engine.ops.backend import Backend, Int8Layouts
from engine.ops.linear import NativeLinear, Weight
from engine.storage.qtensor import QTensor

# Dequantized expert weights handled at once per projection: bounds memory on big models (a 35B
# expert is 1M values per projection) while a decode step's k experts take one kernel call.
GROUP_ELEMENTS = 1 << 23
ARANGE = torch_int8.ARANGE  # index tables sliced instead of made per pass
_ZEROS = torch.zeros(1 << 12, dtype=torch.long)

Gather = Callable[[list[int]], Any]  # positions into a pass's sorted experts → their weights in a part's form
Meta = list[tuple[QT, tuple[int, int]]]  # (type, (rows, cols)) of one expert's gate, up and down matrices


@dataclass(eq=False)
class Pairs:
    """A pass's (token, slot) pairs grouped by expert, and the output row of each pair."""

    x: torch.Tensor  # [n, d] the pass's rows
    k: int  # slots per token
    order: torch.Tensor  # [P] flat pair indices t·k + s, in expert order
    tokens: torch.Tensor  # [P] the pairs' tokens, in that order
    experts: torch.Tensor  # [G] the experts present, ascending
    counts: torch.Tensor  # [G] their pairs
    starts: torch.Tensor | None  # [G + 1] their first pairs, then P (the native grouping's; None from torch's)
    out: torch.Tensor  # [P, d] each pair's output, at its flat index

    @cached_property
    def expert_list(self) -> list[int]:
        return self.experts.tolist()

    @cached_property
    def count_list(self) -> list[int]:
        return self.counts.tolist()

    @cached_property
    def start_list(self) -> list[int]:
        return self.starts.tolist() if self.starts is not None else [0, *itertools.accumulate(self.count_list)]

    def reduce(self, w: torch.Tensor) -> torch.Tensor:
        """The tokens' outputs [n, d]: each token's pair outputs weighted by w [n, k], summed in slot order."""
        return reduce_slots(self.out.view(-1, self.k, self.out.shape[1]), w)


def group(x: torch.Tensor, idx: torch.Tensor, backend: Backend, n_ids: int) -> Pairs:
    """The pairs of top-k ids idx [n, k] (each in [0, n_ids)) grouped by expert, outputs not yet written."""
    n, k = idx.shape
    if backend.native and idx.device.type == "cpu" and idx.dtype == torch.long:
        g = native.group_pairs(idx, n_ids)
        order, tokens, experts, counts, starts = g.order, g.tokens, g.experts, g.counts, g.starts
    else:
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        tokens, starts = order // k, None
    out = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
    return Pairs(x, k, order, tokens, experts, counts, starts, out)


class Part(Protocol):
    def __call__(self, positions: list[int], gather: Gather, dev: torch.device) -> None:
        """Run the experts at `positions` (into the pass's sorted experts) on `dev`, their weights from `gather`."""


def subset_pairs(starts: torch.Tensor | list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair indices of a subset of a pass's grouped experts (group g = pairs starts[g]…starts[g+1]), positions'
    groups in order, and each group's pair count: tensor ops, no loop over the experts."""
    st = starts if isinstance(starts, torch.Tensor) else torch.tensor(starts, dtype=torch.long)
    at = torch.tensor(positions, dtype=torch.long)
    lo, counts = st[at], st[at + 1] - st[at]
    first = torch.cumsum(counts, 0) - counts  # where each group begins in the subset
    n = int(counts.sum())
    return torch.repeat_interleave(lo - first, counts, output_size=n) + torch.arange(n), counts


def pairs_product(x: torch.Tensor, lin: NativeLinear, xrow: torch.Tensor, experts: torch.Tensor,
                  starts: torch.Tensor) -> torch.Tensor:
    """Routed-expert products out [P, rows]: pair p (grouped by expert: group g = pairs starts[g]…starts[g+1] on
    expert experts[g]) multiplies row xrow[p] of x by that expert's matrix in the stack."""
    w, b = lin.weight, lin.backend
    xr = quantize(x, lin.fmt, on_native=True, level=b.level)
    e_all = w.shape[0]
    rows = w.n_rows // e_all
    raw, code = lin.kernel_bytes()
    p_n = xrow.shape[0]
    out = torch.empty(p_n, rows)
    xrow, experts, starts = (t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
                             for t in (xrow, experts, starts))
    native.matmul_pairs(code, raw, e_all, rows, xr.q, xr.d, xr.bsums, xr.s, lin.perm(xr, code), w.n_cols, xrow,
                        experts, starts, out, b.n_threads(p_n * rows * w.n_cols), b.level)
    return out


def routed_native(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                  stacks: tuple[NativeLinear, ...], backend: Backend) -> torch.Tensor:
    """Grouping, the three projections, silu(gate) · up and the slot-ordered weighted sum in one native call
    (engine/native/moe.c): the same products as `NativePart`, about fifteen fewer calls and tensor ops per layer."""
    n_e = stacks[0].weight.shape[0]
    descs = []
    for lin in stacks:
        raw, code = lin.kernel_bytes()
        rows, cols = lin.n_rows // n_e, lin.n_cols
        descs.append(native.expert_stack(code, raw, n_e, rows, cols, backend.n_threads(idx.numel() * rows * cols)))
    xc = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    ic = idx if idx.dtype == torch.int64 and idx.is_contiguous() else idx.to(torch.int64).contiguous()
    wc = w if w.dtype == torch.float32 and w.is_contiguous() else w.float().contiguous()
    return native.moe_routed(tuple(descs), xc, ic, wc, n_e, backend.level)  # type: ignore[arg-type]


class NativePart:
    """A subset of a pass's experts on the CPU in the native kernels: each selected expert's blocks are read once for
    all its tokens, three kernel calls per subset."""

    def __init__(self, p: Pairs):
        assert p.starts is not None, "the native kernels come with the native grouping (native.group_pairs)"
        self.p = p

    def __call__(self, positions: list[int], gather: Gather, dev: torch.device) -> None:
        """gather(positions) → the (gate, up, down) stacks and the positions' expert ids in them."""
        stacks, ids = gather(positions)
        self.run(stacks, ids, positions)

    def run(self, stacks: tuple[NativeLinear, NativeLinear, NativeLinear], ids: torch.Tensor,
            positions: list[int] | None = None) -> None:
        """The experts at `positions` (None: all of the pass's), expert ids[j] of the stacks for position j."""
        p = self.p
        gate, up, down = stacks
        if positions is None:
            pairs, starts = None, p.starts
        else:
            pairs, counts = subset_pairs(p.starts, positions)  # type: ignore[arg-type]
            starts = torch.zeros(len(positions) + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=starts[1:])
        tokens = p.tokens if pairs is None else p.tokens[pairs]
        g = pairs_product(p.x, gate, tokens, ids, starts)  # type: ignore[arg-type]
        u = pairs_product(p.x, up, tokens, ids, starts)  # type: ignore[arg-type]
        h = native.silu_mul(g, u)  # the one-call pass's bits (moe.c), not torch's silu
        y = pairs_product(h, down, ARANGE[:h.shape[0]], ids, starts)  # type: ignore[arg-type]
        p.out[p.order if pairs is None else p.order[pairs]] = y


def triton_products(x: torch.Tensor, meta: Meta, stacks: tuple[torch.Tensor, ...], mats: torch.Tensor,
                    tokens: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) ⊙ up x) [P, d] for pair p = (row tokens[p] of x, matrix mats[p] of each raw stack
    [E, bytes of one matrix]), in engine.ops.triton_q's grouped GEMV: one kernel call per projection."""
    from engine.ops import triton_q

    x = x if x.device == mats.device else x.to(mats.device)
    (qg, (f, d)), (qu, _), (qd, _) = meta
    h = triton_glu(x, meta, stacks, mats, tokens)
    return triton_q.gemv_pairs(stacks[2], qd, d, f, h, mats, indices.arange(h.shape[0], h.device))


def triton_glu(x: torch.Tensor, meta: Meta, stacks: tuple[torch.Tensor, ...], mats: torch.Tensor,
               tokens: torch.Tensor) -> torch.Tensor:
    """silu(gate x) ⊙ up x [P, f] for the pairs of `triton_products`: one launch where gate and up share a type."""
    from engine.ops import triton_q

    (qg, (f, d)), (qu, _), _ = meta
    if qg == qu:
        return triton_q.gemv_glu_pairs(stacks[0], stacks[1], qg, f, d, x, mats, tokens)
    return F.silu(triton_q.gemv_pairs(stacks[0], qg, f, d, x, mats, tokens)) * \
        triton_q.gemv_pairs(stacks[1], qu, f, d, x, mats, tokens)


class TritonPart:
    """A subset of a pass's experts in Triton's grouped GEMV: each pair's product reads its matrix where it is (a
    stack's expert, an expert cache's slot)."""

    def __init__(self, p: Pairs, meta: Meta):
        self.p, self.meta = p, meta

    def __call__(self, positions: list[int], gather: Gather, dev: torch.device) -> None:
        """gather(positions) → the raw stacks and the positions' matrix ids in them."""
        p = self.p
        stacks, ids = gather(positions)
        pairs, counts = subset_pairs(p.start_list, positions)
        mats = ids.repeat_interleave(counts.to(ids.device))
        y = triton_products(p.x, self.meta, stacks, mats, p.tokens[pairs].to(dev))
        p.out[p.order[pairs]] = y.to(p.out.device)


class Int8Part:
    """A subset of a pass's experts on the CPU in torch integers, from their int8 planes."""

    def __init__(self, p: Pairs, layouts: Int8Layouts):
        self.p, self.xr, self.layouts = p, quantize(p.x, "Q8_0", on_native=False), layouts

    def __call__(self, positions: list[int], gather: Gather, dev: torch.device) -> None:
        """gather(positions) → the positions' gate-up and down planes."""
        p = self.p
        pairs, counts_t = subset_pairs(p.start_list, positions)
        local = torch.repeat_interleave(torch.arange(len(positions)), counts_t)
        gate_up, down = gather(positions)
        p.out[p.order[pairs]] = torch_int8.experts(self.xr, p.tokens[pairs], local, counts_t.tolist(), gate_up, down,
                                                   self.layouts)


def one_token(x: torch.Tensor, at: torch.Tensor, w: torch.Tensor,
              planes: tuple[torch_int8.Planes, torch_int8.Planes], layouts: Int8Layouts) -> torch.Tensor:
    """A decode step's (or a draft's) experts in torch integers: one row, distinct experts `at` in slot order, so the
    pairs are the slots themselves (no sort, no scatter). Same products, same bits as the grouped path."""
    k = at.shape[0]
    gate_up, down = torch_int8.select(*planes, at)
    y = torch_int8.experts(quantize(x, "Q8_0", on_native=False), _ZEROS[:k], ARANGE[:k], [1] * k, gate_up, down,
                           layouts)
    return reduce_slots(y.view(1, k, -1), w)


class DequantPart:
    """A subset of a pass's experts on one device, dequantized: x rounded for each projection's type as llama.cpp
    rounds it, the weights gathered GROUP_ELEMENTS values of a projection at a time."""

    def __init__(self, p: Pairs, gate: QTensor, up: QTensor, down: QTensor):
        self.p = p
        self.xg = round_for(p.x, gate.qtype.name)
        self.xu = self.xg if up.qtype == gate.qtype else round_for(p.x, up.qtype.name)
        self.down_t = down.qtype.name
        self.step = max(1, GROUP_ELEMENTS // (gate.n_rows // gate.shape[0] * gate.n_cols))

    def __call__(self, positions: list[int], gather: Gather, dev: torch.device) -> None:
        """gather(positions) → the positions' float gate, up and down matrices [U, rows, cols]."""
        p = self.p
        out, starts, counts = p.out, p.start_list, p.count_list
        moved = dev != out.device
        xg = self.xg.to(dev) if moved else self.xg
        xu = xg if self.xu is self.xg else (self.xu.to(dev) if moved else self.xu)
        tokens = p.tokens.to(dev) if moved else p.tokens
        for g0 in range(0, len(positions), self.step):
            group = positions[g0:g0 + self.step]
            wg, wu, wd = gather(group)
            # Experts with one token (all of them in a decode step, most of them in a verify pass) run as
            # one batched product over distinct weights; the rest one expert at a time over its tokens.
            single = [j for j, q in enumerate(group) if counts[q] == 1]
            if single:
                at = torch.tensor([starts[group[j]] for j in single], dtype=torch.long, device=dev)
                tok = tokens[at]
                if len(single) == len(group):  # no copy of the weights when the whole group is single
                    sg, su, sd = wg, wu, wd
                else:
                    sel = torch.tensor(single, dtype=torch.long, device=dev)
                    sg, su, sd = wg[sel], wu[sel], wd[sel]
                h = F.silu(_bmm_t(xg[tok].unsqueeze(1), sg)) * _bmm_t(xu[tok].unsqueeze(1), su)
                y = _bmm_t(round_for(h, self.down_t).unsqueeze(1), sd)
                out[p.order[at.to(out.device)]] = y.to(out.device) if moved else y
            for j, q in enumerate(group):
                a, b = starts[q], starts[q + 1]
                c = b - a
                if c == 1:
                    continue
                tok = tokens[a:b]
                h = F.silu(_bmm_t(xg[tok].unsqueeze(1), wg[j].expand(c, -1, -1))) * \
                    _bmm_t(xu[tok].unsqueeze(1), wu[j].expand(c, -1, -1))
                y = _bmm_t(round_for(h, self.down_t).unsqueeze(1), wd[j].expand(c, -1, -1))
                out[p.order[a:b]] = y.to(out.device) if moved else y


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


def reduce_slots(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_s w[:, s] · y[:, s] over the top-k slots [N, k, d], one sum over the slot dim (a reduction across
    rows of d values: each element's k terms added in slot order, whatever N and the grouping were)."""
    return (y * w.unsqueeze(-1)).sum(1)
