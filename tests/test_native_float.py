"""The native float kernels against their torch twins, through engine.ops: the Gated DeltaNet recurrence
(engine/native/gdn.c) and causal attention over the KV cache (engine/native/attention.c), in every form the machine
runs (AVX512 register forms against the portable loops where the CPU has AVX512)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine import ops
from engine.cache import GDNState
from engine.ops import native
from engine.ops.attention import attention_torch
from tests.conftest import backend_params

NATIVE = backend_params(native_only=True)
SIMD = backend_params(native_only=True, simd_only=True)  # forms with AVX512 kernels, compared with the portable loops
SIMD_AVX2 = backend_params(native_only=True, simd_only=True, simd_from="avx2")  # and those with AVX2 register forms
PORTABLE = ops.Backend("native", "portable")


def _recurrent(q, k, v, b, a, w, st, capture: bool, backend: ops.Backend):  # type: ignore[no-untyped-def]
    """β, g as the model computes them for the recurrence, then the op: (β, g, o, captured states)."""
    beta = ops.pointwise(torch.sigmoid, b)
    g = w.a * ops.pointwise(F.softplus, a + w.dt_bias)
    o, cap = ops.delta_rule(q, k, v, beta, g, st, backend, capture)
    return beta, g, o, cap


class _W:  # the two GDN weights the recurrence reads
    def __init__(self, h: int, gen: torch.Generator):
        self.a = -torch.rand(h, generator=gen) - 0.1
        self.dt_bias = torch.randn(h, generator=gen) * 0.1


def _inputs(n: int, h: int, dk: int, dv: int, seed: int = 0, hk: int | None = None):  # type: ignore[no-untyped-def]
    """hk: key heads, each shared by h / hk value heads (GGUF's tiled order); h when None."""
    gen = torch.Generator().manual_seed(seed)
    hk = hk or h
    q = F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1) / dk ** 0.5
    k = F.normalize(torch.randn(n, hk, dk, generator=gen), dim=-1)
    v = torch.randn(n, h, dv, generator=gen)
    b, a = torch.randn(n, h, generator=gen), torch.randn(n, h, generator=gen)
    S = torch.randn(h, dk, dv, generator=gen) * 0.1
    return q, k, v, b, a, _W(h, gen), S


@pytest.fixture(autouse=True)
def _built() -> None:
    assert native.available(), "the native library was not built (pip install -e . builds it)"


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("n,h,hk,dk,dv", [(1, 4, 4, 32, 32), (5, 4, 2, 32, 32), (3, 16, 8, 128, 128), (2, 2, 2, 64, 96),
                                           (4, 6, 3, 64, 64)])
def test_native_recurrence_equals_the_torch_loop(backend: ops.Backend, n: int, h: int, hk: int, dk: int,
                                                 dv: int) -> None:
    q, k, v, b, a, w, S = _inputs(n, h, dk, dv, hk=hk)
    st_nat, st_ref = _state(S), _state(S)
    beta, g, o, cap_nat = _recurrent(q, k, v, b, a, w, st_nat, True, backend)
    beta_r, g_r, o_r, cap_ref = _recurrent(q, k, v, b, a, w, st_ref, True, ops.TORCH)
    assert torch.equal(beta, beta_r) and torch.equal(g, g_r)
    torch.testing.assert_close(o, o_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st_nat.ssm, st_ref.ssm, rtol=1e-5, atol=1e-6)
    steps = torch.stack([cap_nat[t] for t in range(n)])
    torch.testing.assert_close(steps, cap_ref, rtol=1e-5, atol=1e-6)
    assert len(cap_nat) == n and cap_nat[-1] is st_nat.ssm  # the last position's state is the live one
    assert torch.equal(st_nat.spare, S)  # and the pass kept the state it started from


def _state(S: torch.Tensor) -> GDNState:
    return GDNState(torch.empty(0), S.clone())


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("dk,dv", [(64, 64), (128, 128), (32, 48)])
def test_native_recurrence_is_token_and_thread_invariant(backend: ops.Backend, dk: int, dv: int) -> None:
    """Token t of an n-token pass has the bits of n one-token passes, on one thread or several (the d_v of
    64 and 128 run in registers on AVX512, other widths in the portable loop)."""
    q, k, v, b, a, w, S = _inputs(6, 8, dk, dv, seed=1)
    st1 = _state(S)
    steps = [_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], b[t:t + 1], a[t:t + 1], w, st1, False, backend)[2]
             for t in range(6)]
    for threads in (1, 2, 3):
        st2 = _state(S)
        o = _recurrent(q, k, v, b, a, w, st2, False, replace(backend, threads=threads))[2]
        assert torch.equal(o, torch.cat(steps)) and torch.equal(st2.ssm, st1.ssm), threads


@pytest.mark.parametrize("backend", SIMD_AVX2)
@pytest.mark.parametrize("n,dk,dv", [(1, 128, 128), (4, 128, 128), (3, 64, 64), (2, 32, 96)])
def test_native_recurrence_register_form_equals_the_loop(backend: ops.Backend, n: int, dk: int, dv: int) -> None:
    """The AVX512 and AVX2 forms (e, o and Sᵀk in registers; AVX2 32 columns at a time) give the portable loop's bits,
    replayed states included."""
    q, k, v, b, a, w, S = _inputs(n, 16, dk, dv, seed=2, hk=8)
    got = {}
    for portable, be in ((False, backend), (True, PORTABLE)):
        st = _state(S)
        _, _, o, cap = _recurrent(q, k, v, b, a, w, st, True, be)
        got[portable] = (o, st.ssm, [cap[t].clone() for t in range(n)])
    assert torch.equal(got[False][0], got[True][0]) and torch.equal(got[False][1], got[True][1])
    assert all(torch.equal(x, y) for x, y in zip(got[False][2], got[True][2]))


def _attention_inputs(n: int, pos: int, h: int, h_kv: int, d: int, dv: int, seed: int = 0):  # type: ignore[no-untyped-def]
    from engine.cache import KVLayer

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=gen)
    kv = KVLayer(torch.randn(pos + n + 3, h_kv, d, generator=gen), torch.randn(pos + n + 3, h_kv, dv, generator=gen))
    return q, kv


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("n,pos,h,h_kv,d,dv", [(1, 0, 4, 2, 64, 64), (5, 17, 4, 2, 64, 64), (3, 40, 8, 2, 256, 256),
                                               (2, 5, 2, 2, 40, 24)])
def test_native_attention_equals_the_torch_twin(backend: ops.Backend, n: int, pos: int, h: int, h_kv: int, d: int,
                                                dv: int) -> None:
    """Each query over exactly the keys it sees (keys past pos + i are in the cache but must not count)."""
    q, kv = _attention_inputs(n, pos, h, h_kv, d, dv)
    ref = attention_torch(q, kv.k, kv.v, pos, d ** -0.5)
    out = ops.attention(q, kv.k, kv.v, pos, d ** -0.5, backend)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", NATIVE)
def test_native_attention_is_query_and_thread_invariant(backend: ops.Backend) -> None:
    q, kv = _attention_inputs(6, 30, 8, 2, 64, 64, seed=2)
    one = torch.cat([ops.attention(q[i:i + 1].clone(), kv.k, kv.v, 30 + i, 0.125, backend) for i in range(6)])
    for threads in (1, 2, 3):
        assert torch.equal(ops.attention(q, kv.k, kv.v, 30, 0.125, replace(backend, threads=threads)), one), threads


@pytest.mark.parametrize("backend", SIMD_AVX2)
@pytest.mark.parametrize("n,pos,h,h_kv,d", [(1, 37, 8, 2, 256), (3, 100, 4, 2, 128), (5, 70, 4, 4, 64),
                                            (2, 9, 4, 2, 48), (2, 40, 4, 2, 96)])
def test_native_attention_wide_scores_equal_the_plain_loop(backend: ops.Backend, n: int, pos: int, h: int, h_kv: int,
                                                           d: int) -> None:
    """The AVX512 and AVX2 scores (four keys at a time) and weighted values (128 or 64 outputs in registers over 16
    keys) give the plain loops' bits (d = 64, 96: AVX512's values plain; d = 48, not a multiple of 16: plain scores
    too)."""
    q, kv = _attention_inputs(n, pos, h, h_kv, d, d, seed=3)
    got = {portable: ops.attention(q, kv.k, kv.v, pos, d ** -0.5, be) for portable, be in ((False, backend),
                                                                                         (True, PORTABLE))}
    assert torch.equal(got[False], got[True])
