"""engine.storage.qtensor against gguf-py's numpy reference on random blocks of every supported type."""
from __future__ import annotations

import warnings

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from engine.storage import qtensor as quant
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.storage.qtensor import QTensor
from engine.storage.quantize import F16_FIELDS  # byte offsets of the fp16 scale fields per block

TYPES = sorted(quant.SUPPORTED_TYPES, key=int)
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def finite_halfs(rng: np.random.Generator, n: int, wide: bool) -> np.ndarray:
    """n finite fp16 bit patterns: any finite value (subnormals, zeros, 65504) when `wide`,
    else moderate normal values, so matmul sums stay comparable."""
    if not wide:
        return (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    inf_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_nan] ^= 0x4000  # clear the top exponent bit: finite
    return bits


def random_tensor(qtype: QT, shape: tuple[int, ...], seed: int, wide: bool = True) -> np.ndarray:
    """What GGUFReader would hand over: random blocks with finite fp16 scales (bytes), or a typed
    array for F32/F16."""
    rng = np.random.default_rng(seed)
    if qtype == QT.F32:
        return rng.standard_normal(shape, dtype=np.float32)
    if qtype == QT.F16:
        return rng.standard_normal(shape).astype(np.float16)
    bs, ts = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // bs
    blocks = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        blocks[:, off:off + 2] = finite_halfs(rng, n_blocks, wide).view(np.uint8).reshape(-1, 2)
    if qtype == QT.IQ1_M:
        # the fp16 scale is the top nibble of each of the four trailing uint16 scale words
        d = finite_halfs(rng, n_blocks, wide)
        words = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            words[:, k] |= ((d >> (4 * k)) & 0xF) << 12
        blocks[:, 48:56] = words.view(np.uint8)
    if not wide and qtype in (QT.BF16, QT.MXFP4):
        # keep magnitudes moderate: bf16 exponent byte / e8m0 exponent near 1.0
        if qtype == QT.BF16:
            blocks[:, 1] = 0x3C + (blocks[:, 1] & 0x81)
        else:
            blocks[:, 0] = 120 + (blocks[:, 0] & 7)
    return blocks.reshape(*shape[:-1], shape[-1] // bs * ts)


def cols_for(qtype: QT, n_blocks: int = 3) -> int:
    return GGML_QUANT_SIZES[qtype][0] * n_blocks if qtype not in FLOAT_TYPES else 40


def assert_bit_identical(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == np.float32
    nan = np.isnan(ref)
    assert np.array_equal(nan, np.isnan(ours)), "NaN positions differ"
    a, b = ours.view(np.uint32)[~nan], ref.view(np.uint32)[~nan]
    bad = np.flatnonzero(a != b)
    assert bad.size == 0, f"{bad.size} values differ, first: {ours[~nan][bad[0]]!r} vs {ref[~nan][bad[0]]!r}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_bit_identical_to_gguf(qtype: QT) -> None:
    shape = (5, cols_for(qtype))
    data = random_tensor(qtype, shape, seed=int(qtype))
    ref = gq.dequantize(data, qtype).astype(np.float32, copy=False)
    out = QTensor(data, qtype, shape).dequantize()
    assert out.dtype == torch.float32 and tuple(out.shape) == shape
    assert_bit_identical(out.numpy(), ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_ranges_and_dtype(qtype: QT) -> None:
    shape = (6, cols_for(qtype, 2))
    t = QTensor(random_tensor(qtype, shape, seed=100 + int(qtype)), qtype, shape)
    full = t.dequantize().numpy()
    for rows in (slice(1, 4), slice(5, 6), slice(-2, None), slice(0, 0)):
        assert_bit_identical(t.dequantize(rows).numpy(), full[rows])
    half = t.dequantize(slice(2, 5), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    # same f32 -> bf16 cast on both sides, so compare bits (NaN-safe)
    assert torch.equal(half.view(torch.int16), torch.from_numpy(full[2:5]).to(torch.bfloat16).view(torch.int16))
    with pytest.raises(ValueError):
        t.dequantize(slice(0, 6, 2))


def test_chunked_full_dequantize_matches() -> None:
    shape = (13, 512)
    data = random_tensor(QT.Q4_K, shape, seed=7)
    ref = gq.dequantize(data, QT.Q4_K)
    t = QTensor(data, QT.Q4_K, shape)
    tile = 3 * 512  # 3-row chunks, last one partial
    assert_bit_identical(t.dequantize(tile_elements=tile).numpy(), ref)
    with np.errstate(over="ignore"):  # wide scales overflow fp16 to inf on both sides
        ref16 = ref.astype(np.float16).astype(np.float32)
    assert_bit_identical(t.dequantize(dtype=torch.float16, tile_elements=tile).float().numpy(), ref16)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0, QT.IQ2_XXS, QT.F16, QT.BF16, QT.MXFP4], ids=lambda t: t.name)
def test_getitem_on_stacked_experts(qtype: QT) -> None:
    shape = (3, 4, cols_for(qtype, 2))
    data = random_tensor(qtype, shape, seed=3)
    t = QTensor(data, qtype, shape)
    assert t.n_rows == 12 and len(t) == 3
    full = t.dequantize()
    assert tuple(full.shape) == shape
    for i in (0, 1, 2, -1):
        e = t[i]
        assert e.shape == shape[1:] and e.qtype == qtype
        assert e.nbytes == t.nbytes // 3
        # a view into the same bytes, not a copy
        assert e.raw.data_ptr() == t.raw.data_ptr() + (i % 3) * e.nbytes
        assert torch.equal(e.dequantize().view(torch.int32), full[i].view(torch.int32))  # NaN-safe
    with pytest.raises(IndexError):
        t[3]
    with pytest.raises(IndexError):
        t[0][0][0]  # a 1-D row cannot be indexed


def _tolerance(ref: torch.Tensor) -> dict[str, float]:
    # only summation order differs from the reference product
    return {"rtol": 1e-4, "atol": 1e-5 * max(1.0, float(ref.abs().max()))}


@pytest.mark.parametrize("xshape", [(1,), (7,), (2, 3), (40,)], ids=["1", "7", "2x3", "40"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantizing_linear_matches_dense(qtype: QT, xshape: tuple[int, ...]) -> None:
    """The torch backend's product for types without integer kernels: the weight dequantized tile by tile, x rounded
    as llama.cpp rounds it for that type, one independent product per row."""
    from engine import ops
    from engine.ops.linear import DequantLinear

    k = cols_for(qtype, 2)
    shape = (11, k)
    t = QTensor(random_tensor(qtype, shape, seed=11, wide=False), qtype, shape)
    lin = DequantLinear(t, ops.TORCH)
    x = torch.randn(*xshape, k, generator=torch.Generator().manual_seed(5))
    y = ops.linear(x, lin)
    ref = ops.round_for(x, qtype.name) @ t.dequantize().T
    assert y.shape == (*xshape, 11) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, **_tolerance(ref))


def test_dequantizing_linear_never_materialises_whole_weight() -> None:
    from engine import ops
    from engine.ops.linear import DequantLinear, tile_rows

    n, k = 1024, 4096  # 4M elements: 16 MiB in fp32, 2.25 MiB as Q4_K
    t = QTensor(random_tensor(QT.Q4_K, (n, k), seed=9, wide=False), QT.Q4_K, (n, k))
    assert tile_rows(t) * k <= quant.TILE_ELEMENTS < n * k
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    y = ops.linear(x, DequantLinear(t, ops.TORCH))
    rows = slice(100, 103)  # spot-check against a direct dequant of a few rows
    torch.testing.assert_close(y[0, rows], ops.round_for(x, "Q4_K")[0] @ t.dequantize(rows).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [QT.TQ1_0, QT.Q8_1, QT.Q8_K], ids=lambda t: t.name)
def test_unsupported_type_raises(qtype: QT) -> None:
    bs, ts = GGML_QUANT_SIZES[qtype]
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        QTensor(np.zeros((2, ts), dtype=np.uint8), qtype, (2, bs))
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        quant.check_supported(qtype)


def test_unknown_type_id_raises() -> None:
    with pytest.raises(UnsupportedModelError, match="ggml type 4"):
        QTensor(np.zeros((1, 18), dtype=np.uint8), 4, (1, 32))


def test_bad_sizes_raise() -> None:
    with pytest.raises(ModelFormatError):
        QTensor(np.zeros((2, 34), dtype=np.uint8), QT.Q8_0, (2, 64))  # 2 blocks per row expected
    with pytest.raises(ModelFormatError):
        QTensor(np.zeros((2, 34), dtype=np.uint8), QT.Q8_0, (2, 40))  # not a multiple of 32


def test_zero_copy_from_readonly_memmap(tmp_path) -> None:
    data = random_tensor(QT.Q6_K, (4, 512), seed=4)
    path = tmp_path / "w.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=data.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = QTensor(mm, QT.Q6_K, (4, 512))
    assert t.raw.data_ptr() == mm.ctypes.data and t.nbytes == data.nbytes
    assert_bit_identical(t.dequantize().numpy(), gq.dequantize(data, QT.Q6_K))


def test_sizes_and_names() -> None:
    assert quant.tensor_nbytes(QT.Q4_K, (3, 4, 512)) == 12 * 2 * 144
    assert quant.tensor_nbytes(QT.F32, (7,)) == 28
    assert quant.block_size(QT.Q8_0) == 32 and quant.type_size(QT.Q8_0) == 34
    assert quant.row_nbytes(QT.IQ4_XS, 256) == 136
    assert quant.type_name(QT.IQ2_XXS) == "IQ2_XXS" and quant.type_name(4) == "ggml type 4"
    t = QTensor(random_tensor(QT.F16, (2, 3, 8), seed=0), QT.F16, (2, 3, 8))
    assert t.n_rows == 6 and t.n_cols == 8 and t.nbytes == 96


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_device_generic(qtype: QT) -> None:
    """The unpacking is torch ops only: it runs (shape-wise) on the meta device, as on CUDA."""
    shape = (3, cols_for(qtype))
    t = QTensor(random_tensor(qtype, shape, seed=0), qtype, shape)
    assert t.to("cpu") is t
    m = t.to("meta")
    assert m.raw.device.type == "meta" and m.shape == shape and m.qtype == qtype
    assert m.dequantize().shape == shape and m.dequantize().device.type == "meta"
    assert t.dequantize(device="meta", dtype=torch.float16).dtype == torch.float16
    from engine import ops

    lin = ops.bind(m, ops.default_backend())  # a native backend falls back to torch off the CPU
    assert lin.backend.kind == "torch"
    assert ops.linear(torch.empty(2, shape[1], device="meta"), lin).shape == (2, 3)
