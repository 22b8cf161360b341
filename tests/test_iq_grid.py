"""Native products of the grid-codebook IQ types (engine/native/iq_grid.c through engine.ops) in every form this
machine runs: AVX2 and portable C, against Q8_K activations as llama.cpp's CPU backend quantizes them.

Fixture weights are random valid blocks (engine.storage.quantize.random_iq_blocks: random bytes, since every grid
index, sign and scale pattern is valid, with a small finite fp16 scale per block); the whole-model test writes them
into a GGUF with our writer (engine/storage/writer.py, the tensors and vocabulary of tests/fixtures.py).
"""
from __future__ import annotations

import runpy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import ops
from engine.models.build import load_model
from engine.ops import native
from engine.ops.experts import route
from engine.ops.linear import NativeLinear
from engine.storage.modelfile import open_model
from engine.storage.qtensor import QTensor
from engine.storage.quantize import random_iq_blocks
from engine.storage.writer import Raw, storage_type, write_gguf
from tests.conftest import backend_params
from tests.fixtures import KQUANT_MOE, fixture_vocab, hparams_of, random_tensors

TYPES = list(native.IQ_GRID_TYPES)
NATIVE = backend_params(native_only=True)
GENERATOR = Path(__file__).resolve().parents[1] / "engine" / "native" / "gen_iq_tables.py"


@pytest.fixture(autouse=True)
def _built() -> None:
    assert native.available(), "the native library was not built (pip install -e . builds it)"


def _weight(qt: T, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    rng = np.random.default_rng(seed)
    return QTensor(random_iq_blocks(shape, qt, rng, 1 / np.sqrt(shape[-1])), qt, shape)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :256] = 0.0  # an all-zero block (scale 0)
    x[-1, 300] = -40.0  # a block dominated by one negative value
    return x


def _bind(w: QTensor, backend: ops.Backend) -> NativeLinear:
    lin = ops.bind(w, backend)
    assert isinstance(lin, NativeLinear), lin
    return lin


def test_the_tables_header_is_what_the_generator_writes() -> None:
    """engine/native/iq_tables.h is generated from the gguf package's grids (never edited by hand)."""
    render = runpy.run_path(str(GENERATOR))["render"]
    assert (GENERATOR.parent / "iq_tables.h").read_text() == render()


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_products_equal_the_dequantized_product(qt: T, backend: ops.Backend) -> None:
    """Against float64 products of the rounded activations (activations.round_for) and the gguf-exact dequantized
    weight: the integer sums are exact, so only the float32 rounding of the per-block scaling separates them."""
    w = _bind(_weight(qt, (40, 1024)), backend)
    x = _x(5, 1024)
    ref = ops.round_for(x, qt.name).double() @ w.weight.dequantize().double().t()
    y = ops.linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (5, 40)
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-6 * ref.abs().max().item(), err


# ggml's generic dot products: a grid value is d · (2s+1) · grid · sign / UNIT exactly
# (IQ1: d · (2s+1) · (8g ± 1) / 8)
UNIT = {T.IQ2_XXS: 8, T.IQ2_XS: 8, T.IQ2_S: 8, T.IQ3_XXS: 4, T.IQ3_S: 1, T.IQ1_S: 8, T.IQ1_M: 8}


def _block_scales(w: QTensor) -> np.ndarray:
    """Each block's fp16 scale as float32 [rows, blocks] (IQ1_M: the top nibbles of its four scale words)."""
    raw = w.raw.numpy().reshape(w.n_rows, w.n_cols // 256, -1)
    if w.qtype != T.IQ1_M:
        return raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    top = raw[..., 49:56:2].astype(np.uint16) >> 4
    return (top[..., 0] | top[..., 1] << 4 | top[..., 2] << 8 | top[..., 3] << 12).view(np.float16).astype(np.float32)


def _iq1_scales(w: QTensor) -> np.ndarray:
    """IQ1's odd integer scale of every 16 values, int64 [rows, cols / 16]."""
    raw = w.raw.numpy().reshape(w.n_rows, w.n_cols // 256, -1).astype(np.int64)
    if w.qtype == T.IQ1_S:
        qh = raw[..., 34:50:2] | raw[..., 35:50:2] << 8  # [rows, blocks, 8]: one per 32
        return np.repeat(2 * ((qh >> 12) & 7) + 1, 2, axis=-1).reshape(w.n_rows, -1)
    sc = raw[..., 48:56:2] | raw[..., 49:56:2] << 8  # [rows, blocks, 4]: one word per 64
    per32 = np.stack([sc & 63, (sc >> 6) & 63], axis=-1).reshape(*sc.shape[:2], 8)
    return np.stack([2 * (per32 & 7) + 1, 2 * ((per32 >> 3) & 7) + 1], axis=-1).reshape(w.n_rows, -1)


def _ggml_generic(w: QTensor, xr: ops.QuantRows) -> torch.Tensor:
    """ggml-cpu's vec_dot_iq*_q8_K_generic for every (activation row, weight row): exact integer sums per block
    (from the dequantized weights, exact multiples of d / UNIT), then its float32 steps in its order."""
    d = _block_scales(w)
    nb = w.n_cols // 256
    ints = np.rint(w.dequantize().numpy().astype(np.float64) * UNIT[w.qtype] /
                   np.repeat(d, 256, axis=1).astype(np.float64)).astype(np.int64)  # ls · grid · sign
    q = xr.q.numpy().astype(np.int64)

    def per_block(a: np.ndarray) -> np.ndarray:  # Σ over each block of a · q, [activation rows, weight rows, blocks]
        return np.einsum("rbk,mbk->mrb", a.reshape(w.n_rows, nb, 256), q.reshape(len(q), nb, 256))

    total = per_block(ints)
    dx = xr.d.numpy().astype(np.float32)
    acc = np.zeros((len(q), w.n_rows), np.float32)
    if w.qtype in (T.IQ1_S, T.IQ1_M):  # ints are ls · (8g + δ): split off Σ ls · δ · q, as ggml keeps it apart
        ls = np.repeat(_iq1_scales(w), 16, axis=1)
        delta = np.where(np.mod(ints // ls, 8) == 1, 1, -1)
        assert np.array_equal(ints % ls, np.zeros_like(ints))
        s2 = per_block(ls * delta)
        s1 = (total - s2) // 8
        for b in range(nb):
            step = (d[None, :, b] * dx[:, b:b + 1]) * (s1[..., b].astype(np.float32) +
                                                     np.float32(0.125) * s2[..., b].astype(np.float32))
            acc = acc + step
        return torch.from_numpy(acc)
    for b in range(nb):
        acc = acc + (d[None, :, b] * dx[:, b:b + 1]) * total[..., b].astype(np.float32)
    return torch.from_numpy(acc * np.float32({8: 0.125, 4: 0.25, 1: 1.0}[UNIT[w.qtype]]))


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_products_have_the_bits_of_ggml_generic_dot_products(qt: T, backend: ops.Backend) -> None:
    """Bit for bit what ggml-cpu's generic IQ dot products give for the same Q8_K rows: the same integers per block
    and the same float32 operations in the same order (a float step in another order is off in the last bits)."""
    w = _bind(_weight(qt, (24, 1024), seed=14), backend)
    x = _x(3, 1024, seed=15)
    xr = ops.quantize(x, "Q8_K", on_native=True, level=backend.level)
    assert torch.equal(ops.linear(x, w), _ggml_generic(w.weight, xr))


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_rows_are_batch_and_thread_invariant(qt: T, backend: ops.Backend) -> None:
    """Row i of an M-row product has the bits of a one-row product, for M past the kernel's row tile (64) and for
    one, two or three threads."""
    stored = _weight(qt, (48, 512), seed=2)
    w = _bind(stored, backend)
    x = _x(70, 512, seed=3)
    ref = torch.cat([ops.linear(x[i:i + 1].clone(), w) for i in range(70)])
    for threads in (1, 2, 3):
        wt = _bind(stored, replace(backend, threads=threads))
        assert torch.equal(ops.linear(x.clone(), wt), ref), threads


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_avx2_form_has_the_portable_bits(qt: T) -> None:
    """Both forms multiply the same integers exactly and run the same scalar float step per block."""
    if not native.cpu_avx2():
        pytest.skip("this CPU has no AVX2: there is no AVX2 form to compare")
    w = _weight(qt, (36, 2048), seed=4)
    x = _x(9, 2048, seed=5)
    avx2 = ops.linear(x, _bind(w, ops.backend_named("native-avx2")))
    assert torch.equal(ops.linear(x.clone(), _bind(w, ops.backend_named("native-portable"))), avx2)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qts", [(T.IQ2_XXS, T.IQ2_XXS, T.IQ3_S), (T.IQ1_M, T.IQ2_S, T.IQ3_XXS),
                                 (T.IQ2_XS, T.IQ1_S, T.IQ2_XXS)], ids=lambda q: "-".join(t.name for t in q))
def test_routed_experts_equal_the_torch_backend(qts: tuple[T, T, T], backend: ops.Backend) -> None:
    """IQ-typed expert stacks in the native experts runner (one call: grouping, gate/up, silu·up, down, slot sum)
    against the torch backend's dequantized experts with llama.cpp's activation rounding: float32 rounding of the
    products' scaling apart (an expert in the wrong slot is off by order 1)."""
    e_n, d, f = 8, 256, 512
    ws = [_weight(qts[0], (e_n, f, d), 8), _weight(qts[1], (e_n, f, d), 9), _weight(qts[2], (e_n, d, f), 10)]
    ex = ops.bind_experts(*ws, backend)
    assert ex.kind == "native"
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(11))
    router = torch.randn(e_n, d, generator=torch.Generator().manual_seed(12))
    w, idx = route(x @ router.T, 2)
    got = ops.moe_experts(x, idx, w, ex)
    twin = ops.moe_experts(x, idx, w, ops.bind_experts(*ws, ops.TORCH))
    torch.testing.assert_close(got, twin, rtol=0, atol=1e-5 * twin.abs().max().item())
    single = torch.cat([ops.moe_experts(x[i:i + 1], idx[i:i + 1], w[i:i + 1], ex) for i in range(6)])
    assert torch.equal(single, got)


# A KQUANT_MOE-shaped model (every row a multiple of 256) in an IQ2_XXS / IQ3_S mix: routed experts and the
# embedding IQ2_XXS, attention, GDN projections, shared expert and output IQ3_S.
IQ_MIX = {"ffn_gate_exps": T.IQ2_XXS, "ffn_up_exps": T.IQ2_XXS, "ffn_down_exps": T.IQ2_XXS,
          "token_embd": T.IQ2_XXS}


def _iq_model(path: Path) -> Path:
    spec = replace(KQUANT_MOE, seed=3)
    hp = hparams_of(spec)
    rng = np.random.default_rng(5)
    tensors: dict[str, np.ndarray | Raw] = {}
    for name, arr in random_tensors(hp, spec).items():
        qt = storage_type(name, arr.shape, T.IQ3_S, IQ_MIX)
        tensors[name] = arr if qt == T.F32 else Raw(random_iq_blocks(arr.shape, qt, rng, float(arr.std())), qt,
                                                      arr.shape)
    write_gguf(path, hp, tensors, fixture_vocab(spec.n_vocab), name="fixture-iq-mix")
    return path


def _greedy(path: Path, backend: ops.Backend, prompt: list[int], n: int) -> list[int]:
    m = load_model(open_model(path), n_ctx=256, backend=backend)
    cache = m.new_cache(256)
    logits = m.forward(prompt, cache, logit_rows="last").logits[-1]
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits = m.forward([out[-1]], cache, logit_rows="last").logits[-1]
    return out


def test_greedy_run_in_an_iq_mix_equals_the_torch_backend(tmp_path: Path) -> None:
    """A whole model in IQ2_XXS / IQ3_S: every native backend's greedy tokens are the torch backend's. The torch
    backend (dequantized weights) runs the prompt and the native continuation in one pass, which gives each position
    the bits of its step-by-step decode (tests/test_batched.py): its argmax at every step must be the token chosen."""
    path = _iq_model(tmp_path / "iq-mix.gguf")
    mf = open_model(path)
    assert {i.qtype for i in mf.tensors.values()} == {T.F32, T.IQ2_XXS, T.IQ3_S}
    model = load_model(mf, n_ctx=64, backend=ops.default_backend())
    assert isinstance(model.model.layers[0].ffn.w.experts.stacks[0], NativeLinear)  # the IQ products ran natively
    prompt = np.random.default_rng(13).integers(0, KQUANT_MOE.n_vocab - 3, 24).tolist()
    runs = {b.name: _greedy(path, b, prompt, 16) for b in ops.available_backends() if b.native}
    toks = next(iter(runs.values()))
    assert len(set(toks)) > 3  # not one token repeated: the run exercises the logits
    assert all(r == toks for r in runs.values()), runs
    twin = load_model(open_model(path), n_ctx=64, backend=ops.TORCH)
    logits = twin.forward(prompt + toks[:-1], twin.new_cache(64), logit_rows="all").logits
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == toks
