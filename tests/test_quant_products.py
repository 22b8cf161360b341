"""Native products of the weight types beyond Q4_K / Q6_K / Q8_0 (tests/test_kquant.py): Q5_K, Q3_K, Q2_K, IQ4_XS
against Q8_K activations; Q4_0, Q5_0, IQ4_NL, MXFP4 against Q8_0; Q4_1, Q5_1 against Q8_1; F16 and BF16 against the
activations rounded to them. Each in every instruction-set form this machine runs (the K-quants have AVX512 forms;
the others' AVX512 backends dispatch to their AVX2 forms). Weights are random valid blocks (engine.storage.quantize.random_blocks: random bytes with finite
scales of the right size), their meaning gguf's dequantization, so every bit pattern of values and sub-block scales
is exercised, not only what an encoder would choose."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import ops
from engine.models.build import load_model
from engine.ops import native
from engine.ops.activations import act_format
from engine.ops.experts import route
from engine.ops.experts_pairs import NativePart, group, pairs_product
from engine.ops.linear import NativeLinear
from engine.storage.modelfile import open_model
from engine.storage.qtensor import QTensor
from engine.storage.quantize import random_blocks
from tests.conftest import backend_params
from tests.fixtures import UD_Q4_K_M_MOE, fixture_path

Q8_K_TYPES = [T.Q5_K, T.Q3_K, T.Q2_K, T.IQ4_XS]
BLOCK32_TYPES = [T.Q4_0, T.Q5_0, T.IQ4_NL, T.MXFP4, T.Q4_1, T.Q5_1, T.F16, T.BF16]
TYPES = Q8_K_TYPES + BLOCK32_TYPES
NATIVE = backend_params(native_only=True)
K = 1024


@pytest.fixture(autouse=True)
def _built() -> None:
    assert native.available(), "the native library was not built (pip install -e . builds it)"


def _weight(qt: T, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    raw = random_blocks(shape, qt, np.random.default_rng(seed), 1 / np.sqrt(shape[-1]))
    return QTensor(torch.from_numpy(raw), qt, shape)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :256] = 0.0  # all-zero blocks (scale 0)
    x[-1, 300] = -40.0  # a block dominated by one negative value
    return x


def _bind(w: QTensor, backend: ops.Backend) -> NativeLinear:
    lin = ops.bind(w, backend)
    assert isinstance(lin, NativeLinear), f"{w.qtype.name} did not bind to a native product"
    return lin


def _reference(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """float64 products of the activations as ggml rounds them and the gguf-exact dequantized weight. For Q4_1 /
    Q5_1 the minimum's term uses Q8_1's s = fp16(d·Σq) as ggml does, not the rounded d times Σq."""
    xr = ops.round_for(x, w.qtype.name).double()
    ref = xr @ w.dequantize().double().t()
    if act_format(w.qtype.name) == "Q8_1":
        rows = ops.quantize(x.clone(), "Q8_1", on_native=True)
        sum_q = rows.q.view(x.shape[0], -1, 32).sum(-1).double()
        mins = w.raw.view(w.n_rows, -1, 20 if w.qtype == T.Q4_1 else 24)[:, :, 2:4].contiguous()
        m = mins.view(torch.float16).squeeze(-1).double()
        ref = ref + (rows.s.double() - rows.d.double() * sum_q) @ m.t()  # type: ignore[union-attr]
    return ref


@pytest.mark.parametrize("rows", [80, 72], ids=["whole-groups", "partial-group"])
@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_products_equal_the_dequantized_product(qt: T, backend: ops.Backend, rows: int) -> None:
    """Only the float32 rounding of the per-block scaling (and the sums' order) separates the product from the
    float64 reference (measured 5e-8 … 3e-7 of the largest output). The packing backends pack all but F16 and BF16:
    80 rows as whole groups of 16, 72 with the last group padded with zero rows."""
    w = _weight(qt, (rows, K))
    x = _x(5, K)
    lin = _bind(w, backend)
    y = ops.linear(x, lin)
    ref = _reference(x, w)
    assert (lin.packed is not None) == (backend.packs and qt in native.PACKED_CODE)
    assert y.dtype == torch.float32 and y.shape == (5, rows)
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-6 * ref.abs().max().item(), err


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_rows_are_batch_and_thread_invariant(qt: T, backend: ops.Backend) -> None:
    """Row i of an M-row product has the bits of a one-row product, for M past the kernels' row tile (64) and for
    one, two or three threads."""
    stored = _weight(qt, (48, 512), seed=2)
    x = _x(70, 512, seed=3)
    w = _bind(stored, backend)
    ref = torch.cat([ops.linear(x[i:i + 1].clone(), w) for i in range(70)])
    for threads in (1, 2, 3):
        assert torch.equal(ops.linear(x.clone(), _bind(stored, replace(backend, threads=threads))), ref), threads


@pytest.mark.parametrize("qt", BLOCK32_TYPES, ids=lambda t: t.name)
def test_block32_avx2_and_portable_forms_give_the_same_bits(qt: T) -> None:
    """The 32-value types and F16/BF16 sum the same float lanes in both forms (the portable loop with fmaf where
    AVX2 fuses), so they agree bit for bit; the K-quant forms group their float steps differently (float
    rounding apart, the other tests)."""
    if not native.cpu_avx2():
        pytest.skip("this CPU has no AVX2 form to compare with the portable one")
    w = _weight(qt, (40, K), seed=4)
    x = _x(3, K, seed=5)
    avx2 = ops.linear(x, _bind(w, replace(ops.backend_named("native-avx2"), copies=False)))  # stored: not packed
    assert torch.equal(ops.linear(x.clone(), _bind(w, ops.backend_named("native-portable"))), avx2)


def test_q8_1_rows_are_q8_0_rows_with_their_sums() -> None:
    """Q8_1 activations: Q8_0's quants and f16-rounded scales, and s = fp16(d·Σq) with d = amax/127 unrounded
    (ggml quantize_row_q8_1)."""
    x = _x(4, K)
    x[1, 32:64] *= 1e-3  # f16-subnormal scale
    r1 = ops.quantize(x, "Q8_1", on_native=True)
    r0 = ops.quantize(x.clone(), "Q8_0", on_native=True)
    assert torch.equal(r1.q, r0.q) and torch.equal(r1.d, r0.d)  # type: ignore[arg-type]
    amax = x.view(4, -1, 32).abs().amax(-1).numpy()
    d = (amax / np.float32(127.0)).astype(np.float32)
    s = (r1.q.view(4, -1, 32).sum(-1).numpy().astype(np.float32) * d).astype(np.float16).astype(np.float32)
    assert np.array_equal(r1.s.numpy(), s)  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", [T.Q5_K, T.IQ4_XS, T.Q4_1, T.MXFP4, T.BF16, *native.IQ_GRID_TYPES], ids=lambda t: t.name)
def test_expert_pairs_equal_products_per_expert(qt: T, backend: ops.Backend) -> None:
    """Routed-expert pairs: pair p (grouped by expert) gets the bits of row xrow[p] times its expert alone."""
    stored = _weight(qt, (6, 32, 512), seed=6)
    stack = _bind(stored, backend)
    x = _x(7, 512, seed=7)
    experts, starts = torch.tensor([0, 3, 5]), torch.tensor([0, 2, 3, 8])
    xrow = torch.tensor([2, 6, 0, 1, 4, 5, 3, 6])
    out = pairs_product(x, stack, xrow, experts, starts)
    for g, e in enumerate(experts.tolist()):
        one = _bind(stored[e], backend)
        for p in range(int(starts[g]), int(starts[g + 1])):
            assert torch.equal(out[p], ops.linear(x[int(xrow[p])].unsqueeze(0).clone(), one)[0]), (e, p)


# Mixed layers: the UD-Q4_K_M one, and others with a format per projection (Q8_0, Q8_1, Q8_K, F16 side by side).
# Q8_1 types sit in down projections only: their fp16 s moves a gate/up output by ~2e-5 of it from the torch twin's,
# enough to round some of silu·up's quants to the next step, which the twin comparison cannot tell from an error.
MIXES = [(T.Q4_K, T.Q4_K, T.Q5_K), (T.Q4_0, T.IQ4_NL, T.Q4_1), (T.IQ4_XS, T.Q3_K, T.F16), (T.Q2_K, T.MXFP4, T.Q5_1),
         (T.BF16, T.Q5_0, T.Q6_K)]


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: "-".join(t.name for t in m))
def test_mixed_type_experts_equal_the_torch_twin_and_one_token_passes(mix: tuple[T, T, T],
                                                                      backend: ops.Backend) -> None:
    """The one-call native experts (moe.c: each projection's activations in its own format) against the torch
    backend's dequantized experts with llama.cpp's activation rounding (to float32 rounding of the products'
    scaling: 1e-5 of the largest output; Q4_1/Q5_1's fp16 s moves the minimum's term by up to 2⁻¹¹ of it, 1e-4; an
    F16/BF16 down projection rounds its input to 11 or 8 bits, so a float32 rounding apart in gate·up can move one
    input by 2⁻¹¹ of it: 3e-5, where the Q4_K/Q6_K forms measured 5.4e-6 and the AVX512 IQ4_XS/Q3_K ones 1.1e-5),
    each token's row with a one-token pass's bits, and the expert-cache driver's grouped products (one call per
    projection, the activations made in torch) with the one-call pass's bits."""
    e_n, d, f, k_used = 8, 256, 512, 3
    gate, up, down = (_weight(t, shape, seed=10 + i)
                      for i, (t, shape) in enumerate(zip(mix, [(e_n, f, d), (e_n, f, d), (e_n, d, f)])))
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(8))
    w, idx = route(x @ torch.randn(e_n, d, generator=torch.Generator().manual_seed(9)).t(), k_used)
    ex = ops.bind_experts(gate, up, down, backend)
    assert ex.kind == "native"
    y = ops.moe_experts(x, idx, w, ex)
    twin = ops.moe_experts(x, idx, w, ops.bind_experts(gate, up, down, ops.TORCH))
    tol = 1e-4 if any(act_format(t.name) == "Q8_1" for t in mix) else \
        3e-5 if act_format(mix[2].name) in ("F16", "BF16") else 1e-5
    torch.testing.assert_close(y, twin, rtol=0, atol=tol * twin.abs().max().item())
    for i in (0, 4):
        assert torch.equal(ops.moe_experts(x[i:i + 1].clone(), idx[i:i + 1], w[i:i + 1], ex), y[i:i + 1]), i
    pairs = group(x, idx, backend, e_n)
    NativePart(pairs).run(ex.stacks, pairs.experts)  # type: ignore[arg-type]
    assert torch.equal(pairs.reduce(w), y)


def _greedy(spec, backend: ops.Backend, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    m = load_model(open_model(fixture_path(spec)), n_ctx=256, backend=backend)
    cache = m.new_cache(256)
    logits = m.forward(prompt, cache).logits
    toks = []
    for _ in range(n):
        toks.append(int(logits[-1].argmax()))
        logits = m.forward([toks[-1]], cache).logits
    return toks


@pytest.mark.parametrize("backend", NATIVE)
def test_ud_q4_k_m_model_generates_the_torch_backends_tokens(backend: ops.Backend) -> None:
    """A whole model in the UD-Q4_K_M mix (Q4_K matrices, Q5_K routed expert down projections, Q6_K LM head): greedy
    decoding on a native backend picks the tokens the torch backend picks (dequantized weights, the same activation
    rounding), and its routed experts run natively in every layer."""
    spec = UD_Q4_K_M_MOE
    mf = open_model(fixture_path(spec))
    assert {mf.tensors[f"blk.{i}.ffn_down_exps.weight"].qtype for i in range(spec.n_layer)} == {T.Q5_K}
    m = load_model(mf, n_ctx=64, backend=backend)
    assert all(layer.ffn.w.experts.kind == "native" for layer in m.model.layers)
    prompt = np.random.default_rng(5).integers(0, spec.n_vocab - 3, 12).tolist()
    assert _greedy(spec, backend, prompt, 24) == _greedy(spec, ops.TORCH, prompt, 24)
