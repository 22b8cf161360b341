"""Native K-quant (Q2_K … Q6_K), Q8_0 and IQ4_XS products (engine/native, through engine.ops) in every instruction-set form the
machine runs: packed for AVX512-VNNI, AVX-VNNI and AVX2, stored order on AVX512 (and wherever weights stay mapped),
portable C. The packed forms of the 32-value nibble types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4: packed_nib.c) are checked here
beside them; their stored forms and products against the dequantized weight in tests/test_quant_products.py."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import ops
from engine.ops import native
from engine.ops.experts_pairs import pairs_product
from engine.ops.linear import NativeLinear
from engine.storage.qtensor import QTensor
from engine.storage.quantize import random_blocks
from tests.conftest import backend_params

TYPES = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.IQ4_XS, T.Q2_K, T.Q3_K]
PACKED_TYPES = TYPES + [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.MXFP4]  # every type a packing backend packs
NATIVE = backend_params(native_only=True)


@pytest.fixture(autouse=True)
def _built() -> None:
    assert native.available(), "the native library was not built (pip install -e . builds it)"


def _q8_k(x: torch.Tensor, portable: bool = False) -> ops.QuantRows:
    return ops.quantize(x, "Q8_K", on_native=True, level=0 if portable else ops.Backend().level)


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
    xr = _q8_k(x)
    b = x.reshape(-1, 256)
    mx = torch.gather(b, 1, b.abs().argmax(-1, keepdim=True)).double()
    iscale = torch.where(mx != 0, (-127.0 / mx).float().double(), torch.zeros_like(mx))
    q = torch.clamp(torch.round(iscale * b.double()), max=127)
    assert torch.equal(xr.q.view(-1, 256), q.to(torch.int8))
    d = torch.where(iscale != 0, (1.0 / iscale).float().double(), torch.zeros_like(iscale)).float()
    assert torch.equal(xr.d.view(-1, 1), d)
    assert torch.equal(xr.bsums, xr.q.view(5, -1, 16).sum(-1).to(torch.int16))
    # the torch twin's rounding reproduces the same values up to the last ulp of the scale
    torch.testing.assert_close(ops.round_for(x, "Q4_K"), (xr.q.view(5, -1, 256) * xr.d.unsqueeze(-1)).view(5, -1),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("form", ["avx512", "avx2"])
def test_activations_quantize_the_same_in_every_form_as_in_portable_c(form: str) -> None:
    """The Q8_K quantizer's AVX512 and AVX2 forms give the portable loop's quants, scales and sums (NaNs passed over
    by the maximum and quantized to 0, equal magnitudes: the first one's sign sets the scale)."""
    if form not in {b.name.removeprefix("native-") for b in ops.available_backends()}:
        pytest.skip(f"this CPU has no {form} form")
    x = _x(7, 2048, seed=3)
    x[2, 512:768] = float("nan")
    x[2, 600] = 3.0  # NaNs are passed over by the maximum
    x[3, 1024 + 5], x[3, 1024 + 77] = 7.5, -7.5
    got = ops.quantize(x.clone(), "Q8_K", on_native=True, level=ops.backend_named(f"native-{form}").level)
    want = _q8_k(x.clone(), portable=True)
    for f in ("q", "d", "bsums"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


@pytest.mark.parametrize("form", ["avx512vnni", "avx2", "portable"])
def test_activations_quantize_as_ggml_q8_0(form: str) -> None:
    """Q8_0 activation quants and f16-rounded scales of the native quantizer equal the torch twin's, bit for bit, in
    each form (the VNNI one where the CPU has it, AVX2, the portable loop); Q8_1's sums alike."""
    if form not in {b.name.removeprefix("native-") for b in ops.available_backends()}:
        pytest.skip(f"this CPU has no {form} form")
    level = ops.backend_named(f"native-{form}").level
    x = _x(5, 1024)
    x[1, 32:64] *= 1e-3  # a block whose scale is an f16 subnormal
    x[1, 64:96] *= 1e-9  # and one whose scale rounds to zero in f16
    xr = ops.quantize(x, "Q8_0", on_native=True, level=level)
    ref = ops.quantize(x.clone(), "Q8_0", on_native=False)
    assert xr.bsums is None and ref.bsums is None and xr.d.shape == (5, 32)
    assert torch.equal(xr.q, ref.q) and torch.equal(xr.d, ref.d)
    q1 = ops.quantize(x.clone(), "Q8_1", on_native=True, level=level)
    p1 = ops.quantize(x.clone(), "Q8_1", on_native=True, level=0)
    assert torch.equal(q1.q, ref.q) and torch.equal(q1.d, ref.d) and torch.equal(q1.s, p1.s)


def _packed_as_expected(w: NativeLinear) -> None:
    """A weight is packed exactly when its backend packs and it is one matrix (its last group padded with zero rows
    where its rows are not whole groups of 16) or a stack whose experts' rows are whole groups."""
    assert (w.packed is not None) == (w.backend.packs and (len(w.shape) == 2 or w.shape[-2] % native.GROUP == 0))


def _bind(w: QTensor, backend: ops.Backend) -> NativeLinear:
    lin = ops.bind(w, backend)
    assert isinstance(lin, NativeLinear)
    return lin


@pytest.mark.parametrize("rows", [80, 72], ids=["whole-groups", "partial-group"])
@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_products_equal_the_dequantized_product(qt: T, backend: ops.Backend, rows: int) -> None:
    """Against float64 products of the rounded activations and the gguf-exact dequantized weight: only the
    float32 rounding of the per-block scaling separates them. 72 rows are not whole packed groups: the last one is
    padded with zero rows, whose outputs are dropped."""
    w = _bind(_weight(qt, rows, 1024), backend)
    x = _x(5, 1024)
    ref = ops.round_for(x, qt.name).double() @ w.weight.dequantize().double().t()
    y = ops.linear(x, w)
    _packed_as_expected(w)
    assert y.dtype == torch.float32 and y.shape == (5, rows)
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-6 * ref.abs().max().item(), err


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_rows_are_batch_and_thread_invariant(qt: T, backend: ops.Backend) -> None:
    """Row i of an M-row product has the bits of a one-row product, for M past the kernel's row tile (64)
    and for one, two or three threads."""
    stored = _weight(qt, 48, 512, seed=2)
    w = _bind(stored, backend)
    x = _x(70, 512, seed=3)
    ref = torch.cat([ops.linear(x[i:i + 1].clone(), w) for i in range(70)])
    _packed_as_expected(w)
    for threads in (1, 2, 3):
        wt = _bind(stored, replace(backend, threads=threads))
        assert torch.equal(ops.linear(x.clone(), wt), ref), threads


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_expert_pairs_equal_products_per_expert(qt: T, backend: ops.Backend) -> None:
    """Routed-expert pairs: pair p (grouped by expert) gets the bits of row xrow[p] times its expert alone."""
    e_n, rows, k = 6, 32, 512
    rng = np.random.default_rng(4)
    stored = QTensor(random_blocks((e_n, rows, k), qt, rng, 1 / 16), qt, (e_n, rows, k))
    stack = _bind(stored, backend)
    x = _x(7, k, seed=5)
    experts = torch.tensor([0, 3, 5])
    xrow = torch.tensor([2, 6, 0, 1, 4, 5, 3, 6])
    starts = torch.tensor([0, 2, 3, 8])
    out = pairs_product(x, stack, xrow, experts, starts)
    _packed_as_expected(stack)
    for g, e in enumerate(experts.tolist()):
        one_expert = _bind(stored[e], backend)
        for p in range(int(starts[g]), int(starts[g + 1])):
            one = ops.linear(x[int(xrow[p])].unsqueeze(0).clone(), one_expert)
            assert torch.equal(out[p], one[0]), (e, p)


@pytest.mark.parametrize("qt", [t for t in PACKED_TYPES if t != T.Q8_0], ids=lambda t: t.name)
def test_packed_weights_are_the_stored_ones_reordered(qt: T) -> None:
    """The packed products agree with the stored-order ones of the same form to float32 rounding (the same integers,
    the float sums grouped differently); a backend without copies (weights left mapped) packs nothing; packing
    leaves a weight in the process's own memory alone."""
    from engine.storage.pages import release_pages

    b = ops.default_backend()
    if not b.packs:
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2: there is no packed form to compare")
    w = _weight(qt, 96, 2048, seed=6)
    x = _x(3, 2048, seed=7)
    mapped = _bind(w, replace(b, copies=False))
    stored = ops.linear(x, mapped)
    assert mapped.packed is None
    lin = _bind(w, b)
    packed = ops.linear(x.clone(), lin)
    assert lin.packed is not None
    torch.testing.assert_close(packed, stored, rtol=1e-5, atol=1e-5 * stored.abs().max().item())
    before = w.raw.clone()
    assert not release_pages(w.raw) and torch.equal(w.raw, before)  # numpy memory, not a file mapping


def test_packing_a_file_backed_weight_drops_its_pages_not_its_bytes() -> None:
    from engine.storage.modelfile import open_model
    from engine.storage.pages import release_pages
    from tests.fixtures import KQUANT_MOE, fixture_path

    mf = open_model(fixture_path(KQUANT_MOE))
    name = next(n for n, i in mf.tensors.items() if i.qtype == T.Q4_K and i.n_bytes >= 1 << 16)
    w = mf.tensor(name)
    before = w.raw.clone()
    assert release_pages(w.raw)  # a view of the file mapping
    assert torch.equal(w.raw, before)  # read back from the file


def _forms(*names: str) -> list[ops.Backend]:
    """The backends of `names` this machine runs; a skip where fewer than two are there to compare."""
    have = {b.name: b for b in ops.available_backends()}
    forms = [have[n] for n in names if n in have]
    if len(forms) < 2:
        pytest.skip(f"this CPU runs only {[b.name for b in forms]} of {list(names)}: nothing to compare")
    return forms


def test_q8_0_stored_products_have_the_same_bits_in_every_form() -> None:
    """dpbusd on w + 128 from −128·Σx (AVX512-VNNI, AVX-VNNI) and maddubs on |w| and x·sign(w) then madd by ones
    (AVX2) make the same int32 lanes (bytes 4l … 4l+3), and the float work after them is the same: the same bits.
    Weights left mapped (no copies), so every form reads the stored blocks."""
    forms = [replace(b, copies=False) for b in _forms("native-avx512", "native-avxvnni", "native-avx2")]
    w = _weight(T.Q8_0, 40, 2048, seed=10)
    x = _x(5, 2048, seed=11)
    first, *rest = (_bind(w, b) for b in forms)
    want = ops.linear(x, first)
    for lin in rest:
        assert torch.equal(ops.linear(x.clone(), lin), want), lin.backend.name
    assert all(lin.packed is None for lin in (first, *rest))


@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_packed_products_have_the_same_bits_in_every_form(qt: T) -> None:
    """The packed products in AVX512-VNNI, AVX-VNNI (VEX dpbusd/dpwssd on each 64-byte vector's two 8-row halves) and
    AVX2 (maddubs over the halves) give the same bits: for one activation row, a verify pass's few and more than the
    products' tile of 4, on two threads, and for routed-expert pairs (the same exact integers per lane, the same float
    work after them)."""
    forms = _forms("native-avx512vnni", "native-avxvnni", "native-avx2")
    w = _weight(qt, 48, 1024, seed=13)
    x = _x(9, 1024, seed=14)
    lins = [_bind(w, replace(b, threads=2)) for b in forms]
    for m in (1, 2, 3, 9):
        want = ops.linear(x[:m].clone(), lins[0])
        for lin in lins[1:]:
            assert torch.equal(ops.linear(x[:m].clone(), lin), want), (m, lin.backend.name)
    assert all(lin.packed is not None for lin in lins)
    experts = QTensor(random_blocks((3, 32, 512), qt, np.random.default_rng(15), 1 / 16), qt, (3, 32, 512))
    xrow, starts = torch.tensor([4, 0, 2, 1, 3]), torch.tensor([0, 1, 3, 5])
    got = [pairs_product(x[:5, :512].clone(), _bind(experts, b), xrow, torch.tensor([2, 0, 1]), starts) for b in forms]
    for g, b in zip(got[1:], forms[1:]):
        assert torch.equal(g, got[0]), b.name


@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_packing_chunk_by_chunk_gives_the_whole_packing(qt: T) -> None:
    """NativeLinear.pack packs a few 16-row groups at a time (and drops each chunk's file pages): chunks of one group,
    of a few, and the whole matrix at once give the same bytes; an expert stack's groups too."""
    b = ops.default_backend()
    if not b.packs:
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2: nothing is packed")
    for shape in ((80, 512), (3, 32, 512)):
        blocks = random_blocks(shape, qt, np.random.default_rng(12), 1 / 16)
        packs = []
        for chunk in (1, 3 * 16 * blocks.shape[-1], 1 << 40):
            lin = ops.bind(QTensor(torch.from_numpy(blocks.copy()), qt, shape), b)
            lin.pack(chunk_bytes=chunk)
            assert lin.packed is not None
            packs.append(lin.packed)
        assert torch.equal(packs[0], packs[2]) and torch.equal(packs[1], packs[2]), shape


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K, T.IQ4_XS, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0,
                                T.Q5_1, T.IQ4_NL, T.MXFP4], ids=lambda t: t.name)
def test_native_row_lookup_has_the_dequantization_bits(qt: T) -> None:
    """ops.embedding's native rows (a step's token embeddings) equal the torch dequantization bit for bit, for ids in
    any order and repeated; an id outside the table is an IndexError, not a read past it."""
    from tests.test_quant import random_tensor

    w = QTensor(torch.from_numpy(random_tensor(qt, (40, 512), 3, wide=True)).reshape(40, -1), qt, (40, 512))
    ids = torch.tensor([0, 39, 7, 7, 12])
    want = QTensor(w.raw[ids], qt, (5, 512)).dequantize()
    assert torch.equal(native.dequant_rows(w.raw, int(qt), ids, 512), want)
    assert torch.equal(ops.embedding(w, ids), want)
    with pytest.raises(IndexError):
        native.dequant_rows(w.raw, int(qt), torch.tensor([40]), 512)
