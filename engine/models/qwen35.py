"""Qwen3.5 / Qwen3.6 hybrid models (`qwen35moe`, `qwen35`), as llama.cpp computes them (spec §3).

Read top to bottom: RoPE tables → gated attention → Gated DeltaNet → FFN (MoE or dense) → decoder layer →
model (trunk forward, LM head). The layers describe the math and call engine.ops for every product, attention and
recurrence: their weights come bound to the kernels that run them (engine.models.build), so nothing here names a
weight format or a kernel. Every op is batch-invariant, so a pass over N tokens gives each token exactly the bits a
one-token pass would. `hook(name, layer, tensor)` sees every named intermediate, as llama.cpp's `cb(cur, name, il)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine import ops
from engine.cache import Cache, CapturedStates, ConvSteps, GDNState, KVLayer
from engine.expert_cache import ExpertCache
from engine.ops import Experts, Linear
from engine.storage.modelfile import HParams
from engine.storage.pages import read_rows
from engine.storage.qtensor import QTensor

Hook = Callable[[str, int, torch.Tensor], None]

# Passes of up to this many rows are decode steps and verify passes (at most engine.events.MAX_DRAFT + 1 rows); longer
# ones process a prompt, or the MTP head's catch-up over one.
STEP_ROWS = 16


def embed_rows(table: ops.Weight, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows `ids` of an embedding table as float32 (ops.embedding). A prompt's rows of a table in the model file are
    read from the file (storage.pages.read_rows): read through its mapping, each left the folio around it mapped in
    this process (64 KiB, or 2 MiB where the page cache holds the file in huge pages: ~300 MiB for a 256-token chunk
    of a 248k vocabulary). A step's few rows are read through the mapping, which costs a decode step less time."""
    if ids.numel() > STEP_ROWS and isinstance(table, QTensor) and len(table.shape) == 2:
        rows = read_rows(table.raw, ids.reshape(-1).tolist())
        if rows is not None:
            table, ids = QTensor(rows, table.qtype, (rows.shape[0], table.n_cols)), torch.arange(rows.shape[0])
    return ops.embedding(table, ids, device=device)


def _noop(name: str, il: int, t: torch.Tensor) -> None:
    return None


def id_tensor(ids: torch.Tensor | list[int]) -> torch.Tensor:
    return ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)


def check_room(cache: Cache, pos: int, n: int) -> None:
    if pos + n > cache.n_ctx:
        raise ValueError(f"{n} tokens at position {pos} exceed the cache of {cache.n_ctx}")


@dataclass
class SeqRows:
    """One sequence's rows in a pass over several sequences (Qwen35Model.several): its cache, its positions, and where
    its rows lie among the pass's."""
    cache: Cache
    at: ops.Positions
    rows: slice


# --- norms and rotary embedding ------------------------------------------------------------------

# Batch invariance: norms and RoPE (ops.rms_norm, ops.l2_norm, ops.rope) work row by row, and small per-token
# transcendentals go through `ops.pointwise`.

def rope_tables(n_ctx: int, n_rot: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n_ctx, n_rot/2] with θ built by repeated float32 multiplication, as ggml does."""
    scale = np.float32(base) ** np.float32(-2.0 / n_rot)
    theta = np.empty((n_ctx, n_rot // 2), np.float32)
    theta[:, 0] = np.arange(n_ctx, dtype=np.float32)
    for i in range(1, n_rot // 2):
        theta[:, i] = theta[:, i - 1] * scale
    t = torch.from_numpy(theta)
    return torch.cos(t), torch.sin(t)


@dataclass
class AttentionWeights:
    q: Linear  # (2·H_q·D, d): per head [query rows ; gate rows]
    k: Linear
    v: Linear
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor


class GatedAttention:
    def __init__(self, hp: HParams, w: AttentionWeights, layer: int, backend: ops.Backend):
        self.hp, self.w, self.il, self.backend = hp, w, layer, backend
        self.scale = 1.0 / math.sqrt(hp.head_dim_k)

    def qkv(self, x: torch.Tensor, at: ops.Positions, rope: tuple[torch.Tensor, torch.Tensor],
            cb: Hook) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed, rotated queries [n, H, D], keys [n, H_kv, D], values [n, H_kv, D_v] and the output gate."""
        w = self.w
        return self.heads(*ops.linear_many(x, (w.q, w.k, w.v)), at, rope, cb)

    def heads(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: ops.Positions,
              rope: tuple[torch.Tensor, torch.Tensor], cb: Hook
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv's part after the projections: one sequence's rows at positions `at`."""
        hp, w, il = self.hp, self.w, self.il
        n, D, Dv = qg.shape[0], hp.head_dim_k, hp.head_dim_v
        qg = qg.reshape(n, hp.n_head, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(n, hp.n_head * D)
        k = k.reshape(n, hp.n_head_kv, D)
        v = v.reshape(n, hp.n_head_kv, Dv)
        q = ops.rms_norm(q, w.q_norm, hp.rms_eps, self.backend)
        k = ops.rms_norm(k, w.k_norm, hp.rms_eps, self.backend)
        cos, sin = ops.rope_rows(rope, at)
        q = ops.rope(q, cos, sin, hp.n_rot, self.backend)
        k = ops.rope(k, cos, sin, hp.n_rot, self.backend)
        cb("Qcur", il, q)
        cb("Kcur", il, k)
        cb("Vcur", il, v)
        return q, k, v, gate

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayer, at: ops.Positions,
               cb: Hook) -> torch.Tensor:
        """One sequence's keys and values into its cache, its queries over it: [n, H·D_v]."""
        ops.kv_write(kv.k, kv.v, k, v, at)
        out = ops.attention(q, kv.k, kv.v, at, self.scale, self.backend)
        cb("attn_out", self.il, out)
        return out

    def output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.linear(ops.sigmoid_gate(out, gate, self.backend), self.w.o)

    def __call__(self, x: torch.Tensor, kv: KVLayer, at: ops.Positions, rope: tuple[torch.Tensor, torch.Tensor],
                 cb: Hook) -> torch.Tensor:
        q, k, v, gate = self.qkv(x, at, rope, cb)
        return self.output(self.attend(q, k, v, kv, at, cb), gate)

    def several(self, x: torch.Tensor, parts: list[SeqRows], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rows of several sequences: the projections over all of them, each sequence's heads and attention over its
        own rows and cache."""
        w = self.w
        qg, k, v = ops.linear_many(x, (w.q, w.k, w.v))
        outs, gates = [], []
        for p in parts:
            q_p, k_p, v_p, gate = self.heads(qg[p.rows], k[p.rows], v[p.rows], p.at, rope, _noop)
            outs.append(self.attend(q_p, k_p, v_p, p.cache.kv[self.il], p.at, _noop))
            gates.append(gate)
        return self.output(torch.cat(outs), torch.cat(gates))


@dataclass
class GDNWeights:
    qkv: Linear  # (C, d): [q (H_k·d_k) ; k (H_k·d_k) ; v (H_v·d_v, tiled head order)]
    gate: Linear  # z, (H_v·d_v, d)
    beta: Linear  # (H_v, d)
    alpha: Linear  # (H_v, d)
    a: torch.Tensor  # ssm_a = −exp(A_log), (H_v,)
    dt_bias: torch.Tensor  # (H_v,)
    conv: torch.Tensor  # (C, K), tap 0 multiplies the oldest input
    norm: torch.Tensor  # (d_v,), plain multiplicative weight
    out: Linear  # (d, H_v·d_v)


class GatedDeltaNet:
    def __init__(self, hp: HParams, w: GDNWeights, layer: int, backend: ops.Backend, chunk: int = 64):
        self.hp, self.w, self.il, self.backend = hp, w, layer, backend
        self.chunk = chunk  # tokens per chunk of the chunk-parallel delta rule
        self._taps: tuple[torch.Tensor, torch.Tensor] | None = None

    def taps(self) -> torch.Tensor:
        """The conv kernel as [K, C], each tap's weights contiguous: a column of the stored (C, K) is strided, and
        a strided operand sends torch's elementwise product down its slow path (several times the time of the
        contiguous one on a verify pass's rows). Made once per kernel tensor, unless it is being trained."""
        c = self.w.conv
        if c.requires_grad:
            return c.t()
        if self._taps is None or self._taps[0] is not c:
            self._taps = (c, c.t().contiguous())
        return self._taps[1]

    def __call__(self, x: torch.Tensor, st: GDNState, cb: Hook, capture: CapturedStates | None,
                 chunked: bool) -> torch.Tensor:
        mixed, z, b, a = self.project(x)  # mixed: [n, C]
        return self.output(self.recur(mixed, b, a, st, cb, capture, chunked), z)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = self.w
        return ops.linear_many(x, (w.qkv, w.gate, w.beta, w.alpha))

    def recur(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, st: GDNState, cb: Hook,
              capture: CapturedStates | None, chunked: bool) -> torch.Tensor:
        """One sequence's conv and delta rule over its projected rows, from and into its state: o [n, H_v, d_v]."""
        hp, w, il = self.hp, self.w, self.il
        n = mixed.shape[0]
        Hk, Hv, dk, K = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_conv_kernel
        # Causal depthwise conv over [state ; new inputs], taps accumulated in a fixed order.
        window = torch.cat([st.conv, mixed], dim=0)  # [K-1+n, C]
        if capture is not None:
            capture.conv[il] = ConvSteps(window, K)  # views of the window, no copy
        st.advance_conv(window, n)
        u, q, k, v, beta, g = ops.gdn_inputs(window, self.taps(), b, a, w.a, w.dt_bias, Hk, dk, hp.rms_eps,
                                             self.backend)
        cb("conv_output_silu", il, u)
        if chunked and capture is None and n > 1:
            o, S = ops.delta_rule_chunked(*ops.tiled(q, k, Hv), v, beta, g, st.ssm, self.chunk)
            st.set_ssm(S)
        else:
            o, states = ops.delta_rule(q, k, v, beta, g, st, self.backend, capture is not None)
            if capture is not None:
                capture.ssm[il] = states
        cb("beta", il, beta)
        cb("gate", il, g)
        cb("attn_output", il, o)
        return o

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated output norm and the output projection of o [n, H_v, d_v]."""
        hp, w = self.hp, self.w
        n, Hv, dv = o.shape[0], hp.ssm_dt_rank, hp.ssm_head_v_dim
        o = ops.rms_norm(o, w.norm, hp.rms_eps, self.backend, gate=ops.silu(z.view(n, Hv, dv), self.backend))
        return ops.linear(o.reshape(n, Hv * dv), w.out)

    def several(self, x: torch.Tensor, parts: list[SeqRows], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rows of several sequences: the projections and the output over all of them, each sequence's recurrence over
        its own rows and state."""
        mixed, z, b, a = self.project(x)
        o = [self.recur(mixed[p.rows], b[p.rows], a[p.rows], p.cache.gdn[self.il], _noop, None, False) for p in parts]
        return self.output(torch.cat(o), z)


class RoutingStats:
    """Per-layer expert usage counts, accumulated across passes (the app's heat map on CPU runs). A pass only
    records its ids; they are counted when `counts` is read (a few times a second), or when many are waiting."""

    FOLD = 256  # passes recorded per layer before they are counted

    def __init__(self) -> None:
        self._counts: dict[int, torch.Tensor] = {}
        self._pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self._live: dict[int, torch.Tensor] = {}  # counts added to where they are (a device, a native step), per layer

    def counter(self, layer: int, n_expert: int, device: torch.device) -> torch.Tensor:
        """Layer's counts [n_expert] (int64) on `device`, which its passes add to themselves: on an accelerator
        (nothing read back per pass; a captured step's replays count too) or in a native decode step's one call."""
        c = self._live.get(layer)
        if c is None:
            c = self._live[layer] = torch.zeros(n_expert, dtype=torch.long, device=device)
        return c

    def add(self, layer: int, experts: torch.Tensor, n_expert: int) -> None:
        if experts.device.type != "cpu":  # counted where the ids are
            flat = experts.reshape(-1)
            self.counter(layer, n_expert, experts.device).index_add_(0, flat, torch.ones_like(flat))
            return
        _, ids = self._pending.setdefault(layer, (n_expert, []))
        ids.append(experts.reshape(-1))
        if len(ids) >= self.FOLD:
            self._fold(layer)

    def _fold(self, layer: int) -> None:
        n_expert, ids = self._pending.pop(layer)
        c = torch.bincount(torch.cat(ids).cpu(), minlength=n_expert)
        self._counts[layer] = self._counts[layer] + c if layer in self._counts else c

    @property
    def counts(self) -> dict[int, torch.Tensor]:
        for layer in list(self._pending):
            self._fold(layer)
        if not self._live:
            return self._counts
        out = dict(self._counts)
        for layer, c in self._live.items():
            if layer in out:
                out[layer] = out[layer] + c.cpu()
            elif bool(c.any()):  # a counter made where passes will count (a fused step's) holds nothing until they do
                out[layer] = c.cpu().clone()
        return out


@dataclass
class MoEWeights:
    router: Linear  # (E, d), F32
    experts: Experts  # routed experts, bound (engine.ops.Experts)
    shared_gate_inp: Linear | None  # (1, d)
    shared_gate: Linear | None
    shared_up: Linear | None
    shared_down: Linear | None

    @property
    def shared(self) -> ops.Shared | None:
        if self.shared_gate_inp is None or self.shared_gate is None or self.shared_up is None or self.shared_down is None:
            return None
        return self.shared_gate_inp, self.shared_gate, self.shared_up, self.shared_down


class MoE:
    def __init__(self, hp: HParams, w: MoEWeights, layer: int, stats: RoutingStats | None = None):
        self.hp, self.w, self.il, self.stats = hp, w, layer, stats

    @property
    def cache(self) -> ExpertCache | None:
        return self.w.experts.cache

    def experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                shared_gate: torch.Tensor | None) -> torch.Tensor:
        return ops.moe_experts(x, idx, weights, self.w.experts, shared_gate)

    def __call__(self, x: torch.Tensor, cb: Hook) -> torch.Tensor:
        hp, w, il = self.hp, self.w, self.il
        out = ops.moe_ffn(x, w.router, w.experts, w.shared, hp.n_expert_used, twin=lambda t: self.math(t, cb))
        cb("ffn_moe_logits", il, out.logits)
        cb("ffn_moe_weights_norm", il, out.weights)
        if self.stats is not None:
            self.stats.add(il, out.idx, hp.n_expert)
        return out.y

    def math(self, x: torch.Tensor, cb: Hook) -> ops.MoEOut:
        """The layer op by op (ops.moe_ffn runs it in one native call where it can): routing (router, softmax, top k,
        renormalised; the shared expert's gate), the routed experts, and the shared expert weighted by its gate."""
        hp, w, il = self.hp, self.w, self.il
        logits, weights, idx, sgate = ops.moe_route(x, w.router, w.shared_gate_inp, hp.n_expert_used)
        inside = w.experts.runs_shared
        y = self.experts(x, idx, weights, sgate if inside else None)
        cb("ffn_moe_out", il, y)
        if w.shared_gate is not None and not inside:
            sh = ops.swiglu(x, w.shared_gate, w.shared_up)  # type: ignore[arg-type]
            sh = ops.linear(sh, w.shared_down) * sgate  # type: ignore[arg-type,operator]
            cb("ffn_shexp", il, sh)
            y = y + sh
        return ops.MoEOut(y, logits, weights, idx)


@dataclass
class DenseWeights:
    gate: Linear
    up: Linear
    down: Linear


class DenseFFN:
    def __init__(self, w: DenseWeights):
        self.w = w

    def __call__(self, x: torch.Tensor, cb: Hook) -> torch.Tensor:
        return ops.linear(ops.swiglu(x, self.w.gate, self.w.up), self.w.down)


class DecoderLayer:
    def __init__(self, il: int, attn_norm: torch.Tensor, post_norm: torch.Tensor,
                 mixer: GatedAttention | GatedDeltaNet, ffn: MoE | DenseFFN, eps: float, device: torch.device,
                 backend: ops.Backend):
        self.il, self.attn_norm, self.post_norm, self.mixer, self.ffn, self.eps = il, attn_norm, post_norm, mixer, ffn, eps
        self.device, self.backend = device, backend

    def state(self, cache: Cache) -> GDNState | KVLayer:
        """This layer's part of a sequence's cache: its GDN state, or its attention KV."""
        return cache.gdn[self.il] if isinstance(self.mixer, GatedDeltaNet) else cache.kv[self.il]

    def routed(self, idx: torch.Tensor) -> None:
        """Count a pass's routed expert ids in the model's routing statistics (a pass that ran the layer in one
        native call reports them here; op by op, MoE counts its own)."""
        if isinstance(self.ffn, MoE) and self.ffn.stats is not None:
            self.ffn.stats.add(self.il, idx, self.ffn.hp.n_expert)

    def routing_counter(self) -> torch.Tensor | None:
        """The counts [n_expert] a native decode step adds this layer's routed ids to (None: not a MoE layer, or
        one whose routing is not counted)."""
        f = self.ffn
        if not isinstance(f, MoE) or f.stats is None:
            return None
        return f.stats.counter(self.il, f.hp.n_expert, torch.device("cpu"))

    def capturable(self) -> str | None:
        """Why this layer's passes cannot be recorded as a CUDA graph (None: they can): every kernel Triton's, no op
        observer (its events read results on the host), routed experts resident in Triton's kernels."""
        if self.backend.kind != "triton":
            return f"layer {self.il} runs on the {self.backend.name} backend, not Triton's"
        if self.backend.observer is not None:
            return "op observers read results on the host"
        if isinstance(self.ffn, MoE):
            why = self.ffn.w.experts.capturable()
            if why is not None:
                return f"layer {self.il}'s {why}"
        return None

    def spec(self) -> ops.LayerSpec:
        """The layer's weights, for ops.fuse_layer."""
        hp, m, f = self.mixer.hp, self.mixer, self.ffn
        mixer: ops.GDNSpec | ops.AttentionSpec
        if isinstance(m, GatedDeltaNet):
            w = m.w
            mixer = ops.GDNSpec(w.qkv, w.gate, w.beta, w.alpha, w.out, w.a, w.dt_bias, m.taps(), w.norm,
                                hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim)
        else:
            a = m.w
            mixer = ops.AttentionSpec(a.q, a.k, a.v, a.o, a.q_norm, a.k_norm, hp.n_head, hp.n_head_kv, hp.head_dim_k,
                                      hp.head_dim_v, hp.n_rot, m.scale)
        ffn = ops.MoESpec(f.w.router, f.w.experts, f.w.shared, hp.n_expert_used) if isinstance(f, MoE) \
            else ops.DenseSpec(f.w.gate, f.w.up, f.w.down)
        return ops.LayerSpec(self.attn_norm, self.post_norm, self.eps, mixer, ffn)

    def __call__(self, x: torch.Tensor, cache: Cache, at: ops.Positions, rope: tuple[torch.Tensor, torch.Tensor],
                 cb: Hook, capture: CapturedStates | None, chunked: bool) -> torch.Tensor:
        """out = h + ffn(norm(h)), h = x + mixer(norm(x)), op by op: what hooks see (engine.models.runner runs the
        same layer in one native call where the backend can, with the same bits)."""
        il = self.il
        a = ops.rms_norm(x, self.attn_norm, self.eps, self.backend)
        cb("attn_norm", il, a)
        if isinstance(self.mixer, GatedDeltaNet):
            y = self.mixer(a, cache.gdn[il], cb, capture, chunked)
            if capture is None:  # a verify pass's window stays: its ConvSteps view it until the commit
                cache.gdn[il].own_conv()
        else:
            y = self.mixer(a, cache.kv[il], at, rope, cb)
        cb("attn_residual_in", il, y)
        h = x + y
        f = ops.rms_norm(h, self.post_norm, self.eps, self.backend)
        cb("attn_post_norm", il, f)
        out = h + self.ffn(f, cb)
        cb("l_out", il, out)
        return out


    def several(self, x: torch.Tensor, parts: list[SeqRows], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The layer over rows of several sequences (SeqRows): norms, the mixer's projections and the FFN over all rows
        at once (one read of the weights), each sequence's attention or recurrence over its own rows and state."""
        a = ops.rms_norm(x, self.attn_norm, self.eps, self.backend)
        h = x + self.mixer.several(a, parts, rope)
        if isinstance(self.mixer, GatedDeltaNet):
            for p in parts:
                p.cache.gdn[self.il].own_conv()
        return h + self.ffn(ops.rms_norm(h, self.post_norm, self.eps, self.backend), _noop)


# --- the model -----------------------------------------------------------------------------------

@dataclass
class ForwardResult:
    hidden: torch.Tensor  # post-final-norm hidden rows [N, d] (what the LM head and the MTP head read)
    logits: torch.Tensor | None  # [len(logit_rows), V]
    captured: CapturedStates | None


class Qwen35Model:
    """The trunk of a qwen35 / qwen35moe GGUF (and its MTP block, `mtp`, when present), as built by
    engine.models.build: layers on their devices, weights bound to their kernels. The math only: `forward` runs a
    pass op by op; how a pass is executed in production (one native call, a replayed CUDA graph) is
    engine.models.runner's business."""

    def __init__(self, hp: HParams, layers: list[DecoderLayer], tok_embd: ops.Weight, output: Linear,
                 output_norm: torch.Tensor, n_ctx: int, device: torch.device, accelerator: torch.device,
                 routing: RoutingStats, expert_caches: dict[int, ExpertCache]):
        self.hp = hp
        self.layers = layers
        self.layer_devices = [layer.device for layer in layers]
        self.tok_embd = tok_embd  # row lookups: stays where the file is
        self.output = output
        self.output_norm = output_norm
        self.n_ctx_max = n_ctx
        self.device = device  # final norm, LM head, logits
        self.accelerator = accelerator
        self.routing = routing
        self.expert_caches = expert_caches
        self.mtp = None  # the MTP head (engine.models.mtp.MTPHead), attached by the builder
        self._rope_cpu = rope_tables(n_ctx, hp.n_rot, hp.rope_base)
        self._ropes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables on `dev` (one copy per device in use)."""
        r = self._ropes.get(dev)
        if r is None:
            r = self._ropes[dev] = (self._rope_cpu[0].to(dev), self._rope_cpu[1].to(dev))
        return r

    def new_cache(self, n_ctx: int, fixed: bool = False) -> Cache:
        """A sequence's state; `fixed`: every state kept in the buffers it was allocated in (CUDA graphs record
        their addresses)."""
        return Cache(self.hp, min(n_ctx, self.n_ctx_max), self.device,
                     devices={i: d for i, d in enumerate(self.layer_devices)}, fixed=fixed)

    def embed(self, tokens: torch.Tensor | list[int]) -> torch.Tensor:
        return embed_rows(self.tok_embd, id_tensor(tokens), self.layer_devices[0] if self.layers else self.device)

    def capturable(self) -> str | None:
        """Why the trunk's passes cannot be recorded as CUDA graphs (None: they can): every layer and the LM head on
        one device, and every layer capturable (DecoderLayer.capturable)."""
        dev = self.device
        if any(d != dev for d in self.layer_devices) or self.output.device != dev:
            return "the trunk is split between devices"
        return next((why for why in (layer.capturable() for layer in self.layers) if why is not None), None)

    def forward(self, tokens: torch.Tensor | list[int], cache: Cache, *, logit_rows: str = "last",
                capture: bool = False, chunked: bool = False, hook: Hook | None = None) -> ForwardResult:
        """Run N new tokens at positions cache.pos … cache.pos+N−1 op by op and advance the cache.

        logit_rows: "last", "all" or "none". capture: keep the GDN states after every position (verify).
        chunked: use the chunk-parallel delta rule (long prefills; equal to the recurrence to ~1e-6).
        """
        ids = id_tensor(tokens).reshape(-1)
        n, pos = len(ids), cache.pos
        check_room(cache, pos, n)
        cb = hook or _noop
        x = self.embed(ids)
        cb("inp_embd", -1, x)
        res = self.rows_pass(x, cache, ops.Positions(n, pos), logit_rows, capture, chunked, cb)
        cache.pos = pos + n
        return res

    def rows_pass(self, x: torch.Tensor, cache: Cache, at: ops.Positions, logit_rows: str, capture: bool,
                  chunked: bool = False, cb: Hook = _noop) -> ForwardResult:
        """The trunk over embedded rows x at positions `at`: the body of `forward`, and what a captured step
        records (positions on the device). The caller advances cache.pos."""
        cap = CapturedStates({}, {}) if capture else None
        for layer in self.layers:
            if x.device != layer.device:
                x = x.to(layer.device)
            x = layer(x, cache, at, self.rope(layer.device), cb, cap, chunked)
        return self.finish(x, logit_rows, cap, cb)

    def several(self, x: torch.Tensor, parts: list[SeqRows], all_rows: bool = False) -> ForwardResult:
        """The trunk over embedded rows of several sequences (no hook, no captured states): the post-norm hidden rows of
        all of them and the logits of each sequence's last row (`all_rows`: of every row), in the order of `parts`.
        The caller advances the caches."""
        for layer in self.layers:
            if x.device != layer.device:
                x = x.to(layer.device)
            x = layer.several(x, parts, self.rope(layer.device))
        res = self.finish(x, "none", None)
        res.logits = ops.linear(res.hidden if all_rows else res.hidden[[p.rows.stop - 1 for p in parts]], self.output)
        return res

    def finish(self, x: torch.Tensor, logit_rows: str, cap: CapturedStates | None, cb: Hook = _noop) -> ForwardResult:
        """After the last layer: the final norm and the LM head's rows `logit_rows`."""
        h = ops.rms_norm(x.to(self.device), self.output_norm, self.hp.rms_eps, self.output.backend)
        cb("result_norm", -1, h)
        logits = None
        if logit_rows != "none":
            logits = ops.linear(h if logit_rows == "all" else h[-1:], self.output)
            cb("result_output", -1, logits)
        return ForwardResult(h, logits, cap)
