"""Native Q4_K / Q6_K / Q8_0 products (engine/native/kquant.c and q8_0.c through engine.kquant)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import kquant, nativelib
from engine.quant import QTensor
from engine.quantize import random_blocks
from engine.rowwise import round_activations

TYPES = [T.Q4_K, T.Q6_K, T.Q8_0]


@pytest.fixture(autouse=True)
def _built() -> None:
    assert nativelib.available(), "the native K-quant library was not built (pip install -e . builds it)"


def _weight(qt: T, rows: int, cols: int, seed: int = 0) -> QTensor:
    rng = np.random.default_rng(seed)
    return QTensor(random_blocks((rows, cols), qt, rng, 1 / np.sqrt(cols)), qt, (rows, cols))


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :256] = 0.0  # an all-zero block (scale 0)
    x[-1, 300] = -40.0  # a block dominated by one negative value
    x[1, 256 + 7], x[1, 256 + 200] = 9.0, -9.0  # equal magnitudes: the first one's sign sets the scale
    return x


def test_activations_quantize_as_ggml_q8_k() -> None:
    """Quants equal the torch twin's (round-half-even of −127/max · x, capped at 127); scales are 1/iscale
    correctly rounded in float32, as ggml's C computes them; sums per 16 are the quants' sums."""
    x = _x(5, 1024)
    xr = kquant.quantize_rows(x)
    b = x.reshape(-1, 256)
    mx = torch.gather(b, 1, b.abs().argmax(-1, keepdim=True)).double()
    iscale = torch.where(mx != 0, (-127.0 / mx).float().double(), torch.zeros_like(mx))
    q = torch.clamp(torch.round(iscale * b.double()), max=127)
    assert torch.equal(xr.q.view(-1, 256), q.to(torch.int8))
    d = torch.where(iscale != 0, (1.0 / iscale).float().double(), torch.zeros_like(iscale)).float()
    assert torch.equal(xr.d.view(-1, 1), d)
    assert torch.equal(xr.bsums, xr.q.view(5, -1, 16).sum(-1).to(torch.int16))
    # the torch twin's rounding reproduces the same values up to the last ulp of the scale
    torch.testing.assert_close(round_activations(x, "Q4_K"), (xr.q.view(5, -1, 256) * xr.d.unsqueeze(-1)).view(5, -1),
                               rtol=1e-6, atol=0)


def test_activations_quantize_the_same_in_avx512_and_portable_c(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x(7, 2048, seed=3)
    x[2, 512:768] = float("nan")
    x[2, 600] = 3.0  # NaNs are passed over by the maximum
    got = {}
    for portable in (False, True):
        monkeypatch.setattr(kquant, "PORTABLE", portable)
        got[portable] = kquant.quantize_rows(x.clone())
    for f in ("q", "d", "bsums"):
        assert torch.equal(getattr(got[False], f), getattr(got[True], f)), f


def test_activations_quantize_as_ggml_q8_0() -> None:
    """Q8_0 activation quants and f16-rounded scales equal the torch twin's (engine.q8dot), bit for bit."""
    from engine import q8dot

    x = _x(5, 1024)
    x[1, 32:64] *= 1e-3  # a block whose scale is an f16 subnormal
    x[1, 64:96] *= 1e-9  # and one whose scale rounds to zero in f16
    xr = kquant.quantize_q8_0(x)
    ref = q8dot.quantize_rows(x.clone())
    assert xr.bsums is None and xr.d.shape == (5, 32)
    assert torch.equal(xr.q.view(5, 32, 32), ref.q) and torch.equal(xr.d, ref.d)


# The kernel forms: Q4_K / Q6_K / Q8_0 packed for the VNNI products (kquant.pack: 16 rows interleaved, where the CPU has
# VNNI, for matrices of whole 16-row groups), the stored block order on AVX512, and the portable C.
MODES = {"packed": (True, False), "stored": (False, False), "portable": (True, True)}


def _mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    pack, portable = MODES[mode]
    monkeypatch.setattr(kquant, "PACK", pack)
    monkeypatch.setattr(kquant, "PORTABLE", portable)
    assert kquant.packs() == (mode == "packed" and nativelib.LIB.q8_isa() == 2)  # type: ignore[union-attr]


def _packed_as_expected(w: QTensor) -> None:
    """A weight is packed exactly when the packed products run and its matrices are whole groups of 16 rows."""
    assert (w.packed is not None) == (kquant.packs() and w.qtype in kquant.PACKED and w.shape[-2] % kquant.GROUP == 0)


@pytest.mark.parametrize("rows", [80, 72], ids=["whole-groups", "partial-group"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_products_equal_the_dequantized_product(monkeypatch, qt: T, mode: str, rows: int) -> None:
    """Against float64 products of the rounded activations and the gguf-exact dequantized weight: only the
    float32 rounding of the per-block scaling separates them. 72 rows are not whole packed groups: they stay in
    the stored order."""
    _mode(monkeypatch, mode)
    w = _weight(qt, rows, 1024)
    x = _x(5, 1024)
    ref = round_activations(x, qt.name).double() @ w.dequantize().double().t()
    y = kquant.matmul(x, w)
    _packed_as_expected(w)
    assert y.dtype == torch.float32 and y.shape == (5, rows)
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-6 * ref.abs().max().item(), err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_rows_are_batch_and_thread_invariant(monkeypatch, qt: T, mode: str) -> None:
    """Row i of an M-row product has the bits of a one-row product, for M past the kernel's row tile (64)
    and for one or two threads."""
    _mode(monkeypatch, mode)
    w = _weight(qt, 48, 512, seed=2)
    x = _x(70, 512, seed=3)
    ref = torch.cat([kquant.matmul(x[i:i + 1].clone(), w) for i in range(70)])
    _packed_as_expected(w)
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        monkeypatch.setattr(nativelib, "threads", lambda work: threads)
        assert torch.equal(kquant.matmul(x.clone(), w), ref), threads


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_expert_pairs_equal_products_per_expert(monkeypatch, qt: T, mode: str) -> None:
    """matmul_pairs: pair p (grouped by expert) gets the bits of row xrow[p] times its expert alone."""
    _mode(monkeypatch, mode)
    e_n, rows, k = 6, 32, 512
    rng = np.random.default_rng(4)
    stack = QTensor(random_blocks((e_n, rows, k), qt, rng, 1 / 16), qt, (e_n, rows, k))
    x = _x(7, k, seed=5)
    xr = kquant.quantize_for(x, qt)
    experts = torch.tensor([0, 3, 5])
    xrow = torch.tensor([2, 6, 0, 1, 4, 5, 3, 6])
    starts = torch.tensor([0, 2, 3, 8])
    out = kquant.matmul_pairs(xr, stack, xrow, experts, starts)
    _packed_as_expected(stack)
    for g, e in enumerate(experts.tolist()):
        for p in range(int(starts[g]), int(starts[g + 1])):
            one = kquant.matmul(x[int(xrow[p])].unsqueeze(0).clone(), stack[e])
            assert torch.equal(out[p], one[0]), (e, p)


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_packed_weights_are_the_stored_ones_reordered(monkeypatch, qt: T) -> None:
    """The packed products agree with the stored-order ones to float32 rounding (the same integers, the float sums
    grouped differently); packing leaves a weight in the process's own memory alone."""
    from engine.quant import release_pages

    w = _weight(qt, 96, 2048, seed=6)
    x = _x(3, 2048, seed=7)
    monkeypatch.setattr(kquant, "PACK", False)
    stored = kquant.matmul(x, w)
    monkeypatch.setattr(kquant, "PACK", True)
    packed = kquant.matmul(x.clone(), w)
    assert (w.packed is not None) == kquant.packs()
    torch.testing.assert_close(packed, stored, rtol=1e-5, atol=1e-5 * stored.abs().max().item())
    before = w.raw.clone()
    assert not release_pages(w.raw) and torch.equal(w.raw, before)  # numpy memory, not a file mapping


def test_packing_a_file_backed_weight_drops_its_pages_not_its_bytes() -> None:
    from engine.modelfile import open_model
    from engine.quant import release_pages
    from tests.fixtures import KQUANT_MOE, fixture_path

    mf = open_model(fixture_path(KQUANT_MOE))
    name = next(n for n, i in mf.tensors.items() if i.qtype == T.Q4_K and i.n_bytes >= 1 << 16)
    w = mf.tensor(name)
    before = w.raw.clone()
    assert release_pages(w.raw)  # a view of the file mapping
    assert torch.equal(w.raw, before)  # read back from the file
