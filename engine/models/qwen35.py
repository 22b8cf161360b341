"""Qwen3.5 / Qwen3.6 hybrid models (`qwen35moe`, `qwen35`), as llama.cpp computes them (spec §3).

Read top to bottom: norms and RoPE → gated attention → Gated DeltaNet → FFN (MoE or dense) →
decoder layer → model (trunk forward, LM head) → MTP head. Weights stay in their GGUF block formats
(engine.quant.QTensor); every projection is a rowwise product, so a pass over N tokens gives each
token exactly the bits a one-token pass would. `hook(name, layer, tensor)` sees every named
intermediate, as llama.cpp's `cb(cur, name, il)`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from engine import kquant, nativelib, q8dot
from engine.cache import Cache, CapturedStates, ConvSteps, GDNState, KVLayer, StateReplay
from engine.expert_cache import ExpertCache
from engine.experts import ExpertWeights, RoutingStats, SharedExpert, route, run_experts
from engine.modelfile import HParams
from engine.placement import Plan
from engine.quant import QTensor
from engine.rowwise import Weight, project, rowwise_matmul, take_rows

Hook = Callable[[str, int, torch.Tensor], None]


def _noop(name: str, il: int, t: torch.Tensor) -> None:
    return None


# --- norms and rotary embedding ------------------------------------------------------------------

# Batch invariance: ATen runs pointwise transcendentals (exp, rsqrt, sigmoid…) on SIMD lanes for most
# elements but in scalar code for a tensor's tail, and the two can differ in the last bit; a [N, 4]
# tensor is all tail at N = 1 and all SIMD at N = 8. So norms use sqrt and division (correctly rounded
# on both paths), per-token gates are computed per token, and `pointwise` pads small rows.

def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for x [N, L], with each row padded to 64 elements so every element takes the SIMD path."""
    n, length = x.shape
    if length % 64 == 0:
        return fn(x)
    padded = torch.zeros(n, length + (-length) % 64, dtype=x.dtype, device=x.device)
    padded[:, :length] = x
    return fn(padded)[:, :length]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x · 1/sqrt(mean(x²) + eps) · w over the last dim; `w` is the stored GGUF weight (already 1+w)."""
    return x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_l2_norm: x / max(‖x‖, eps)."""
    return x / torch.clamp(x.pow(2).sum(-1, keepdim=True).sqrt(), min=eps)


def rope_tables(n_ctx: int, n_rot: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n_ctx, n_rot/2] with θ built by repeated float32 multiplication, as ggml does."""
    scale = np.float32(base) ** np.float32(-2.0 / n_rot)
    theta = np.empty((n_ctx, n_rot // 2), np.float32)
    theta[:, 0] = np.arange(n_ctx, dtype=np.float32)
    for i in range(1, n_rot // 2):
        theta[:, i] = theta[:, i - 1] * scale
    t = torch.from_numpy(theta)
    return torch.cos(t), torch.sin(t)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """NEOX pairing (i, i + n_rot/2) on dims [0, n_rot) of every head; x: [N, H, D], cos/sin: [N, n_rot/2]."""
    half = n_rot // 2
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c, rest], dim=-1)


# --- layers --------------------------------------------------------------------------------------

class WeightSource(Protocol):
    """Where a model's weights come from: a GGUF `ModelFile` (QTensors), or the trainer's parameters."""

    hparams: HParams

    def tensor(self, name: str) -> Weight: ...

    def has_tensor(self, name: str) -> bool: ...


def _dense(src: WeightSource, name: str, device: torch.device) -> torch.Tensor:
    """A small tensor (norm, gate, conv kernel) as float32, kept as-is when it is a trained parameter."""
    t = src.tensor(name)
    return t.dequantize(dtype=torch.float32, device=device) if isinstance(t, QTensor) else t


def _vec(src: WeightSource, name: str, device: torch.device) -> torch.Tensor:
    return _dense(src, name, device).reshape(-1)


def _where(w: Weight) -> torch.device:
    return w.raw.device if isinstance(w, QTensor) else w.device


@dataclass
class AttentionWeights:
    q: Weight  # (2·H_q·D, d): per head [query rows ; gate rows]
    k: Weight
    v: Weight
    o: Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor


class GatedAttention:
    def __init__(self, hp: HParams, w: AttentionWeights, layer: int):
        self.hp, self.w, self.il = hp, w, layer
        self.scale = 1.0 / math.sqrt(hp.head_dim_k)
        self.training = False  # the trainer sets this: one causal SDPA call instead of per-query steps
        self.n_seq = 1  # training: the pass holds this many independent sequences of equal length

    def __call__(self, x: torch.Tensor, kv: KVLayer, pos: int, rope: tuple[torch.Tensor, torch.Tensor],
                 cb: Hook) -> torch.Tensor:
        hp, w, il = self.hp, self.w, self.il
        n, D, Dv = x.shape[0], hp.head_dim_k, hp.head_dim_v
        qg, k, v = project(x, (w.q, w.k, w.v))
        qg = qg.reshape(n, hp.n_head, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(n, hp.n_head * D)
        k = k.reshape(n, hp.n_head_kv, D)
        v = v.reshape(n, hp.n_head_kv, Dv)
        q = rms_norm(q, w.q_norm, hp.rms_eps)
        k = rms_norm(k, w.k_norm, hp.rms_eps)
        cos, sin = rope[0][pos:pos + n], rope[1][pos:pos + n]
        q = apply_rope(q, cos, sin, hp.n_rot)
        k = apply_rope(k, cos, sin, hp.n_rot)
        cb("Qcur", il, q)
        cb("Kcur", il, k)
        cb("Vcur", il, v)
        if self.training:  # whole sequences from position 0, no cache
            assert pos == 0, "training runs whole sequences"
            B = self.n_seq
            qb, kb, vb = (t.view(B, n // B, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=self.scale, enable_gqa=True)
            out = o.transpose(1, 2).reshape(n, hp.n_head * Dv) * torch.sigmoid(gate)
            return rowwise_matmul(out, w.o)
        kv.k[pos:pos + n] = k
        kv.v[pos:pos + n] = v
        if nativelib.floats_usable(q, kv.k, kv.v) and kv.k.is_contiguous() and kv.v.is_contiguous():
            out = nativelib.attention(q, kv.k, kv.v, pos, self.scale)  # one call (engine/native/attention.c)
        else:
            out = self._attend(q, kv, pos)
        cb("attn_out", il, out)
        out = out * torch.sigmoid(gate)
        return rowwise_matmul(out, w.o)

    def _attend(self, q: torch.Tensor, kv: KVLayer, pos: int) -> torch.Tensor:
        """The torch twin of the native attention. One query at a time over exactly the keys it sees: the same
        ops whether the pass has 1 or N tokens (a masked batch would change reduction lengths and so the
        rounding)."""
        hp, n, D, Dv = self.hp, q.shape[0], self.hp.head_dim_k, self.hp.head_dim_v
        group = hp.n_head // hp.n_head_kv
        out = torch.empty(n, hp.n_head * Dv, dtype=q.dtype, device=q.device)
        keys = kv.k[:pos + n].permute(1, 2, 0)  # [H_kv, D, t]
        vals = kv.v[:pos + n].transpose(0, 1)  # [H_kv, t, Dv]
        rows = zip(q.reshape(n, hp.n_head_kv, group, D).unbind(0), out.view(n, hp.n_head_kv, group, Dv).unbind(0))
        for i, (qi, oi) in enumerate(rows):
            t = pos + i + 1
            probs = torch.softmax(torch.bmm(qi, keys[:, :, :t]) * self.scale, dim=-1)
            torch.bmm(probs, vals[:, :t], out=oi)
        return out


@dataclass
class GDNWeights:
    qkv: Weight  # (C, d): [q (H_k·d_k) ; k (H_k·d_k) ; v (H_v·d_v, tiled head order)]
    gate: Weight  # z, (H_v·d_v, d)
    beta: Weight  # (H_v, d)
    alpha: Weight  # (H_v, d)
    a: torch.Tensor  # ssm_a = −exp(A_log), (H_v,)
    dt_bias: torch.Tensor  # (H_v,)
    conv: torch.Tensor  # (C, K), tap 0 multiplies the oldest input
    norm: torch.Tensor  # (d_v,), plain multiplicative weight
    out: Weight  # (d, H_v·d_v)


class GatedDeltaNet:
    def __init__(self, hp: HParams, w: GDNWeights, layer: int):
        self.hp, self.w, self.il = hp, w, layer
        self.chunk = 64  # tokens per chunk of the chunk-parallel delta rule (the trainer may raise it)
        self.n_seq = 1  # training: the pass holds this many independent sequences, each from a zero state
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
        hp, w, il = self.hp, self.w, self.il
        n = x.shape[0]
        Hk, Hv, dk, dv, K = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim, hp.ssm_conv_kernel
        mixed, z, b, a = project(x, (w.qkv, w.gate, w.beta, w.alpha))  # mixed: [n, C]
        if self.n_seq > 1:
            return self._independent_sequences(mixed, z, b, a, cb)
        # Causal depthwise conv over [state ; new inputs], taps accumulated in a fixed order.
        window = torch.cat([st.conv, mixed], dim=0)  # [K-1+n, C]
        taps = self.taps()
        conv = window[0:n] * taps[0]
        for j in range(1, K):
            conv = conv + window[j:j + n] * taps[j]
        if capture is not None:
            capture.conv[il] = ConvSteps(window, K)  # views of the window, no copy
        st.conv = window[n:]  # rebind, not copy_: the old state may be saved for backward while training
        u = F.silu(conv)
        cb("conv_output_silu", il, u)
        q = u[:, :Hk * dk].reshape(n, Hk, dk)
        k = u[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk)
        v = u[:, 2 * Hk * dk:].reshape(n, Hv, dv)
        q = l2_norm(q, hp.rms_eps) * (1.0 / math.sqrt(dk))
        k = l2_norm(k, hp.rms_eps)
        if chunked and capture is None and n > 1:
            beta = torch.sigmoid(b)
            g = w.a * F.softplus(a + w.dt_bias)
            o, st.ssm = _delta_rule_chunked(*_tiled(q, k, Hv), v, beta, g, st.ssm, self.chunk)
        else:
            beta, g, o = _delta_rule_recurrent(q, k, v, b, a, w, st, capture.ssm if capture else None, il)
        cb("beta", il, beta)
        cb("gate", il, g)
        cb("attn_output", il, o)
        o = rms_norm(o, w.norm, hp.rms_eps) * F.silu(z.view(n, Hv, dv))
        return rowwise_matmul(o.reshape(n, Hv * dv), w.out)


    def _independent_sequences(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                               cb: Hook) -> torch.Tensor:
        """Training on B sequences at once, each from a zero state: the sequences become extra heads of
        the chunk-parallel delta rule, so one sequential chunk loop serves the whole batch."""
        hp, w, il, B = self.hp, self.w, self.il, self.n_seq
        Hk, Hv, dk, dv, K = hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_state, hp.ssm_head_v_dim, hp.ssm_conv_kernel
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
        q, k = _tiled(q, k, Hv)
        beta = torch.sigmoid(b)
        g = w.a * F.softplus(a + w.dt_bias)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B·T, Hv, ·] → [T, B·Hv, ·]
            return t.view(B, T, Hv, -1).transpose(0, 1).reshape(T, B * Hv, t.shape[-1])

        S0 = torch.zeros(B * Hv, dk, dv, dtype=mixed.dtype, device=mixed.device)
        o, _ = _delta_rule_chunked(heads(q), heads(k), heads(v), heads(beta[..., None])[..., 0],
                                   heads(g[..., None])[..., 0], S0, self.chunk)
        o = o.view(T, B, Hv, dv).transpose(0, 1).reshape(n, Hv, dv)
        cb("attn_output", il, o)
        o = rms_norm(o, w.norm, hp.rms_eps) * F.silu(z.view(n, Hv, dv))
        return rowwise_matmul(o.reshape(n, Hv * dv), w.out)


def _tiled(q: torch.Tensor, k: torch.Tensor, h_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [n, H_k, d] repeated to the value heads: GGUF's tiled order, v-head h uses k-head h mod H_k."""
    r = h_v // q.shape[1]
    return q.repeat(1, r, 1), k.repeat(1, r, 1)


def _delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                          w: GDNWeights, st: GDNState, capture: dict | None,
                          il: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token at a time (spec §3.4): S ← e^g S; e = β(v − Sᵀk); S ← S + k eᵀ; o = Sᵀq. S = st.ssm: [H, d_k, d_v];
    q, k [n, H_k, d_k] (v-head h uses k-head h mod H_k; the native kernel reads them so, without a repeat).

    β = σ(b), g = ssm_a · softplus(α + dt_bias) and e^g are computed for all tokens at once on rows padded to
    full SIMD width (`pointwise`: the same bits for one token or many); the loop body is five kernels on
    views, each the same product whatever the number of tokens. With `capture`, every token's state is
    written straight into the captured stack (no copy of S per token). On the CPU the whole loop is one
    native call instead (engine.nativelib.gdn_recurrent: each head's state stays in cache over the tokens),
    and a capture writes no per-position states: the pass writes its final state into the layer's spare buffer,
    keeps the one it started from, and the states in between are re-run from it when asked for
    (engine.cache.StateReplay: at a commit, only when the verify kept fewer tokens than it ran).
    Returns (β, g, o).
    """
    n = q.shape[0]
    S = st.ssm
    beta = pointwise(torch.sigmoid, b)
    g = w.a * pointwise(F.softplus, a + w.dt_bias)
    if nativelib.floats_usable(q, k, v, beta, g, S):  # one kernel call for the pass (engine/native/gdn.c)
        decay = pointwise(torch.exp, g)
        if capture is None:
            return beta, g, nativelib.gdn_recurrent(q, k, v, beta, decay, S)
        start = S
        live = st.spare if st.spare is not None else torch.empty_like(S)
        o = nativelib.gdn_recurrent(q, k, v, beta, decay, start, live)
        st.ssm, st.spare = live, start
        ins = tuple(t.contiguous() for t in (q, k, v, beta, decay))

        def replay(count: int, s_in: torch.Tensor, s_out: torch.Tensor) -> None:
            nativelib.gdn_recurrent(*(t[:count] for t in ins), s_in, s_out)

        capture[il] = StateReplay(start, live, n, replay)
        return beta, g, o
    q, k = _tiled(q, k, v.shape[1])
    o = torch.empty_like(v).unsqueeze(2)  # [n, H, 1, d_v]
    states = torch.empty((n,) + tuple(S.shape), dtype=S.dtype, device=S.device) if capture is not None else None
    # Per-token views made in one call each: [H, 1, 1] decay, [H, 1, d_k] k and q rows, [H, d_k, 1] k column,
    # [H, 1, d_v] v, [H, 1, 1] β, and the output and state slots.
    steps = zip(pointwise(torch.exp, g)[:, :, None, None].unbind(0), k.unsqueeze(2).unbind(0),
                k.unsqueeze(3).unbind(0), q.unsqueeze(2).unbind(0), v.unsqueeze(2).unbind(0),
                beta[:, :, None, None].unbind(0), o.unbind(0), states.unbind(0) if states is not None else [S] * n)
    cur = S
    for decay, kr, kc, qr, vr, br, ot, nxt in steps:
        torch.mul(cur, decay, out=nxt)
        e = (vr - torch.bmm(kr, nxt)) * br
        nxt.baddbmm_(kc, e)
        torch.bmm(qr, nxt, out=ot)
        cur = nxt
    if states is not None:
        S.copy_(cur)
        capture[il] = states
    return beta, g, o.squeeze(2)


def _delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                        g: torch.Tensor, S: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, parallel within chunks (WY/UT form).

    Within a chunk with cumulative log-decay G: T = (I + tril(diag(β) K Kᵀ ⊙ Γ, −1))⁻¹, U = T diag(β) V,
    W = T diag(β e^G) K; then per chunk, with the incoming state S: V' = U − W S,
    O = (Q e^G) S + tril(Q Kᵀ ⊙ Γ) V', S ← e^{G_L} S + (K e^{G_L − G})ᵀ V'. Everything that does not
    depend on S is computed for all chunks at once; only the short state recurrence loops over chunks
    (a few ops per 64 tokens, which keeps long prefills and training passes cheap in kernel launches).
    Returns (O, final S); nothing is updated in place, so the trainer can differentiate through it.
    """
    n, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-n) % chunk
    if pad:  # padded steps have k = v = 0, β = 0, g = 0: they leave the state untouched
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        beta, g = F.pad(beta, (0, 0, 0, pad)), F.pad(g, (0, 0, 0, pad))
    m, L = (n + pad) // chunk, chunk

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [n, H, ·] → [H, m, L, ·]
        return t.transpose(0, 1).reshape(H, m, L, *t.shape[2:])

    qc, kc, vc, bc = chunks(q), chunks(k), chunks(v), chunks(beta)
    G = torch.cumsum(chunks(g), dim=-1)  # [H, m, L]
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    # Γ[i, j] = e^{G_i − G_j} for j ≤ i. Mask before exp: above the diagonal the exponent is positive
    # and can overflow, and inf·0 would poison the gradient while training.
    gamma = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")))
    kk = (kc * bc[..., None]) @ kc.transpose(-1, -2)  # diag(β) K Kᵀ
    eye = torch.eye(L, dtype=q.dtype, device=q.device).expand(H, m, L, L)
    T = torch.linalg.solve_triangular(eye + (kk * gamma).tril(-1), eye, upper=False, unitriangular=True)
    U = T @ (vc * bc[..., None])
    W = T @ (kc * (bc * torch.exp(G))[..., None])
    attn = (qc @ kc.transpose(-1, -2)) * gamma
    qg = qc * torch.exp(G)[..., None]
    kd = (kc * torch.exp(G[..., -1:] - G)[..., None]).transpose(-1, -2)  # [H, m, dk, L]
    decay = torch.exp(G[..., -1])[..., None, None]  # [H, m, 1, 1]
    # Only the states at chunk starts are sequential; unbind (not indexing) keeps the backward to one op each.
    Us, Ws, kds, decays = U.unbind(1), W.unbind(1), kd.unbind(1), decay.unbind(1)
    starts = []
    for c in range(m):
        starts.append(S)
        S = S * decays[c] + kds[c] @ (Us[c] - Ws[c] @ S)
    S0 = torch.stack(starts, dim=1)  # [H, m, dk, dv]
    o = qg @ S0 + attn @ (U - W @ S0)
    return o.reshape(H, m * L, dv)[:, :n].transpose(0, 1), S


@dataclass
class MoEWeights:
    router: Weight  # (E, d), F32
    experts: ExpertWeights
    shared_gate_inp: Weight | None  # (1, d)
    shared_gate: Weight | None
    shared_up: Weight | None
    shared_down: Weight | None


class MoE:
    def __init__(self, hp: HParams, w: MoEWeights, layer: int, stats: RoutingStats | None = None,
                 cache: ExpertCache | None = None):
        self.hp, self.w, self.il, self.stats, self.cache = hp, w, layer, stats, cache
        self._slices: int | None = None  # the shared expert's slices in the routed products (0: run apart)

    def _shared_slices(self, x: torch.Tensor) -> int:
        """Decided once per layer (its weights and device do not change): slices when the shared expert can run in
        the routed experts' torch integer products, else 0 (the native kernels run it apart)."""
        if self._slices is None:
            w = self.w
            native = all(kquant.usable(t, x) for t in (w.experts.gate, w.experts.up, w.experts.down))
            self._slices = 0 if w.shared_gate is None or self.cache is not None or native else \
                q8dot.shared_slices((w.experts.gate, w.experts.up, w.experts.down),
                                    (w.shared_gate, w.shared_up, w.shared_down), x)  # type: ignore[arg-type]
        return self._slices

    def __call__(self, x: torch.Tensor, cb: Hook) -> torch.Tensor:
        hp, w, il = self.hp, self.w, self.il
        logits = rowwise_matmul(x, w.router)
        cb("ffn_moe_logits", il, logits)
        weights, idx = route(logits, hp.n_expert_used)
        cb("ffn_moe_weights_norm", il, weights)
        if self.stats is not None:
            self.stats.add(il, idx, hp.n_expert)
        shared = None
        if slices := self._shared_slices(x):  # the shared expert joins the routed experts' products
            gate = pointwise(torch.sigmoid, rowwise_matmul(x, w.shared_gate_inp))
            shared = SharedExpert((w.shared_gate, w.shared_up, w.shared_down), slices, gate)  # type: ignore[arg-type]
        y = run_experts(x, idx, weights, w.experts, self.cache, shared)
        cb("ffn_moe_out", il, y)
        if w.shared_gate is not None and shared is None:
            sg, su = project(x, (w.shared_gate, w.shared_up))
            sh = F.silu(sg) * su
            sh = rowwise_matmul(sh, w.shared_down) * pointwise(torch.sigmoid, rowwise_matmul(x, w.shared_gate_inp))
            cb("ffn_shexp", il, sh)
            y = y + sh
        return y


@dataclass
class DenseWeights:
    gate: Weight
    up: Weight
    down: Weight


class DenseFFN:
    def __init__(self, w: DenseWeights):
        self.w = w

    def __call__(self, x: torch.Tensor, cb: Hook) -> torch.Tensor:
        g, u = project(x, (self.w.gate, self.w.up))
        h = F.silu(g) * u
        return rowwise_matmul(h, self.w.down)


class DecoderLayer:
    def __init__(self, il: int, attn_norm: torch.Tensor, post_norm: torch.Tensor,
                 mixer: GatedAttention | GatedDeltaNet, ffn: MoE | DenseFFN, eps: float, device: torch.device):
        self.il, self.attn_norm, self.post_norm, self.mixer, self.ffn, self.eps = il, attn_norm, post_norm, mixer, ffn, eps
        self.device = device

    def __call__(self, x: torch.Tensor, cache: Cache, pos: int, rope: tuple[torch.Tensor, torch.Tensor], cb: Hook,
                 capture: CapturedStates | None, chunked: bool) -> torch.Tensor:
        il = self.il
        a = rms_norm(x, self.attn_norm, self.eps)
        cb("attn_norm", il, a)
        if isinstance(self.mixer, GatedDeltaNet):
            y = self.mixer(a, cache.gdn[il], cb, capture, chunked)
        else:
            y = self.mixer(a, cache.kv[il], pos, rope, cb)
        cb("attn_residual_in", il, y)
        h = x + y
        f = rms_norm(h, self.post_norm, self.eps)
        cb("attn_post_norm", il, f)
        out = h + self.ffn(f, cb)
        cb("l_out", il, out)
        return out


# --- the model -----------------------------------------------------------------------------------

@dataclass
class ForwardResult:
    hidden: torch.Tensor  # post-final-norm hidden rows [N, d] (what the LM head and the MTP head read)
    logits: torch.Tensor | None  # [len(logit_rows), V]
    captured: CapturedStates | None


class Qwen35Model:
    """The trunk (and, when present, the MTP block) of a qwen35 / qwen35moe GGUF."""

    def __init__(self, mf: WeightSource, device: torch.device | str = "cpu", n_ctx: int | None = None,
                 plan: Plan | None = None):
        """Weights on `device`, or where `plan` puts them (engine.placement): trunk layers on the plan's
        accelerator or the CPU, routed experts resident, on the CPU, or on the CPU with a GPU cache."""
        self.mf = mf  # a ModelFile, or the trainer's parameters
        self.hp = hp = mf.hparams
        self.plan = plan
        cpu = torch.device("cpu")
        if plan is None:
            acc = torch.device(device)
            self.layer_devices = [acc] * hp.n_layer
            out_dev = mtp_dev = acc
        else:
            acc = torch.device(plan.device)
            self.layer_devices = [acc if on else cpu for on in plan.layer_on_gpu]
            out_dev = acc if plan.output_on_gpu else cpu
            mtp_dev = acc if plan.mtp_on_gpu else cpu
        self.accelerator = acc
        self.device = out_dev  # final norm, LM head, logits
        self.mtp_device = mtp_dev
        self.routing = RoutingStats()
        self.expert_caches: dict[int, ExpertCache] = {}
        self.tok_embd = mf.tensor("token_embd.weight")  # row lookups: stays where the file is
        self.output = (mf.tensor("output.weight") if mf.has_tensor("output.weight") else self.tok_embd).to(out_dev)
        self.output_norm = _vec(mf, "output_norm.weight", out_dev)
        self.n_ctx_max = n_ctx or hp.n_ctx_train
        self._rope_cpu = rope_tables(self.n_ctx_max, hp.n_rot, hp.rope_base)
        self._ropes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers = [self._layer(i, self.layer_devices[i]) for i in range(hp.n_layer)]
        self.mtp = MTPHead(self) if hp.has_mtp else None

    def rope(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables on `dev` (one copy per device in use)."""
        r = self._ropes.get(dev)
        if r is None:
            r = self._ropes[dev] = (self._rope_cpu[0].to(dev), self._rope_cpu[1].to(dev))
        return r

    def _t(self, name: str, dev: torch.device) -> Weight:
        """A weight on `dev`, still in its stored format (a trained parameter already there is kept)."""
        return self.mf.tensor(name).to(dev)

    def _ffn(self, p: str, il: int, dev: torch.device) -> MoE | DenseFFN:
        mf, hp, t = self.mf, self.hp, self._t
        if not hp.is_moe:
            return DenseFFN(DenseWeights(t(p + "ffn_gate.weight", dev), t(p + "ffn_up.weight", dev),
                                         t(p + "ffn_down.weight", dev)))
        plan = self.plan
        on_cpu = plan is not None and il < hp.n_layer and not plan.experts_on_gpu[il]
        edev = torch.device("cpu") if on_cpu else dev
        experts = ExpertWeights(t(p + "ffn_gate_exps.weight", edev), t(p + "ffn_up_exps.weight", edev),
                                t(p + "ffn_down_exps.weight", edev))
        cache = None
        if on_cpu and plan is not None and plan.cache_experts[il] > 0 and isinstance(experts.gate, QTensor):
            cache = self.expert_caches[il] = ExpertCache(experts.gate, experts.up, experts.down,  # type: ignore[arg-type]
                                                         plan.cache_experts[il], self.accelerator, plan.miss_policy)
        shared = hp.n_ff_shexp > 0
        sgi = None
        if shared:  # stored as (d,) or (1, d): one scalar gate per token either way
            w = t(p + "ffn_gate_inp_shexp.weight", dev)
            sgi = QTensor(w.raw, w.qtype, (1, w.n_cols)) if isinstance(w, QTensor) else w.reshape(1, -1)
        return MoE(hp, MoEWeights(
            t(p + "ffn_gate_inp.weight", dev), experts, sgi,
            t(p + "ffn_gate_shexp.weight", dev) if shared else None,
            t(p + "ffn_up_shexp.weight", dev) if shared else None,
            t(p + "ffn_down_shexp.weight", dev) if shared else None,
        ), il, self.routing, cache)

    def _attention(self, p: str, il: int, dev: torch.device) -> GatedAttention:
        mf, t = self.mf, self._t
        return GatedAttention(self.hp, AttentionWeights(
            t(p + "attn_q.weight", dev), t(p + "attn_k.weight", dev), t(p + "attn_v.weight", dev),
            t(p + "attn_output.weight", dev), _vec(mf, p + "attn_q_norm.weight", dev),
            _vec(mf, p + "attn_k_norm.weight", dev)), il)

    def _layer(self, il: int, dev: torch.device) -> DecoderLayer:
        mf, hp, t = self.mf, self.hp, self._t
        p = f"blk.{il}."
        if il < hp.n_layer and hp.recurrent[il]:
            mixer: GatedAttention | GatedDeltaNet = GatedDeltaNet(hp, GDNWeights(
                t(p + "attn_qkv.weight", dev), t(p + "attn_gate.weight", dev),
                t(p + "ssm_beta.weight", dev), t(p + "ssm_alpha.weight", dev),
                _vec(mf, p + "ssm_a", dev), _vec(mf, p + "ssm_dt.bias", dev),
                _dense(mf, p + "ssm_conv1d.weight", dev),
                _vec(mf, p + "ssm_norm.weight", dev), t(p + "ssm_out.weight", dev)), il)
        else:
            mixer = self._attention(p, il, dev)
        return DecoderLayer(il, _vec(mf, p + "attn_norm.weight", dev), _vec(mf, p + "post_attention_norm.weight", dev),
                            mixer, self._ffn(p, il, dev), hp.rms_eps, dev)

    def new_cache(self, n_ctx: int) -> Cache:
        return Cache(self.hp, min(n_ctx, self.n_ctx_max), self.device,
                     devices={i: d for i, d in enumerate(self.layer_devices)})

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return take_rows(self.tok_embd, tokens, device=self.layer_devices[0] if self.layers else self.device)

    def forward(self, tokens: torch.Tensor | list[int], cache: Cache, *, logit_rows: str = "last",
                capture: bool = False, chunked: bool = False, hook: Hook | None = None) -> ForwardResult:
        """Run N new tokens at positions cache.pos … cache.pos+N−1 and advance the cache.

        logit_rows: "last", "all" or "none". capture: keep the GDN states after every position (verify).
        chunked: use the chunk-parallel delta rule (long prefills; equal to the recurrence to ~1e-6).
        """
        cb = hook or _noop
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = ids.numel()
        pos = cache.pos
        if pos + n > cache.n_ctx:
            raise ValueError(f"{n} tokens at position {pos} exceed the cache of {cache.n_ctx}")
        x = self.embed(ids)
        cb("inp_embd", -1, x)
        cap = CapturedStates({}, {}) if capture else None
        for layer in self.layers:
            if x.device != layer.device:
                x = x.to(layer.device)
            x = layer(x, cache, pos, self.rope(layer.device), cb, cap, chunked)
        cache.pos = pos + n
        h = rms_norm(x.to(self.device), self.output_norm, self.hp.rms_eps)
        cb("result_norm", -1, h)
        logits = None
        if logit_rows != "none":
            rows = h if logit_rows == "all" else h[-1:]
            logits = rowwise_matmul(rows, self.output)
            cb("result_output", -1, logits)
        return ForwardResult(h, logits, cap)


# --- the MTP head --------------------------------------------------------------------------------

# Head passes of up to this many rows take their embeddings from the per-token memo: a draft pass has at most
# speculative.MAX_DEPTH + 1 rows (those a verify kept, plus one); longer ones catch up over a prompt.
MAX_DEPTH_ROWS = 16
# Normed embedding rows the MTP head keeps (4096 × 2048 float32 = 32 MiB on a 35B model).
EMBEDDED_ROWS = 4096


class MTPHead:
    """The multi-token-prediction block (spec §3.6): from the trunk's post-norm hidden h at position
    p−1 and the token x at p it predicts the token at p+1. Its input row for position p is
    c = W_eh [RMSNorm(embed(x); enorm) ; RMSNorm(h; hnorm)], then one full decoder block (layer L, with
    its own KV cache), then shared_head_norm and the LM head. Chained drafts feed the head's own
    post-norm output back as the next h. Position p pairs token x_p with h_{p−1} (h_{−1} = 0), as
    llama.cpp's MTP context does.
    """

    def __init__(self, model: Qwen35Model):
        mf, hp, dev = model.mf, model.hp, model.mtp_device
        self.hp, self.model, self.device = hp, model, dev
        self.il = L = hp.n_layer
        p = f"blk.{L}.nextn."
        self.eh_proj = mf.tensor(p + "eh_proj.weight")
        self.enorm = _vec(mf, p + "enorm.weight", dev)
        self.hnorm = _vec(mf, p + "hnorm.weight", dev)
        self.head_norm = _vec(mf, p + "shared_head_norm.weight", dev) if mf.has_tensor(p + "shared_head_norm.weight") \
            else model.output_norm
        self.embed = mf.tensor(p + "embed_tokens.weight") if mf.has_tensor(p + "embed_tokens.weight") else model.tok_embd
        self.eh_proj = self.eh_proj.to(dev)
        self.head = mf.tensor(p + "shared_head_head.weight").to(dev) if mf.has_tensor(p + "shared_head_head.weight") \
            else model.output  # the trunk's LM head, wherever it is
        self.layer = model._layer(L, dev)
        self._embedded: dict[int, torch.Tensor] = {}  # token → its normed embedding row (inference only)

    def new_cache(self, n_ctx: int) -> Cache:
        return Cache(self.hp, min(n_ctx, self.model.n_ctx_max), self.device, layers=(self.il,))

    def _normed_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """RMSNorm(embed(x); enorm) of each token. A function of the token alone, so at inference the rows of
        the last few thousand tokens seen are kept (each computed as a one-row pass computes it: norms are
        per-row, batch-invariant), sparing a draft its dequantize and norm ops."""
        if self.enorm.requires_grad or ids.numel() > MAX_DEPTH_ROWS:  # training, or a catch-up over a prompt
            return rms_norm(take_rows(self.embed, ids, device=self.device), self.enorm, self.hp.rms_eps)
        c = self._embedded
        toks = ids.tolist()
        missing = [t for t in dict.fromkeys(toks) if t not in c]
        if missing:
            if len(c) + len(missing) > EMBEDDED_ROWS:
                c.clear()
            rows = rms_norm(take_rows(self.embed, torch.tensor(missing), device=self.device), self.enorm,
                            self.hp.rms_eps)
            c.update(zip(missing, rows))
        return c[toks[0]].unsqueeze(0) if len(toks) == 1 else torch.stack([c[t] for t in toks])

    def forward(self, tokens: torch.Tensor | list[int], hidden: torch.Tensor, cache: Cache, *,
                logit_rows: str = "last", hook: Hook | None = None) -> ForwardResult:
        """Rows (tokens[i], hidden[i]) at positions cache.pos…; returns the head's post-norm hidden rows
        (the next chained "h") and the draft logits."""
        cb = hook or _noop
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n, pos, eps = ids.numel(), cache.pos, self.hp.rms_eps
        if pos + n > cache.n_ctx:
            raise ValueError(f"{n} MTP rows at position {pos} exceed the cache of {cache.n_ctx}")
        e = self._normed_embeddings(ids)
        h = rms_norm(hidden.to(self.device), self.hnorm, eps)
        x = rowwise_matmul(torch.cat([e, h], dim=-1), self.eh_proj)
        cb("mtp_eh_proj", self.il, x)
        x = self.layer(x, cache, pos, self.model.rope(self.device), cb, None, False)
        cache.pos = pos + n
        out = rms_norm(x, self.head_norm, eps)
        cb("mtp_result_norm", self.il, out)
        logits = None
        if logit_rows != "none":
            rows = out if logit_rows == "all" else out[-1:]
            logits = rowwise_matmul(rows.to(_where(self.head)), self.head)
        return ForwardResult(out, logits, None)
