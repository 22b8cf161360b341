"""Routed experts bound to the products that run them, chosen once when the model is built (`bind_experts`), as
`engine.ops.linear.bind` does for a weight. One class per kind, each running a whole pass (`run`) and, for an expert
cache, any subset of a pass's experts from its stacks (`part`, `host_weights`):
  - NativeExperts: stacks in RAM, the native kernels (a pass in one call, engine/native/moe.c); a layer on an
    accelerator (cpu_moe) sends its rows to the CPU and back;
  - TritonExperts: stacks on a CUDA device in Triton's grouped GEMV, nothing read back (capturable in a step graph);
  - Int8Experts: Q8_0 stacks on the CPU in torch integer products, the shared expert among them where it fits;
  - DequantExperts: any other stored type, gathered and dequantized a group of experts at a time;
  - FloatExperts: float parameters being trained (run by engine.training's layers);
  - CachedExperts: experts in RAM with an ExpertCache on an accelerator: the pass's cached experts run from the
    cache's slots, the others by the bound experts it wraps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from gguf import GGMLQuantizationType as QT

from engine.expert_cache import ExpertCache
from engine.ops import indices, native, torch_int8
from engine.ops.activations import quantize
from engine.ops.backend import Backend
from engine.ops.experts_pairs import (ARANGE, DequantPart, Gather, Int8Part, Meta, NativePart, Pairs, Part,
                                      TritonPart, gather_experts, group, one_token, routed_native, triton_glu)
from engine.ops.linear import Linear, NativeLinear, Weight
from engine.storage.qtensor import QTensor

Shared = tuple[Linear, Linear, Linear, Linear]  # the shared expert: gate input (1, d), gate, up, down


class Experts:
    """One MoE layer's routed experts (stacks gate, up [E, F, d] and down [E, d, F]) bound to the products that run
    them. `kind` names the products that run them from their stacks; `shared_slices` > 0 where the shared expert runs
    inside the routed experts' products as that many extra experts (`runs_shared`)."""

    kind = ""
    cache: ExpertCache | None = None
    shared_slices = 0
    stacks: tuple[NativeLinear, ...] = ()  # the native kinds' stacks, bound
    reads_cpu_slots = False  # an expert cache's CPU stand-in slots run in this kind's own products
    cpu_rows = False  # a pass's rows go to the CPU, where the products run (the stacks stay in RAM)

    def __init__(self, gate: Weight, up: Weight, down: Weight, backend: Backend):
        """`backend`: the backend on the stacks' device."""
        self.gate, self.up, self.down, self.backend = gate, up, down, backend

    @property
    def n_expert(self) -> int:
        return self.gate.shape[0]

    @property
    def runs_shared(self) -> bool:
        return self.shared_slices > 0

    def raw_stacks(self) -> tuple[torch.Tensor, ...]:
        """The stacks' blocks as [E, bytes of one expert's matrix] (views), for the Triton kernels."""
        return tuple(t.raw.reshape(self.n_expert, -1) for t in (self.gate, self.up, self.down))  # type: ignore[union-attr]

    def meta(self) -> Meta:
        """(type, (rows, cols)) of one expert's gate, up and down matrices."""
        return [(t.qtype, (t.n_rows // self.n_expert, t.n_cols)) for t in (self.gate, self.up, self.down)]  # type: ignore[union-attr]

    def expert_bytes(self) -> int:
        """Stored bytes of one expert's three matrices."""
        return sum(t.nbytes if isinstance(t, QTensor) else t.numel() * t.element_size()
                   for t in (self.gate, self.up, self.down)) // self.n_expert

    def one_call(self, router: Linear, shared: Shared | None) -> OneCall | None:
        """The inputs of the one-call native MoE layer (moe_ffn), or None where it does not run this layer."""
        return None

    def capturable(self) -> str | None:
        """Why a CUDA graph cannot capture these experts' passes, or None where it can."""
        return "routed experts are not resident in Triton's kernels"

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            shared_gate: torch.Tensor | None) -> torch.Tensor:
        """y[t] = Σ_s w[t,s] · expert idx[t,s](x[t]) (engine.ops.experts.moe_experts)."""
        raise NotImplementedError

    def part(self, p: Pairs) -> Part:
        """What runs a subset of pass `p`'s experts in this kind's products."""
        raise NotImplementedError

    def host_weights(self, ids: list[int]) -> Any:
        """Experts `ids` of the stacks in the form `part`'s parts read."""
        raise NotImplementedError

    def host_gather(self, p: Pairs) -> Gather:
        """Positions into pass `p`'s sorted experts → their weights in the stacks."""
        ids = p.expert_list
        return lambda positions: self.host_weights([ids[j] for j in positions])

    def slot_weights(self, ws: tuple[QTensor, QTensor, QTensor], meta: Meta, n: int) -> Any:
        """n experts gathered from an expert cache's slots ([n·rows, cols] each) in the form `part`'s parts read
        (reads_cpu_slots)."""
        raise NotImplementedError


class FloatExperts(Experts):
    """Float parameters being trained: engine.training's layers run them."""

    kind = "float"

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            shared_gate: torch.Tensor | None) -> torch.Tensor:
        raise TypeError("float experts (training) run in engine.training.layers")


class TritonExperts(Experts):
    """Stacks on a CUDA device in Triton's grouped GEMV: every (token, slot) pair its own product, nothing read back."""

    kind = "triton"

    def capturable(self) -> str | None:
        return None

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            shared_gate: torch.Tensor | None) -> torch.Tensor:
        from engine.ops import triton_q

        n, k = idx.shape
        stacks, meta = self.raw_stacks(), self.meta()
        x = x if x.device == idx.device else x.to(idx.device)
        h = triton_glu(x, meta, stacks, idx.reshape(-1), indices.repeated(n, k, x.device))
        (_, (f, d)), _, (qd, _) = meta
        return triton_q.gemv_slots(stacks[2], qd, d, f, h, idx, w)  # the down products and their weighted sum

    def part(self, p: Pairs) -> Part:
        return TritonPart(p, self.meta())

    def host_weights(self, ids: list[int]) -> Any:
        return self.raw_stacks(), torch.tensor(ids, dtype=torch.long, device=self.gate.device)


def _rows_on_cpu(experts: Experts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 shared_gate: torch.Tensor | None) -> torch.Tensor:
    """The pass with its rows copied to the CPU, where the experts' products run, and its output back."""
    return experts.run(x.cpu(), idx.cpu(), w.cpu(), shared_gate).to(x.device)


class NativeExperts(Experts):
    """Stacks in RAM in the native kernels: a pass in one call (moe_routed), a whole MoE layer in one where the router
    and shared expert are native too (`one_call`)."""

    kind = "native"
    reads_cpu_slots = cpu_rows = True

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, backend: Backend):
        super().__init__(gate, up, down, backend)
        self.stacks = (NativeLinear(gate, backend), NativeLinear(up, backend), NativeLinear(down, backend))
        self._layer: OneCall | None = None
        self._layer_decided = False

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            shared_gate: torch.Tensor | None) -> torch.Tensor:
        if x.device.type != "cpu":  # a layer on an accelerator whose experts stay in RAM (cpu_moe)
            return _rows_on_cpu(self, x, idx, w, shared_gate)
        return routed_native(x, idx, w, self.stacks, self.backend)

    def part(self, p: Pairs) -> Part:
        return NativePart(p)

    def host_weights(self, ids: list[int]) -> Any:  # the stacks themselves: the kernels read the experts in place
        return self.stacks, torch.tensor(ids, dtype=torch.long)

    def slot_weights(self, ws: tuple[QTensor, QTensor, QTensor], meta: Meta, n: int) -> Any:
        return tuple(NativeLinear(QTensor(q.raw, q.qtype, (n, *shape)), self.backend)
                     for q, (_, shape) in zip(ws, meta)), ARANGE[:n]

    def one_call(self, router: Linear, shared: Shared | None) -> OneCall | None:
        if not self._layer_decided:
            self._layer, self._layer_decided = self._one_call(router, shared), True
        return self._layer

    def _one_call(self, router: Linear, shared: Shared | None) -> OneCall | None:
        rw = float32_weight(router)
        if rw is None or rw.shape[0] != self.n_expert or rw.shape[0] > native.MAX_EXPERTS:
            return None
        n_e = self.n_expert
        stacks = tuple(native.expert_stack(code, raw, n_e, lin.n_rows // n_e, lin.n_cols, 1)
                       for lin in self.stacks for raw, code in [lin.kernel_bytes()])
        nbytes = router.nbytes
        sh_inp, sh = None, ()
        if shared is not None:
            sh_inp = float32_weight(shared[0])
            if sh_inp is None or not all(isinstance(lin, NativeLinear) for lin in shared[1:]):
                return None
            sh = tuple(native.expert_stack(code, raw, 1, lin.n_rows, lin.n_cols, 1)
                       for lin in shared[1:] for raw, code in [lin.kernel_bytes()])  # type: ignore[attr-defined]
            sh_inp = sh_inp.reshape(-1)
            nbytes += sum(lin.nbytes for lin in shared)
        return OneCall(rw, sh_inp, stacks, sh, nbytes)


class Int8Experts(Experts):
    """Q8_0 stacks on the CPU in torch integer products (the torch backend's CPU case); `shared` (the shared expert's
    gate, up, down) runs among the routed experts as `shared_slices` extra experts where it fits."""

    kind = "int8"
    reads_cpu_slots = True

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, backend: Backend,
                 shared: tuple[Weight, Weight, Weight] | None = None):
        super().__init__(gate, up, down, backend)
        if shared is not None and all(isinstance(t, QTensor) for t in shared):
            self.shared_slices = torch_int8.shared_slices((gate, up, down), shared, backend.int8)  # type: ignore[arg-type]
        self.shared = shared if self.shared_slices else None
        self._planes: dict[bool, tuple[torch_int8.Planes, torch_int8.Planes]] = {}

    def planes(self, with_shared: bool) -> tuple[torch_int8.Planes, torch_int8.Planes]:
        """The int8 planes of the stacks (and the shared expert's slices), made on first use."""
        p = self._planes.get(with_shared)
        if p is None:
            p = self._planes[with_shared] = torch_int8.expert_planes(
                self.gate, self.up, self.down, self.shared if with_shared else None)  # type: ignore[arg-type]
        return p

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            shared_gate: torch.Tensor | None) -> torch.Tensor:
        layouts = self.backend.int8
        if shared_gate is not None:
            n, s_n = idx.shape[0], self.shared_slices
            idx = torch.cat([idx, ARANGE[self.n_expert:self.n_expert + s_n].expand(n, s_n)], 1)
            w = torch.cat([w, shared_gate.expand(n, s_n)], 1)
        planes = self.planes(shared_gate is not None)
        if idx.shape[0] == 1:  # one token (a decode step, a draft): its experts are distinct, nothing to group
            return one_token(x, idx[0], w, planes, layouts)
        p = group(x, idx, self.backend, self.n_expert + self.shared_slices)
        local = torch.repeat_interleave(torch.arange(p.experts.numel()), p.counts)
        gate_up, down = torch_int8.select(*planes, p.experts)
        p.out[p.order] = torch_int8.experts(quantize(x, "Q8_0", on_native=False), p.tokens, local, p.count_list,
                                            gate_up, down, layouts)
        return p.reduce(w)

    def part(self, p: Pairs) -> Part:
        return Int8Part(p, self.backend.int8)

    def host_weights(self, ids: list[int]) -> Any:
        return torch_int8.select(*self.planes(False), torch.tensor(ids, dtype=torch.long))

    def slot_weights(self, ws: tuple[QTensor, QTensor, QTensor], meta: Meta, n: int) -> Any:
        g, u, d = (torch_int8.unpack(q.raw, (n, *shape)) for q, (_, shape) in zip(ws, meta))
        return torch_int8.stack_experts(g, u, d)


class DequantExperts(Experts):
    """Any other stored type: each pass's experts gathered and dequantized, a group at a time."""

    kind = "dequant"

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            shared_gate: torch.Tensor | None) -> torch.Tensor:
        p = group(x, idx, self.backend, self.n_expert)
        self.part(p)(list(range(len(p.expert_list))), self.host_gather(p), self.gate.device)
        return p.reduce(w)

    def part(self, p: Pairs) -> Part:
        return DequantPart(p, self.gate, self.up, self.down)  # type: ignore[arg-type]

    def host_weights(self, ids: list[int]) -> Any:
        return tuple(gather_experts(t, ids) for t in (self.gate, self.up, self.down))


class _InPlaceSlots:
    """An expert cache's slots read where they are by Triton's kernels."""

    def __init__(self, cache: ExpertCache):
        self.cache = cache

    def part(self, p: Pairs, host: Part) -> Part:
        return TritonPart(p, self.cache.meta)

    def weights(self, slots: list[int]) -> Any:
        return tuple(self.cache.slots), torch.tensor(slots, dtype=torch.long, device=self.cache.device)


class _KindSlots:
    """CPU stand-ins for an accelerator's slots, run in the bound experts' own products (the same integer path)."""

    def __init__(self, cache: ExpertCache, inner: Experts):
        self.cache, self.inner = cache, inner

    def part(self, p: Pairs, host: Part) -> Part:
        return host

    def weights(self, slots: list[int]) -> Any:
        return self.inner.slot_weights(self.cache.weights(slots), self.cache.meta, len(slots))


class _DequantSlots:
    """An expert cache's slots gathered and dequantized on its device."""

    def __init__(self, cache: ExpertCache, inner: Experts):
        self.cache, self.inner = cache, inner

    def part(self, p: Pairs, host: Part) -> Part:
        return DequantPart(p, self.inner.gate, self.inner.up, self.inner.down)  # type: ignore[arg-type]

    def weights(self, slots: list[int]) -> Any:
        return tuple(q.dequantize().view(len(slots), *shape)
                     for q, (_, shape) in zip(self.cache.weights(slots), self.cache.meta))


class CachedExperts(Experts):
    """Experts in RAM (`inner`, bound) with an ExpertCache of some of them on an accelerator. A pass looks its experts
    up: the hits run from the cache's slots (in place in Triton's kernels where the cache's device runs them; on CPU
    stand-in slots in the inner kind's products; else dequantized on the device), the misses are loaded first
    (miss policy "load") or run by `inner` from its stacks and loaded after the pass ("cpu")."""

    def __init__(self, inner: Experts, cache: ExpertCache, slots_backend: Backend):
        """`slots_backend`: the backend on the cache's device."""
        super().__init__(inner.gate, inner.up, inner.down, inner.backend)
        self.inner, self.cache, self.kind, self.stacks = inner, cache, inner.kind, inner.stacks
        ws = (inner.gate, inner.up, inner.down)
        self.cache_triton = slots_backend.kind == "triton" and _triton_binds(ws)
        self._slots = _InPlaceSlots(cache) if self.cache_triton else \
            _KindSlots(cache, inner) if cache.device.type == "cpu" and inner.reads_cpu_slots else \
            _DequantSlots(cache, inner)

    def run(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
            shared_gate: torch.Tensor | None) -> torch.Tensor:
        if self.inner.cpu_rows and x.device.type != "cpu":
            return _rows_on_cpu(self, x, idx, w, shared_gate)
        cache, inner, slots = self.cache, self.inner, self._slots
        p = group(x, idx, self.backend, self.n_expert)
        host = inner.part(p)
        experts = p.expert_list
        hits, misses = cache.lookup(experts)
        if cache.miss_policy == "load":  # wait for the copies, then everything runs on the accelerator
            hits.update(cache.load(misses, set(experts)))
        on_host = [j for j, e in enumerate(experts) if e not in hits]
        cached = [j for j, e in enumerate(experts) if e in hits]
        if cached:
            slots.part(p, host)(cached, lambda positions: slots.weights([hits[experts[j]] for j in positions]),
                                cache.device)
        if on_host:
            host(on_host, inner.host_gather(p), self.gate.device)
            if cache.miss_policy == "cpu":  # computed on the CPU this time; cached for the next passes
                cache.load([experts[j] for j in on_host], set(experts))
        if self.cache_triton:  # summed where the slots are, as the resident stacks' one launch sums (TritonExperts.run)
            from engine.ops import triton_q

            dev = cache.device
            return triton_q.slot_sum(p.out.view(-1, p.k, p.out.shape[1]).to(dev), w.to(dev)).to(p.out.device)
        return p.reduce(w)


@dataclass(frozen=True, eq=False)
class OneCall:
    """What moe_layer reads for one layer, made once: float32 router and gate input, and the stacks' descriptors."""

    router: torch.Tensor
    shared_inp: torch.Tensor | None
    stacks: tuple[native.ExpertStack, ...]
    shared: tuple[native.ExpertStack, ...]
    nbytes: int  # the weight bytes a pass reads besides its experts' (router, shared expert)


def float32_weight(lin: Linear) -> torch.Tensor | None:
    """A float32 weight's values on the CPU, as a contiguous [out, in] tensor (None for any other weight)."""
    w = lin.weight
    if isinstance(w, QTensor):
        if w.qtype != QT.F32 or w.raw.device.type != "cpu":
            return None
        return w.raw.view(torch.float32).view(lin.n_rows, lin.n_cols)
    return None


def _triton_binds(ws: tuple[Weight, ...]) -> bool:
    from engine.ops import triton_q

    return all(isinstance(t, QTensor) and triton_q.binds(t.qtype, t.n_cols) for t in ws)


def bind_experts(gate: Weight, up: Weight, down: Weight, backend: Backend, device: torch.device | str = "cpu",
                 cache: ExpertCache | None = None, shared: tuple[Weight, Weight, Weight] | None = None) -> Experts:
    """A MoE layer's routed experts (stacks gate, up [E, F, d] and down [E, d, F]) bound to the products that run
    them. `device`: where the layer's activations are (the stacks may stay in RAM for a layer on an accelerator:
    then they run there, in the native kernels where the backend has them). `cache`: an expert cache of these stacks
    on an accelerator (the result runs its hits from the slots). `shared` (the shared expert's gate, up, down): run
    inside the routed experts' products where the torch integer products run them without a cache."""
    b = backend.on(gate.device)
    ws = (gate, up, down)
    dev = torch.device(device)
    if not all(isinstance(t, QTensor) for t in ws):
        return FloatExperts(gate, up, down, b)
    if b.kind == "triton" and gate.device.type == dev.type and _triton_binds(ws):
        inner: Experts = TritonExperts(gate, up, down, b)
    elif gate.device.type == "cpu" and b.native and \
            all(native.binds(t.qtype, t.n_cols) for t in ws):  # type: ignore[union-attr]
        inner = NativeExperts(gate, up, down, b)  # type: ignore[arg-type]
    elif dev.type == "cpu" and gate.device.type == "cpu" and \
            all(torch_int8.usable(t, b.int8) for t in ws):  # type: ignore[arg-type]
        inner = Int8Experts(gate, up, down, b, shared if cache is None else None)  # type: ignore[arg-type]
    else:
        inner = DequantExperts(gate, up, down, b)
    return inner if cache is None else CachedExperts(inner, cache, backend.on(cache.device))
