"""A whole decoder layer in one native call (engine/native/layer.c), where the backend runs every piece of it.

The model describes a layer's math op by op (engine.models.qwen35); `fuse_layer` looks at the weights that layer
is built from (a LayerSpec) and, where every product is native, every small tensor float32 on the CPU and the MoE
layer runs in moe.c's one call, binds them once into layer.c's structure. A pass then costs one call instead of
some twenty, each of which carried Python and tensor bookkeeping (bench/step_profile.py). layer.c runs the same
kernels and element-wise expressions as the op-by-op native path in the same order, so the two give the same bits
(tests/test_layer.py); the torch backend stays the twin of both.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.cache import Cache, CapturedStates, ConvSteps, GDNState, KVLayer
from engine.ops import native
from engine.ops.attention import _floats
from engine.ops.backend import Backend, OpEvent
from engine.ops.delta_rule import state_replay
from engine.ops.experts import Experts, Shared
from engine.ops.linear import Linear, NativeLinear, Weight, native_rows, stack_of
from engine.ops.thread_choice import ThreadChoice


@dataclass(frozen=True)
class GDNSpec:
    qkv: Linear
    gate: Linear  # z
    beta: Linear
    alpha: Linear
    out: Linear
    a: torch.Tensor  # [H_v]
    dt_bias: torch.Tensor  # [H_v]
    taps: torch.Tensor  # [K, C]
    norm: torch.Tensor  # [d_v]
    hk: int
    hv: int
    dk: int
    dv: int


@dataclass(frozen=True)
class AttentionSpec:
    q: Linear  # per head [query rows ; gate rows]
    k: Linear
    v: Linear
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    h: int
    h_kv: int
    dk: int
    dv: int
    n_rot: int
    scale: float


@dataclass(frozen=True)
class MoESpec:
    router: Linear
    experts: Experts
    shared: Shared | None
    k_used: int


@dataclass(frozen=True)
class DenseSpec:
    gate: Linear
    up: Linear
    down: Linear


@dataclass(frozen=True)
class LayerSpec:
    """A decoder layer as the model holds it: its two norms, its mixer and its FFN."""

    attn_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    mixer: GDNSpec | AttentionSpec
    ffn: MoESpec | DenseSpec


class FusedLayer:
    """A layer bound to layer.c: call it with a pass's rows and the layer's state."""

    def __init__(self, w: native.LayerW, keep: list, backend: Backend, spec: LayerSpec, nbytes: int):
        self.w, self._keep, self.backend, self.spec, self.nbytes = w, keep, backend, spec, nbytes
        self.p = native.LayerPass()
        self._routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # router logits and weights by n: scratch

    def __call__(self, x: torch.Tensor, state: GDNState | KVLayer, pos: int,
                 rope: tuple[torch.Tensor, torch.Tensor], capture: CapturedStates | None,
                 il: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output rows for x [n, d] and, for a MoE layer, the pass's top-k ids [n, k] (a new tensor). A
        float32 contiguous x is overwritten with the output (the model passes each layer's output on to the next
        and keeps none: a copy per layer was Python time in every step); any other x is copied."""
        obs = self.backend.observer
        t0 = time.perf_counter() if obs is not None else 0.0
        b, p, spec = self.backend, self.p, self.spec
        n = x.shape[0]
        out = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        p.x, p.n, p.pos, p.isa = out.data_ptr(), n, pos, b.level
        p.threads = b.threads if b.threads is not None else torch.get_num_threads()
        m = spec.mixer
        after = None
        if isinstance(m, GDNSpec):
            after = self._gdn_operands(m, state, n, capture, il)  # type: ignore[arg-type]
        else:
            kv: KVLayer = state  # type: ignore[assignment]
            p.kc, p.vc = kv.k.data_ptr(), kv.v.data_ptr()
            p.cos_t, p.sin_t = rope[0][pos].data_ptr(), rope[1][pos].data_ptr()
        idx = None
        if isinstance(spec.ffn, MoESpec):
            e_n, k = spec.ffn.experts.n_expert, spec.ffn.k_used
            scratch = self._routing.get(n)
            if scratch is None:
                scratch = (torch.empty(n, e_n), torch.empty(n, k))
                if n <= 16:  # decode and verify sizes; a prompt's passes allocate theirs
                    self._routing[n] = scratch
            idx = torch.empty(n, k, dtype=torch.long)  # returned: the routing statistics keep it
            p.logits, p.wts, p.idx = scratch[0].data_ptr(), scratch[1].data_ptr(), idx.data_ptr()
        native.decoder_layer(self.w, p)
        if after is not None:
            after()
        if obs is not None:
            nbytes, distinct = self.nbytes, 0
            if idx is not None:
                distinct = int(torch.unique(idx).numel())
                nbytes += distinct * spec.ffn.experts.expert_bytes()  # type: ignore[union-attr]
            obs(OpEvent("layer", nbytes, n, time.perf_counter() - t0, distinct))
        return out, idx

    def _gdn_operands(self, m: GDNSpec, st: GDNState, n: int, capture: CapturedStates | None, il: int):  # type: ignore[no-untyped-def]
        p = self.p
        kk, c = m.taps.shape
        if not st.conv.is_contiguous():
            st.conv = st.conv.contiguous()
        window = torch.empty(kk - 1 + n, c)
        p.conv, p.window = st.conv.data_ptr(), window.data_ptr()
        S = st.ssm
        if capture is None:
            p.s_in = p.s_out = S.data_ptr()
            p.q = p.k = p.v = p.beta = p.decay = None

            def after() -> None:
                st.conv = window[n:]
            return after
        live = st.spare if st.spare is not None else torch.empty_like(S)
        ins = _recurrence_inputs(m, n)
        p.s_in, p.s_out = S.data_ptr(), live.data_ptr()
        p.q, p.k, p.v, p.beta, p.decay = (t.data_ptr() for t in ins)
        return lambda: _keep_captured(st, window, n, S, live, ins, capture, il, self.backend)


class _Passes:
    """FusedStep's passes of one kind — a size n, with or without captured states — the LayerPass array and what its
    pointers point into, set once (a kind of its own for each: a short prompt's pass of a verify's size must not
    leave the verify's windows unset)."""

    def __init__(self, step: FusedStep, n: int):
        self.n = n
        self.ps = (native.LayerPass * len(step.layers))()
        self.keep: list[torch.Tensor] = []
        for p, layer, cnt in zip(self.ps, step.layers, step.counters):
            p.isa = layer.backend.level
            if isinstance(layer.spec.ffn, MoESpec):
                e_n, k = layer.spec.ffn.experts.n_expert, layer.spec.ffn.k_used
                scratch = (torch.empty(n, e_n), torch.empty(n, k), torch.empty(n, k, dtype=torch.long))
                self.keep += scratch
                p.logits, p.wts, p.idx = (t.data_ptr() for t in scratch)
                p.counts = cnt.data_ptr() if cnt is not None else None
        self.threads = -1
        self.inp: native.StepIn | None = None  # a step given token ids: they and the rows they become, kept here
        if step.inp is not None:
            self.ids, self.x = (ctypes.c_int64 * n)(), torch.empty(n, step.d)
            self.inp = native.StepIn.from_buffer_copy(step.inp)
            self.inp.ids = ctypes.addressof(self.ids)
        self.cache: Cache | None = None
        self.gdn: list[tuple[native.LayerPass, GDNState, GDNSpec, int]] = []  # a GDN layer's pass, state, spec, index
        self.bound: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # in-place passes: the states pointed into
        self.captures: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = []  # capture passes: window, inputs

    def bind(self, cache: Cache, layers: list[FusedLayer], ils: list[int]) -> None:
        self.cache, self.gdn = cache, []
        for p, layer, il in zip(self.ps, layers, ils):
            st = cache.gdn.get(il)
            if st is None:
                kv = cache.kv[il]
                p.kc, p.vc = kv.k.data_ptr(), kv.v.data_ptr()
            else:
                self.gdn.append((p, st, layer.spec.mixer, il))  # type: ignore[arg-type]
        self.bound = [None] * len(self.gdn)
        self.captures = []


class FusedStep:
    """A decode step's (or a verify pass's) fused layers, then the final norm and the LM head, in one native call
    (layer.c decoder_layers). What FusedLayer does in Python per layer and pass — operands, scratch, the conv
    window and the state's rebinding, the routing counts — is done once here: each pass size keeps its operands set
    between passes. A pass without captured states refreshes only the states the cache rebound (after a verify, a
    commit, a reset) and each GDN layer writes its new conv state over the old one (in place, so the state must own
    its storage: made so when rebound). A verify (captured states) gives each GDN layer a window and recurrence
    inputs kept for its size — the captured states view them, valid until the next verify of that size, as a
    commit follows each verify — and swaps the recurrent state with its spare as FusedLayer does. Each MoE layer
    counts its routed ids into `counters`. After a step's ~100 MB of weights the interpreter's own code and objects
    are out of the caches and each Python op after the layers cost tens of microseconds: the norm and the head run
    in the same call (where the head's product is native). The thread count of each pass size follows the passes'
    measured times (engine/ops/thread_choice.py: all of the backend's threads, or fewer where they are faster)."""

    def __init__(self, layers: list[FusedLayer], ils: list[int], counters: list[torch.Tensor | None],
                 out_norm: torch.Tensor, eps: float, head: Linear | None, embd: Weight | None = None,
                 mtp: native.MtpIn | None = None):
        self.layers, self.ils, self.counters = layers, ils, counters
        self.ws = (ctypes.c_void_p * len(layers))(*[ctypes.addressof(layer.w) for layer in layers])
        self._keep: list = []
        self.d, self.out = layers[0].spec.attn_norm.numel(), native.StepOut()
        self.out.norm, self.out.eps = _vec(out_norm, self._keep), eps
        self.head = _stack(head, self._keep) if head is not None else None
        self._head = ctypes.pointer(self.head) if self.head is not None else None
        self.n_vocab = head.n_rows if head is not None else 0
        self.mtp = mtp  # the MTP head's step: its input rows from the embeddings and the hidden rows given per pass
        self.inp = _step_in(embd, self.d, self._keep) if embd is not None else None
        self.embeds = self.inp is not None  # __call__ takes token ids
        self._rope: tuple = (None, 0, 0, 0)  # the RoPE tables last given: cos, its and sin's address, row bytes
        self._passes: dict[tuple[int, bool], _Passes] = {}
        self._shared: dict[int, _Passes] = {}  # many(): the passes over all rows (threads, routing), by their count
        self._own: dict[tuple[int, int, bool], _Passes] = {}  # many(): each sequence's passes, by cache, rows, capture
        self._seq_arrays: dict[tuple[int, ...], ctypes.Array] = {}  # many(): their layer-by-sequence pointer arrays
        self.threads = ThreadChoice()  # one thread or more, per pass size, from the passes' times
        self.many_threads = ThreadChoice()  # likewise for passes over several sequences (many)

    def __call__(self, x: torch.Tensor | list[int], cache: Cache, pos: int, rope: tuple[torch.Tensor, torch.Tensor],
                 logits: bool, capture: CapturedStates | None = None,
                 hidden: torch.Tensor | None = None, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pass's rows x [n, d] (float32, contiguous) through every layer (in place, at positions pos…pos+n−1): the
        post-norm hidden rows [n, d] and, with `logits` (and a native head), the logits [n, V]; with `capture`, the
        GDN states after every position go there (as FusedLayer's). Where the step `embeds`, x may be the pass's
        token ids instead: their embedding rows are made in the same call. The MTP head's step (`mtp`) takes the ids
        and the rows `hidden` [n, d] (float32, contiguous) its input is made from, and computes the outputs of its
        rows from `skip` on only: the hidden rows and logits returned are those rows'."""
        ids = x if isinstance(x, list) else None
        n = len(ids) if ids is not None else x.shape[0]  # type: ignore[union-attr]
        if skip and self.mtp is None:
            raise ValueError("only the MTP head's step leaves rows out")
        ps = self._passes.get((n, capture is not None))
        if ps is None:
            ps = self._passes[(n, capture is not None)] = _Passes(self, n)
        threads = self._set_threads(ps, self.threads)
        if cache is not ps.cache:
            ps.bind(cache, self.layers, self.ils)
        after = self._in_place(ps) if capture is None else self._captured(ps, capture)
        h, lg = self._outputs(n, logits)
        cos, sin = rope
        if cos is not self._rope[0]:
            self._rope = (cos, cos.data_ptr(), sin.data_ptr(), cos.stride(0) * cos.element_size())
        _, c0, s0, row = self._rope
        if ids is not None:
            ps.ids[:n] = ids
            x = ps.x
        t0 = time.perf_counter_ns()
        if self.mtp is not None:
            assert ids is not None and ps.inp is not None and hidden is not None and hidden.shape[0] == n
            self.mtp.hidden = hidden.data_ptr()
            native.mtp_layers(self.ws, ps.ps, x, pos, c0 + pos * row, s0 + pos * row, ps.inp, self.mtp,  # type: ignore[arg-type]
                              self.out, skip)
            h, lg = h[skip:], lg[skip:] if lg is not None else None
        else:
            native.decoder_layers(self.ws, ps.ps, x, pos, c0 + pos * row, s0 + pos * row, self.out,  # type: ignore[arg-type]
                                  ps.inp if ids is not None else None)
        self.threads.observe(n, threads, time.perf_counter_ns() - t0)
        if after is not None:
            after()
        return h, lg

    def many(self, ids: list[list[int]], caches: list[Cache], rope: tuple[torch.Tensor, torch.Tensor], logits: bool,
             x: torch.Tensor | None = None, captures: list[CapturedStates | None] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new tokens `ids` of several sequences through every layer in one native call (layer.c
        decoder_layers_many), each sequence's at its cache's positions; where the step does not embed, x gives their
        embedded rows [n, d] (float32, contiguous, overwritten) in sequence order. The products, the MoE and the head
        read their weights once for all rows; each sequence's conv, recurrence and attention run over its own state,
        so each row gets the bits of its sequence's step alone. Caches are not advanced (the caller does, as for
        __call__). `captures`: per sequence, where the GDN states after each of its rows go (a verify among the
        sequences, as __call__'s `capture`), or None."""
        sizes = [len(t) for t in ids]
        n, n_seq = sum(sizes), len(caches)
        shared = self._shared.get(n)
        if shared is None:
            shared = self._shared[n] = _Passes(self, n)
        threads = self._set_threads(shared, self.many_threads)
        own, afters = [], []
        for j, (cache, k) in enumerate(zip(caches, sizes)):
            cap = captures[j] if captures is not None else None
            key = (id(cache), k, cap is not None)
            ps = self._own.get(key)
            if ps is None or ps.cache is not cache:
                if len(self._own) >= 64:  # caches come and go with the server's slots: keep those of the recent ones
                    self._own.clear()
                ps = self._own[key] = _Passes(self, k)
                ps.bind(cache, self.layers, self.ils)
                for p in ps.ps:
                    p.n, p.isa = k, self.layers[0].backend.level
            if cap is None:
                self._in_place(ps)
            else:
                afters.append(self._captured(ps, cap))
            own.append(ps)
        key = tuple(id(ps) for ps in own)
        seqs = self._seq_arrays.get(key)
        if seqs is None:
            if len(self._seq_arrays) >= 64:
                self._seq_arrays.clear()
            seqs = self._seq_arrays[key] = (ctypes.c_void_p * (len(self.layers) * n_seq))(
                *[ctypes.addressof(ps.ps[i]) for i in range(len(self.layers)) for ps in own])
        cos, sin = rope
        row = cos.stride(0) * cos.element_size()
        pos = (ctypes.c_int64 * n_seq)(*[c.pos for c in caches])
        c0, s0 = cos.data_ptr(), sin.data_ptr()
        cos_t = (ctypes.c_void_p * n_seq)(*[c0 + c.pos * row for c in caches])
        sin_t = (ctypes.c_void_p * n_seq)(*[s0 + c.pos * row for c in caches])
        h, lg = self._outputs(n, logits)
        if x is None:
            if shared.inp is None:
                raise ValueError("this step does not embed: give it the sequences' embedded rows")
            shared.ids[:n] = [t for toks in ids for t in toks]
        t0 = time.perf_counter_ns()
        native.decoder_layers_many(self.ws, shared.ps, seqs, n_seq, shared.x if x is None else x, pos, cos_t, sin_t,
                                   self.out, shared.inp if x is None else None)
        self.many_threads.observe(n, threads, time.perf_counter_ns() - t0)
        for after in afters:
            after()
        return h, lg

    def _set_threads(self, ps: _Passes, choice: ThreadChoice) -> int:
        """The thread count `choice` picks for ps's size, set in its passes where it changed."""
        b = self.layers[0].backend
        threads = choice.pick(ps.n, b.threads if b.threads is not None else torch.get_num_threads())
        if threads != ps.threads:
            for p in ps.ps:
                p.threads = threads
            ps.threads = threads
        return threads

    def _outputs(self, n: int, logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The post-norm hidden rows [n, d] and, where asked and the head is native, the logits [n, V] a pass writes,
        set in the step's StepOut."""
        h = torch.empty(n, self.d)
        lg = torch.empty(n, self.n_vocab) if logits and self.head is not None else None
        out = self.out
        out.h, out.logits = h.data_ptr(), lg.data_ptr() if lg is not None else None
        out.head = self._head if lg is not None else None
        return h, lg

    def pass_threads(self, n: int, capture: bool = False) -> list[int]:
        """The thread count each layer of the n-row pass (with or without captured states) was last given."""
        ps = self._passes.get((n, capture))
        return [p.threads for p in ps.ps] if ps is not None else []

    @staticmethod
    def _in_place(ps: _Passes) -> None:
        for i, (p, st, _, _) in enumerate(ps.gdn):
            bound = ps.bound[i]
            if bound is None or bound[0] is not st.conv or bound[1] is not st.ssm:
                if not st.conv.is_contiguous() or st.conv.untyped_storage().nbytes() != st.conv.nbytes:
                    st.conv = st.conv.clone()  # its own storage: written in place (a window's view may be read)
                p.conv, p.window, p.s_in = st.conv.data_ptr(), None, st.ssm.data_ptr()
                p.s_out, p.q, p.k, p.v, p.beta, p.decay = p.s_in, None, None, None, None, None
                ps.bound[i] = (st.conv, st.ssm)

    def _captured(self, ps: _Passes, capture: CapturedStates) -> Callable[[], None]:
        n = ps.n
        if not ps.captures:
            for p, _, m, _ in ps.gdn:
                kk, c = m.taps.shape
                ins = _recurrence_inputs(m, n)
                window = torch.empty(kk - 1 + n, c)
                p.window = window.data_ptr()
                p.q, p.k, p.v, p.beta, p.decay = (t.data_ptr() for t in ins)
                ps.captures.append((window, ins))
        swaps = []
        for i, ((p, st, _, _), (window, _)) in enumerate(zip(ps.gdn, ps.captures)):
            if not st.conv.is_contiguous() or st.conv.untyped_storage().data_ptr() == window.untyped_storage().data_ptr():
                st.conv = st.conv.clone()  # a view of this window (a verify not yet committed): read before overwritten
            if st.spare is None:
                st.spare = torch.empty_like(st.ssm)
            p.conv, p.s_in, p.s_out = st.conv.data_ptr(), st.ssm.data_ptr(), st.spare.data_ptr()
            swaps.append((st, st.ssm, st.spare))
        backend = self.layers[0].backend

        def after() -> None:
            for (st, start, live), (_, _, _, il), (window, ins) in zip(swaps, ps.gdn, ps.captures):
                _keep_captured(st, window, n, start, live, ins, capture, il, backend)
        return after


def fuse_step(layers: list[FusedLayer | None], ils: list[int], counters: list[torch.Tensor | None],
              out_norm: torch.Tensor, eps: float, head: Linear, embd: Weight | None = None) -> FusedStep | None:
    """The fused layers, the final norm and (where its product is native) the head as one call per decode step, and
    with `embd` (the token embeddings, where dequant_rows reads them) the step's embedding rows too; None where a
    layer is not fused or reports to an observer, or the norm is not a float32 CPU tensor."""
    if not layers or any(layer is None or layer.backend.observer is not None for layer in layers) \
            or not _floats(out_norm):
        return None
    return FusedStep(layers, ils, counters, out_norm, eps, head, embd)  # type: ignore[arg-type]


def fuse_mtp_step(layer: FusedLayer | None, il: int, counter: torch.Tensor | None, eh_proj: Linear,
                  enorm: torch.Tensor, hnorm: torch.Tensor, head_norm: torch.Tensor, eps: float, embd: Weight,
                  head: Linear) -> FusedStep | None:
    """The MTP head's pass in one call (layer.c mtp_layers): its input rows from the tokens' embeddings and the hidden
    rows, its layer, the shared head norm, and the head's product where drafts use it whole (a head with a sketch
    stays with the caller: a draft scores the sketch); None where a piece is not native or not a float32 CPU
    tensor. `counter`: where its MoE layer counts its routed ids (as fuse_step's counters)."""
    from engine.ops.draft_head import sketch_of

    if layer is None or layer.backend.observer is not None or not isinstance(eh_proj, NativeLinear) \
            or eh_proj.weight.device.type != "cpu" or not _floats(enorm, hnorm, head_norm):
        return None
    keep: list = []
    mtp = native.MtpIn()
    mtp.enorm, mtp.hnorm, mtp.eh, mtp.eps = _vec(enorm, keep), _vec(hnorm, keep), _stack(eh_proj, keep), eps
    whole = isinstance(head, NativeLinear) and head.weight.device.type == "cpu" and sketch_of(head) is None
    step = FusedStep([layer], [il], [counter], head_norm, eps, head if whole else None, embd, mtp)
    if not step.embeds:
        return None
    step._keep += keep
    return step


def _step_in(embd: Weight, d: int, keep: list) -> native.StepIn | None:
    """layer.c's StepIn for the embedding table (its ids set per pass), or None where dequant_rows cannot read it."""
    t = native_rows(embd)
    if t is None or t.n_cols != d:
        return None
    keep.append(t.raw)
    s = native.StepIn()
    s.table, s.row_bytes, s.n_rows, s.qtype = t.raw.data_ptr(), t.raw.shape[1], t.raw.shape[0], int(t.qtype)
    return s


def _recurrence_inputs(m: GDNSpec, n: int) -> tuple[torch.Tensor, ...]:
    """Where a verify's recurrence inputs go (q, k [n, H_k, d_k], v [n, H_v, d_v], β, e^g [n, H_v]): kept for the
    states a commit re-runs."""
    return (torch.empty(n, m.hk, m.dk), torch.empty(n, m.hk, m.dk), torch.empty(n, m.hv, m.dv),
            torch.empty(n, m.hv), torch.empty(n, m.hv))


def _keep_captured(st: GDNState, window: torch.Tensor, n: int, start: torch.Tensor, live: torch.Tensor,
                   ins: tuple[torch.Tensor, ...], capture: CapturedStates, il: int, backend: Backend) -> None:
    """After a native verify pass of n rows over one GDN layer (from state `start` into `live`, its conv window and
    recurrence inputs kept): the layer's states, and the per-position ones a commit reads."""
    st.conv = window[n:]
    st.ssm, st.spare = live, start
    capture.conv[il] = ConvSteps(window, window.shape[0] - n + 1)
    capture.ssm[il] = state_replay(start, live, ins, backend)


def _stack(lin: Linear, keep: list) -> native.ExpertStack:
    """A native matrix as a stack of one expert, for layer.c's products."""
    assert isinstance(lin, NativeLinear)
    raw, code = lin.kernel_bytes()
    keep.append(raw)
    return native.expert_stack(code, raw, 1, lin.n_rows, lin.n_cols, 1)


def _parts(lins: tuple[Linear, ...], keep: list) -> native.Parts:
    """Native matrices over one input as layer.c's Parts: their stacked product where the op-by-op path stacks
    them, else each in its own type (a mix gives a layer's projections different types)."""
    stacked = stack_of(lins)
    stacks = [_stack(lin, keep) for lin in ((stacked,) if stacked is not None else lins)]
    p = native.Parts()
    for i, s in enumerate(stacks):
        p.part[i] = s
    p.n = len(stacks)
    return p


def _vec(t: torch.Tensor, keep: list) -> int:
    c = t.detach().float().contiguous()
    keep.append(c)
    return c.data_ptr()


def fuse_layer(spec: LayerSpec, backend: Backend) -> FusedLayer | str:
    """The layer bound to layer.c, or why it runs op by op (the piece that does not run natively)."""
    if not backend.native or not native.available():
        return f"the {backend.name} backend has no native layer"
    m, f = spec.mixer, spec.ffn
    small = [spec.attn_norm, spec.post_norm] + ([m.a, m.dt_bias, m.taps, m.norm] if isinstance(m, GDNSpec)
                                                else [m.q_norm, m.k_norm])
    if not _floats(*small):
        return "a norm or GDN vector is not a float32 CPU tensor"
    keep: list = []
    w = native.LayerW()
    w.attn_norm, w.post_norm, w.d, w.eps = _vec(spec.attn_norm, keep), _vec(spec.post_norm, keep), \
        spec.attn_norm.numel(), spec.eps
    if isinstance(m, GDNSpec):
        named = {"GDN qkv": m.qkv, "GDN gate": m.gate, "GDN beta": m.beta, "GDN alpha": m.alpha, "GDN out": m.out}
        if (why := _not_native(named)) is not None:
            return why
        if m.hv % m.hk:
            return f"GDN value heads ({m.hv}) are not a multiple of its key heads ({m.hk})"
        ins, out = _parts((m.qkv, m.gate, m.beta, m.alpha), keep), _stack(m.out, keep)
        kk, c = m.taps.shape
        w.attention = 0
        w.gdn = native.GdnW(ins, out, _vec(m.taps, keep), _vec(m.a, keep), _vec(m.dt_bias, keep),
                            _vec(m.norm, keep), c, kk, m.hk, m.hv, m.dk, m.dv)
    else:
        named = {"attention q": m.q, "attention k": m.k, "attention v": m.v, "attention output": m.o}
        if (why := _not_native(named)) is not None:
            return why
        if m.h % m.h_kv or m.dk != m.dv:
            return f"attention heads {m.h} over {m.h_kv} KV heads, key width {m.dk}, value width {m.dv}"
        ins, out = _parts((m.q, m.k, m.v), keep), _stack(m.o, keep)
        w.attention = 1
        w.attn = native.AttnW(ins, out, _vec(m.q_norm, keep), _vec(m.k_norm, keep), m.h, m.h_kv, m.dk, m.dv,
                              m.n_rot, m.scale)
    mixer_bytes = sum(lin.nbytes for lin in named.values())
    if isinstance(f, MoESpec):
        one = f.experts.one_call(f.router, f.shared)
        if one is None:
            return f"the MoE layer ({f.experts.kind} experts) has no one-call native form"
        keep.append(one)
        empty = native.ExpertStack()
        sg, su, sd = one.shared if one.shared else (empty, empty, empty)
        w.ffn = native.FfnW(one.router.data_ptr(), one.shared_inp.data_ptr() if one.shared_inp is not None else None,
                            sg, su, sd, *one.stacks, native.Parts(), f.k_used, f.experts.n_expert, 0, 0)
        ffn_bytes = one.nbytes
    else:
        if (why := _not_native({"FFN gate": f.gate, "FFN up": f.up, "FFN down": f.down})) is not None:
            return why
        gu, down = _parts((f.gate, f.up), keep), _stack(f.down, keep)
        empty = native.ExpertStack()
        w.ffn = native.FfnW(None, None, empty, empty, down, empty, empty, empty, gu, 0, 0, 1, 0)
        ffn_bytes = f.gate.nbytes + f.up.nbytes + f.down.nbytes
    return FusedLayer(w, keep, backend, spec, mixer_bytes + ffn_bytes)


def _not_native(named: dict[str, Linear]) -> str | None:
    """The first of the named matrices whose product is not native, and its type; None where all are."""
    for name, lin in named.items():
        if not isinstance(lin, NativeLinear):
            qtype = getattr(lin.weight, "qtype", None)
            kind = qtype.name if qtype is not None else str(lin.weight.dtype).removeprefix("torch.")
            return f"{name} ({kind}) runs a {lin.kind} product, not a native one"
    return None


def link_layers(layers: list[FusedLayer | None], head: Linear | None) -> None:
    """Tell each fused layer what the pass reads after it (the next layer's input projection; after the last, the
    output head's bytes where its product is native: packed now, where the backend packs it, so the bytes named are
    the ones its products read), so that the pool's workers fetch those over the gap between the two calls (layer.c:
    pool_prefetch). Only bytes kept alive elsewhere are named: a layer's stacks live in its `keep`, the head's in the
    Linear."""
    for cur, nxt in zip(layers, [*layers[1:], None]):
        if cur is None:
            continue
        cur.w.next_p = cur.w.next_end = None
        t: torch.Tensor | None = None
        if nxt is not None:
            s = (nxt.w.attn.in_ if nxt.w.attention else nxt.w.gdn.in_).part[0]  # the first, and largest, part
            cur.w.next_p, cur.w.next_end = s.w, s.w + s.expert_bytes
        elif isinstance(head, NativeLinear):
            head.pack()
            t = head.packed if head.packed is not None else head.weight.raw
        if t is not None and t.is_contiguous():
            cur.w.next_p, cur.w.next_end = t.data_ptr(), t.data_ptr() + t.nbytes
