"""The Gated DeltaNet recurrence (spec §3.4): S ← e^g S; e = β(v − Sᵀk); S ← S + k eᵀ; o = Sᵀq, per value head.

`delta_rule` runs a pass's tokens one at a time: natively in one call per layer and pass (a head's state kept in
cache over the tokens, swept once per token), or as a torch loop of five kernels per token on views made once per
pass (each the same product whatever the number of tokens). `delta_rule_chunked` is the chunk-parallel (WY) form
for long prefills and training, equal to the recurrence to ~1e-6 relative.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from engine.cache import GDNState, StateReplay
from engine.ops import native
from engine.ops.attention import _floats
from engine.ops.backend import Backend, OpEvent
from engine.ops.norms import l2_norm

# Batch invariance: ATen runs pointwise transcendentals (exp, rsqrt, sigmoid…) on SIMD lanes for most
# elements but in scalar code for a tensor's tail, and the two can differ in the last bit; a [N, 4]
# tensor is all tail at N = 1 and all SIMD at N = 8. So norms use sqrt and division (correctly rounded
# on both paths), per-token gates are computed per token, and `pointwise` pads small rows on the CPU. A CUDA
# kernel computes every element with the same code (vectorizing only its loads), so rows there go as they are.

def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for x [N, L]; on the CPU each row padded to 64 elements so every element takes the SIMD path."""
    n, length = x.shape
    if length % 64 == 0 or x.device.type == "cuda":
        return fn(x)
    padded = torch.zeros(n, length + (-length) % 64, dtype=x.dtype, device=x.device)
    padded[:, :length] = x
    return fn(padded)[:, :length]


def gdn_inputs(window: torch.Tensor, taps: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A: torch.Tensor,
               dt_bias: torch.Tensor, hk: int, dk: int, eps: float, backend: Backend
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence's inputs from a pass's projections (spec §3.4): the causal conv over window [K−1+n, C] (the
    conv state, then the pass's rows) with taps [K, C], silu → u [n, C]; q, k [n, H_k, d_k] its first two parts
    L2-normed per head (q scaled by 1/sqrt(d_k)), v [n, H, d_v] its last; β = sigmoid(b), g = A·softplus(a +
    dt_bias) [n, H]. Natively in one call (engine/native/gdn.c), or op by op in torch."""
    n, h = b.shape
    if backend.native and _floats(window, taps, b, a, A, dt_bias):
        u, q, k, beta, g = native.gdn_inputs(*(t.contiguous() for t in (window, taps, b, a, A, dt_bias)), hk, dk,
                                             eps, 1.0 / math.sqrt(dk))
    else:
        kk = taps.shape[0]
        u = window[0:n] * taps[0]
        for j in range(1, kk):
            u = u + window[j:j + n] * taps[j]
        u = F.silu(u)
        q = l2_norm(u[:, :hk * dk].reshape(n, hk, dk), eps, backend, scale=1.0 / math.sqrt(dk))
        k = l2_norm(u[:, hk * dk:2 * hk * dk].reshape(n, hk, dk), eps, backend)
        beta = pointwise(torch.sigmoid, b)
        g = A * pointwise(F.softplus, a + dt_bias)
    return u, q, k, u[:, 2 * hk * dk:].reshape(n, h, -1), beta, g


def tiled(q: torch.Tensor, k: torch.Tensor, h_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [n, H_k, d] repeated to the value heads: GGUF's tiled order, v-head h uses k-head h mod H_k."""
    r = h_v // q.shape[1]
    return q.repeat(1, r, 1), k.repeat(1, r, 1)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
               st: GDNState, backend: Backend, capture: bool = False) -> tuple[torch.Tensor, StateReplay | torch.Tensor | None]:
    """The recurrence over a pass's n tokens from the state st.ssm [H, d_k, d_v], which it advances: q, k [n, H_k,
    d_k] (v-head h uses k-head h mod H_k), v [n, H, d_v], β and g [n, H]. Returns o [n, H, d_v] and, with `capture`,
    the state after every position: natively a StateReplay (no per-position copies: the pass writes its final
    state into the layer's spare buffer, keeps the one it started from, and the states in between are re-run from
    it when asked for, at a commit that keeps fewer tokens than the pass ran), in torch a stack [n, H, d_k, d_v]."""
    if backend.observer is None:
        return _delta_rule(q, k, v, beta, g, st, backend, capture)
    t0 = time.perf_counter()
    out = _delta_rule(q, k, v, beta, g, st, backend, capture)
    backend.observer(OpEvent("delta_rule", 0, q.shape[0], time.perf_counter() - t0))
    return out


def _native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
            S: torch.Tensor, out: torch.Tensor, backend: Backend) -> torch.Tensor:
    n, hk, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    if h % hk:
        raise ValueError(f"{h} value heads cannot share {hk} key heads")
    if not (S.is_contiguous() and out.is_contiguous()):
        raise ValueError("the GDN state must be contiguous")
    q, k, v, beta, decay = (t.contiguous() for t in (q, k, v, beta, decay))
    return native.gdn_recurrence(q, k, v, beta, decay, S, out, backend.n_threads(n * h * dk * dv), backend.level)


def state_replay(start: torch.Tensor, live: torch.Tensor, ins: tuple[torch.Tensor, ...],
                 backend: Backend) -> StateReplay:
    """The states of a native pass that ran from `start` to `live` over the recurrence's inputs `ins` (q, k, v, β,
    e^g, contiguous, kept): the ones in between re-run by the same kernel when asked for."""
    q, k, v, beta, decay = ins
    work = v.shape[1] * k.shape[2] * v.shape[2]  # a row's H · d_k · d_v

    def replay(count: int, s_in: torch.Tensor, s_out: torch.Tensor) -> None:
        # the pass checked the operands: a commit's replay goes straight to the kernel (prefixes of contiguous rows)
        native.gdn_recurrence(q[:count], k[:count], v[:count], beta[:count], decay[:count], s_in, s_out,
                              backend.n_threads(count * work), backend.level)

    return StateReplay(start, live, ins[0].shape[0], replay)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                st: GDNState, backend: Backend, capture: bool) -> tuple[torch.Tensor, StateReplay | torch.Tensor | None]:
    n = q.shape[0]
    S = st.ssm
    if backend.native and _floats(q, k, v, beta, g, S):
        decay = native.exp_rows(g.contiguous())  # layer.c's decays
        if not capture:
            return _native(q, k, v, beta, decay, S, S, backend), None
        start = S
        live = st.spare if st.spare is not None else torch.empty_like(S)
        o = _native(q, k, v, beta, decay, start, live, backend)
        st.ssm, st.spare = live, start
        return o, state_replay(start, live, tuple(t.contiguous() for t in (q, k, v, beta, decay)), backend)
    q, k = tiled(q, k, v.shape[1])
    o = torch.empty_like(v).unsqueeze(2)  # [n, H, 1, d_v]
    states = torch.empty((n,) + tuple(S.shape), dtype=S.dtype, device=S.device) if capture else None
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
    return o.squeeze(2), states


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
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
