"""Routed experts for N tokens at once, grouped by expert.

Each token picks its own top-k experts; the (token, slot) pairs are grouped by expert so every selected expert's
gate/up/down weights are read once per pass, whatever N is: by the native kernels (the whole pass in one call,
engine/native/moe.c; with an expert cache, one call per projection for all pairs), by the torch integer Q8_0
products, or gathered and dequantized (one call for a group of experts); on CUDA by the Triton kernels, one
(token, expert) pair per GEMV program (engine.ops.triton_q). Every product is one independent row product (as in
engine.ops.linear) and the k expert outputs of a token are reduced in top-k slot order, so a pass over N tokens is
bit-identical to N passes of one. Experts run where their bytes are: on the CPU for CPU stacks (for a layer on an
accelerator too), or from an ExpertCache's slots on the accelerator.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.expert_cache import ExpertCache
from engine.ops import indices, native, torch_int8
from engine.ops.activations import quantize, round_for
from engine.ops.backend import Backend, OpEvent
from engine.ops.delta_rule import pointwise
from engine.ops.linear import Linear, NativeLinear, Weight
from engine.ops.linear import linear as ops_linear
from engine.storage.qtensor import QTensor

# Dequantized expert weights handled at once per projection: bounds memory on big models (a 35B
# expert is 1M values per projection) while a decode step's k experts take one kernel call.
GROUP_ELEMENTS = 1 << 23
ARANGE = torch_int8.ARANGE  # index tables sliced instead of made per pass
_ZEROS = torch.zeros(1 << 12, dtype=torch.long)


class Experts:
    """One MoE layer's routed experts (stacks gate, up [E, F, d] and down [E, d, F]) bound to the products that run
    them, chosen once: "native", "triton" (stacks on a CUDA device), "int8" (torch integer Q8_0), "dequant", or
    "float" (parameters being trained, run by engine.training). Experts cached on a CUDA device run in the Triton
    kernels from their slots (`cache_triton`) whatever runs the others. `shared` (the shared expert's gate, up,
    down): on the torch integer path without a cache it runs inside the routed experts' products as `shared_slices`
    extra experts (`runs_shared`)."""

    def __init__(self, gate: Weight, up: Weight, down: Weight, backend: Backend, device: torch.device | str = "cpu",
                 cache: ExpertCache | None = None, shared: tuple[Weight, Weight, Weight] | None = None):
        """`device`: where the layer's activations are (the stacks may stay on the CPU for a layer on an
        accelerator: then they run there, in the native kernels where the backend has them)."""
        self.gate, self.up, self.down, self.cache = gate, up, down, cache
        self.backend = b = backend.on(gate.device)
        ws = (gate, up, down)
        on_cpu = torch.device(device).type == "cpu" and gate.device.type == "cpu"
        self.shared_slices = 0
        if not all(isinstance(t, QTensor) for t in ws):
            self.kind = "float"
        elif b.kind == "triton" and gate.device.type == torch.device(device).type and _triton_binds(ws):
            self.kind = "triton"
        elif gate.device.type == "cpu" and b.native and \
                all(native.binds(t.qtype, t.n_cols) for t in ws):  # type: ignore[union-attr]
            self.kind = "native"
        elif on_cpu and all(torch_int8.usable(t, b.int8) for t in ws):  # type: ignore[arg-type]
            self.kind = "int8"
            if shared is not None and cache is None and all(isinstance(t, QTensor) for t in shared):
                self.shared_slices = torch_int8.shared_slices(ws, shared, b.int8)  # type: ignore[arg-type]
        else:
            self.kind = "dequant"
        self.shared = shared if self.shared_slices else None
        # the cache's slots read in place by the Triton kernels where they run on the cache's device
        self.cache_triton = cache is not None and backend.on(cache.device).kind == "triton" and _triton_binds(ws)
        self.stacks = tuple(NativeLinear(t, b) for t in ws) if self.kind == "native" else ()  # type: ignore[arg-type]
        self._planes: dict[bool, tuple[torch_int8.Planes, torch_int8.Planes]] = {}
        self._layer: _OneCall | None | bool = False  # the one-call layer's inputs (False: not yet decided)

    @property
    def n_expert(self) -> int:
        return self.gate.shape[0]

    def raw_stacks(self) -> tuple[torch.Tensor, ...]:
        """The stacks' blocks as [E, bytes of one expert's matrix] (views), for the Triton kernels."""
        return tuple(t.raw.reshape(self.n_expert, -1) for t in (self.gate, self.up, self.down))  # type: ignore[union-attr]

    def meta(self) -> list[tuple[QT, tuple[int, int]]]:
        """(type, (rows, cols)) of one expert's gate, up and down matrices."""
        return [(t.qtype, (t.n_rows // self.n_expert, t.n_cols)) for t in (self.gate, self.up, self.down)]  # type: ignore[union-attr]

    @property
    def runs_shared(self) -> bool:
        return self.shared_slices > 0

    def expert_bytes(self) -> int:
        """Stored bytes of one expert's three matrices."""
        return sum(t.nbytes if isinstance(t, QTensor) else t.numel() * t.element_size()
                   for t in (self.gate, self.up, self.down)) // self.n_expert

    def one_call(self, router: Linear, shared: Shared | None) -> _OneCall | None:
        """The inputs of the one-call native MoE layer (moe_ffn), or None where it does not run this layer."""
        if self._layer is False:
            self._layer = self._one_call(router, shared)
        return self._layer  # type: ignore[return-value]

    def _one_call(self, router: Linear, shared: Shared | None) -> _OneCall | None:
        if self.kind != "native" or self.cache is not None:
            return None
        rw = _f32(router)
        if rw is None or rw.shape[0] != self.n_expert or rw.shape[0] > 1024:
            return None
        n_e = self.n_expert
        stacks = tuple(native.expert_stack(code, raw, n_e, lin.n_rows // n_e, lin.n_cols, 1)
                       for lin in self.stacks for raw, code in [lin.kernel_bytes()])
        nbytes = router.nbytes
        sh_inp, sh = None, ()
        if shared is not None:
            sh_inp = _f32(shared[0])
            if sh_inp is None or not all(isinstance(lin, NativeLinear) for lin in shared[1:]):
                return None
            sh = tuple(native.expert_stack(code, raw, 1, lin.n_rows, lin.n_cols, 1)
                       for lin in shared[1:] for raw, code in [lin.kernel_bytes()])  # type: ignore[attr-defined]
            sh_inp = sh_inp.reshape(-1)
            nbytes += sum(lin.nbytes for lin in shared)
        return _OneCall(rw, sh_inp, stacks, sh, nbytes)

    def planes(self, with_shared: bool) -> tuple[torch_int8.Planes, torch_int8.Planes]:
        """The int8 planes of the stacks (and the shared expert's slices), made on first use."""
        p = self._planes.get(with_shared)
        if p is None:
            p = self._planes[with_shared] = torch_int8.expert_planes(
                self.gate, self.up, self.down, self.shared if with_shared else None)  # type: ignore[arg-type]
        return p


@dataclass(frozen=True)
class MoEOut:
    """A MoE layer's output and its routing: y [n, d], router logits [n, E], top-k weights and ids [n, k]."""

    y: torch.Tensor
    logits: torch.Tensor
    weights: torch.Tensor
    idx: torch.Tensor


Shared = tuple[Linear, Linear, Linear, Linear]  # the shared expert: gate input (1, d), gate, up, down


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
    rw = _f32(router)
    si = _f32(shared_inp) if shared_inp is not None else None
    if router.backend.native and rw is not None and rw.shape[0] <= 1024 and (shared_inp is None or si is not None) \
            and x.is_cpu and x.dtype is torch.float32 and not x.requires_grad:
        return native.moe_route(rw, si.reshape(-1) if si is not None else None, x.contiguous(), k,
                                router.backend.n_threads(x.shape[0] * router.n_rows * router.n_cols))
    logits = ops_linear(x, router)
    weights, idx = route(logits, k)
    sgate = pointwise(torch.sigmoid, ops_linear(x, shared_inp)) if shared_inp is not None else None
    return logits, weights, idx, sgate


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


class _OneCall:
    """What moe_layer reads for one layer, made once: float32 router and gate input, and the stacks' descriptors."""

    def __init__(self, router: torch.Tensor, shared_inp: torch.Tensor | None,
                 stacks: tuple[native.ExpertStack, ...], shared: tuple[native.ExpertStack, ...], nbytes: int):
        self.router, self.shared_inp, self.stacks, self.shared, self.nbytes = router, shared_inp, stacks, shared, nbytes


def _f32(lin: Linear) -> torch.Tensor | None:
    """A float32 weight's values on the CPU, as a contiguous [out, in] tensor (None for any other weight)."""
    w = lin.weight
    if isinstance(w, QTensor):
        if w.qtype != QT.F32 or w.raw.device.type != "cpu":
            return None
        return w.raw.view(torch.float32).view(lin.n_rows, lin.n_cols)
    return None


def moe_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ex: Experts,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = Σ_s w[t,s] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = idx[t,s], summed in slot order s; with
    `shared_gate` [N, 1] (when `ex.runs_shared`), y also holds the shared expert weighted by it."""
    if ex.kind == "float":
        raise TypeError("float experts (training) run in engine.training.layers")
    if shared_gate is not None and not ex.runs_shared:
        raise ValueError("the shared expert runs with the routed ones only on the torch integer CPU path")
    obs = ex.backend.observer
    if obs is None:
        return _run(x, idx, w, ex, shared_gate)
    distinct = int(torch.unique(idx).numel())
    t0 = time.perf_counter()
    y = _run(x, idx, w, ex, shared_gate)
    obs(OpEvent("moe_experts", ex.expert_bytes() * distinct, x.shape[0], time.perf_counter() - t0, distinct))
    return y


def _run(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ex: Experts,
         shared_gate: torch.Tensor | None) -> torch.Tensor:
    kq, q8, cache, layouts = ex.kind == "native", ex.kind == "int8", ex.cache, ex.backend.int8
    if kq and x.device.type != "cpu":  # experts kept on the CPU for a layer on an accelerator (cpu_moe): the native
        return _run(x.cpu(), idx.cpu(), w.cpu(), ex, shared_gate).to(x.device)  # kernels, cached ones on the device
    if q8 and cache is None:  # the CPU case of the torch backend, without a device split
        if shared_gate is not None:
            n, s_n = idx.shape[0], ex.shared_slices
            idx = torch.cat([idx, ARANGE[ex.n_expert:ex.n_expert + s_n].expand(n, s_n)], 1)
            w = torch.cat([w, shared_gate.expand(n, s_n)], 1)
        planes = ex.planes(shared_gate is not None)
        if idx.shape[0] == 1:  # one token (a decode step, a draft): its experts are distinct, nothing to group
            return _one_token(x, idx[0], w, planes, layouts)
    n, k = idx.shape
    if kq and cache is None:  # the whole pass in one native call
        return _routed_native(x, idx, w, ex)
    if ex.kind == "triton" and cache is None:  # every (token, slot) pair its own product: nothing read back
        tokens = indices.repeated(n, k, x.device)
        y = _Triton(x, tokens, ex.meta()).products(ex.raw_stacks(), idx.reshape(-1), tokens)
        return reduce_slots(y.view(n, k, -1), w)
    starts = None
    if ex.backend.native and idx.device.type == "cpu" and idx.dtype == torch.long:
        g = native.group_pairs(idx, ex.n_expert + ex.shared_slices)
        order, tokens, experts, counts, starts = g.order, g.tokens, g.experts, g.counts, g.starts
    else:
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        tokens = order // k
    out = torch.empty(n * k, x.shape[1], dtype=x.dtype, device=x.device)
    if q8 and cache is None:
        local = torch.repeat_interleave(torch.arange(experts.numel()), counts)
        gate_up, down = torch_int8.select(*planes, experts)
        out[order] = torch_int8.experts(quantize(x, "Q8_0", on_native=False), tokens, local, counts.tolist(),
                                        gate_up, down, layouts)
        return reduce_slots(out.view(n, k, -1), w)
    experts_l, counts_l = experts.tolist(), counts.tolist()
    starts_l = starts.tolist() if starts is not None else [0, *itertools.accumulate(counts_l)]
    run = _Int8(x, tokens, order, starts_l, out, layouts) if q8 else \
        _Native(x, tokens, order, starts, out) if kq else \
        _Triton(x, tokens, ex.meta(), order, starts_l, out) if ex.kind == "triton" else \
        _dequant_grouped(x, ex, tokens, order, starts_l, counts_l, out)
    host = ex.gate.device
    pos = {e: j for j, e in enumerate(experts_l)}

    def from_host(sel: list[int]):  # type: ignore[no-untyped-def]
        if ex.kind == "triton":
            return ex.raw_stacks(), torch.tensor([experts_l[j] for j in sel], dtype=torch.long, device=host)
        if kq:  # the stacks themselves: the kernels read the selected experts' blocks in place
            return ex.stacks, torch.tensor([experts_l[j] for j in sel], dtype=torch.long)
        if q8:
            at = torch.tensor([experts_l[j] for j in sel], dtype=torch.long)
            return torch_int8.select(*ex.planes(False), at)
        return tuple(gather_experts(t, [experts_l[j] for j in sel]) for t in (ex.gate, ex.up, ex.down))

    def from_slots(sel: list[int]):  # type: ignore[no-untyped-def]
        if ex.cache_triton:  # the slots themselves, read in place
            at = [hits[experts_l[j]] for j in sel]
            return tuple(cache.slots), torch.tensor(at, dtype=torch.long, device=cache.device)  # type: ignore[union-attr]
        ws = cache.weights([hits[experts_l[j]] for j in sel])  # type: ignore[union-attr]
        if slots and kq:
            return tuple(NativeLinear(QTensor(q.raw, q.qtype, (len(sel), *shape)), ex.backend)
                         for q, (_, shape) in zip(ws, cache.meta)), ARANGE[:len(sel)]  # type: ignore[union-attr]
        g, u, d = (torch_int8.unpack(q.raw, (len(sel), *shape)) if slots else q.dequantize().view(len(sel), *shape)
                   for q, (_, shape) in zip(ws, cache.meta))  # type: ignore[union-attr]
        if slots:
            return torch_int8.stack_experts(g, u, d)
        return g, u, d

    if cache is None:
        run(list(range(len(experts_l))), from_host, host)
        return reduce_slots(out.view(n, k, -1), w)
    hits, misses = cache.lookup(experts_l)
    if cache.miss_policy == "load":  # wait for the copies, then everything runs on the accelerator
        hits.update(cache.load(misses, set(experts_l)))
    on_cpu = [pos[e] for e in experts_l if e not in hits]
    cached = [pos[e] for e in experts_l if e in hits]
    slots = cache.device.type == "cpu" and (q8 or kq)  # CPU stand-ins for an accelerator: the same integer path
    if cached:
        crun = _Triton(x, tokens, cache.meta, order, starts_l, out) if ex.cache_triton else run if slots else \
            _dequant_grouped(x, ex, tokens, order, starts_l, counts_l, out)
        crun(cached, from_slots, cache.device)
    if on_cpu:
        run(on_cpu, from_host, host)
        if cache.miss_policy == "cpu":  # computed on the CPU this time; cached for the next passes
            cache.load([experts_l[j] for j in on_cpu], set(experts_l))
    return reduce_slots(out.view(n, k, -1), w)


def _triton_binds(ws: tuple[Weight, ...]) -> bool:
    from engine.ops import triton_q

    return all(isinstance(t, QTensor) and triton_q.binds(t.qtype, t.n_cols) for t in ws)


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


def _one_token(x: torch.Tensor, at: torch.Tensor, w: torch.Tensor,
               planes: tuple[torch_int8.Planes, torch_int8.Planes], layouts) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """A decode step's (or a draft's) experts: one row, distinct experts `at` in slot order, so the pairs are the
    slots themselves (no sort, no scatter). Same products, same bits as the grouped path."""
    k = at.shape[0]
    gate_up, down = torch_int8.select(*planes, at)
    y = torch_int8.experts(quantize(x, "Q8_0", on_native=False), _ZEROS[:k], ARANGE[:k], [1] * k, gate_up, down,
                           layouts)
    return reduce_slots(y.view(1, k, -1), w)


def _pairs(x: torch.Tensor, lin: NativeLinear, xrow: torch.Tensor, experts: torch.Tensor,
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


def _routed_native(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, ex: Experts) -> torch.Tensor:
    """Grouping, the three projections, silu(gate) · up and the slot-ordered weighted sum in one native call
    (engine/native/moe.c): the same products as `_Native`, about fifteen fewer calls and tensor ops per layer."""
    b, n_e = ex.backend, ex.n_expert
    descs = []
    for lin in ex.stacks:
        raw, code = lin.kernel_bytes()
        rows, cols = lin.n_rows // n_e, lin.n_cols
        descs.append(native.expert_stack(code, raw, n_e, rows, cols, b.n_threads(idx.numel() * rows * cols)))
    xc = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    ic = idx if idx.dtype == torch.int64 and idx.is_contiguous() else idx.to(torch.int64).contiguous()
    wc = w if w.dtype == torch.float32 and w.is_contiguous() else w.float().contiguous()
    return native.moe_routed(tuple(descs), xc, ic, wc, n_e, b.level)  # type: ignore[arg-type]


def _subset_pairs(starts: torch.Tensor | list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair indices of a subset of a pass's grouped experts (group g = pairs starts[g]…starts[g+1]), positions'
    groups in order, and each group's pair count: tensor ops, no loop over the experts."""
    st = starts if isinstance(starts, torch.Tensor) else torch.tensor(starts, dtype=torch.long)
    at = torch.tensor(positions, dtype=torch.long)
    lo, counts = st[at], st[at + 1] - st[at]
    first = torch.cumsum(counts, 0) - counts  # where each group begins in the subset
    n = int(counts.sum())
    return torch.repeat_interleave(lo - first, counts, output_size=n) + torch.arange(n), counts


class _Native:
    """Runs a subset of a pass's experts on the CPU in the native kernels: each selected expert's blocks are read
    once for all its tokens, three kernel calls per subset."""

    def __init__(self, x: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, starts: torch.Tensor | None,
                 out: torch.Tensor):
        assert starts is not None, "the native kernels come with the native grouping (native.group_pairs)"
        self.x, self.tokens, self.order, self.starts, self.out = x, tokens, order, starts, out

    def __call__(self, positions: list[int], gather, dev: torch.device) -> None:  # type: ignore[no-untyped-def]
        """positions: indices into the pass's sorted experts; gather(positions) → the (gate, up, down) stacks and
        the positions' expert ids in them."""
        stacks, ids = gather(positions)
        self.run(stacks, ids, positions)

    def run(self, stacks: tuple[NativeLinear, NativeLinear, NativeLinear], ids: torch.Tensor,
            positions: list[int] | None = None) -> None:
        """The experts at `positions` (None: all of the pass's), expert ids[j] of the stacks for position j."""
        gate, up, down = stacks
        if positions is None:
            pairs, starts = None, self.starts
        else:
            pairs, counts = _subset_pairs(self.starts, positions)
            starts = torch.zeros(len(positions) + 1, dtype=torch.long)
            torch.cumsum(counts, 0, out=starts[1:])
        tokens = self.tokens if pairs is None else self.tokens[pairs]
        g = _pairs(self.x, gate, tokens, ids, starts)
        u = _pairs(self.x, up, tokens, ids, starts)
        h = native.silu_mul(g, u)  # the one-call pass's bits (moe.c), not torch's silu
        y = _pairs(h, down, ARANGE[:h.shape[0]], ids, starts)
        self.out[self.order if pairs is None else self.order[pairs]] = y


class _Triton:
    """Runs (token, expert) pairs in engine.ops.triton_q's grouped GEMV: each pair's product reads its matrix where
    it is (a stack's expert, an expert cache's slot), one kernel call per projection for all the pairs."""

    def __init__(self, x: torch.Tensor, tokens: torch.Tensor, meta: list[tuple[QT, tuple[int, int]]],
                 order: torch.Tensor | None = None, starts: list[int] | None = None, out: torch.Tensor | None = None):
        """meta: (type, (rows, cols)) of one expert's gate, up and down matrices."""
        self.x, self.tokens, self.meta, self.order, self.starts, self.out = x, tokens, meta, order, starts, out

    def products(self, stacks: tuple[torch.Tensor, ...], mats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) ⊙ up x) [P, d] for pair p = (row tokens[p] of x, matrix mats[p] of each stack)."""
        from engine.ops import triton_q

        x = self.x if self.x.device == mats.device else self.x.to(mats.device)
        (qg, (f, d)), (qu, _), (qd, _) = self.meta
        g = triton_q.gemv_pairs(stacks[0], qg, f, d, x, mats, tokens)
        u = triton_q.gemv_pairs(stacks[1], qu, f, d, x, mats, tokens)
        h = F.silu(g) * u
        return triton_q.gemv_pairs(stacks[2], qd, d, f, h, mats, indices.arange(h.shape[0], h.device))

    def __call__(self, positions: list[int], gather, dev: torch.device) -> None:  # type: ignore[no-untyped-def]
        """positions: indices into the pass's sorted experts; gather(positions) → the raw stacks and the positions'
        matrix ids in them."""
        stacks, ids = gather(positions)
        starts, out, order = self.starts, self.out, self.order
        assert starts is not None and out is not None and order is not None
        pairs, counts = _subset_pairs(starts, positions)
        y = self.products(stacks, ids.repeat_interleave(counts.to(ids.device)), self.tokens[pairs].to(dev))
        out[order[pairs]] = y.to(out.device)


class _Int8:
    """Runs a subset of a pass's experts on the CPU in torch integers, from their int8 planes."""

    def __init__(self, x: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, starts: list[int],
                 out: torch.Tensor, layouts) -> None:  # type: ignore[no-untyped-def]
        self.xr, self.tokens, self.order, self.starts, self.out = \
            quantize(x, "Q8_0", on_native=False), tokens, order, starts, out
        self.layouts = layouts

    def __call__(self, positions: list[int], gather, dev: torch.device) -> None:  # type: ignore[no-untyped-def]
        pairs, counts_t = _subset_pairs(self.starts, positions)
        counts = counts_t.tolist()
        local = torch.repeat_interleave(torch.arange(len(positions)), counts_t)
        gate_up, down = gather(positions)
        self.out[self.order[pairs]] = torch_int8.experts(self.xr, self.tokens[pairs], local, counts, gate_up, down,
                                                         self.layouts)


def _dequant_grouped(x: torch.Tensor, ex: Experts, tokens: torch.Tensor, order: torch.Tensor, starts: list[int],
                     counts: list[int], out: torch.Tensor) -> _Dequant:
    gate, up, down = ex.gate, ex.up, ex.down
    xg = round_for(x, gate.qtype.name)  # type: ignore[union-attr]
    xu = xg if up.qtype == gate.qtype else round_for(x, up.qtype.name)  # type: ignore[union-attr]
    per_expert = gate.n_rows // gate.shape[0] * gate.n_cols  # type: ignore[union-attr]
    return _Dequant(xg, xu, tokens, order, starts, counts, down.qtype.name, out,  # type: ignore[union-attr]
                    max(1, GROUP_ELEMENTS // per_expert))


class _Dequant:
    """Runs a subset of a pass's experts (positions into its sorted expert list) on one device, dequantized."""

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
                y = _bmm_t(round_for(h, self.down_t).unsqueeze(1), sd)
                out[self.order[at.to(out.device)]] = y.to(out.device) if moved else y
            for j, p in enumerate(group):
                a, b = starts[p], starts[p + 1]
                c = b - a
                if c == 1:
                    continue
                tok = tokens[a:b]
                h = F.silu(_bmm_t(xg[tok].unsqueeze(1), wg[j].expand(c, -1, -1))) * \
                    _bmm_t(xu[tok].unsqueeze(1), wu[j].expand(c, -1, -1))
                y = _bmm_t(round_for(h, self.down_t).unsqueeze(1), wd[j].expand(c, -1, -1))
                out[self.order[a:b]] = y.to(out.device) if moved else y


def reduce_slots(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_s w[:, s] · y[:, s] over the top-k slots [N, k, d], one sum over the slot dim (a reduction across
    rows of d values: each element's k terms added in slot order, whatever N and the grouping were)."""
    return (y * w.unsqueeze(-1)).sum(1)

