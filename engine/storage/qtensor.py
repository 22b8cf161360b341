"""GGUF tensors kept in their stored ggml block format, dequantized on demand with torch ops.

Every unpacking kernel mirrors the float operations of gguf-py's numpy reference
(``gguf.quants``) in the same order, so results are bit-identical to it; integer work
(nibble/bit extraction, lookups, sign flips) is free to differ since it is exact.
Kernels read a ``[n_blocks, type_size]`` uint8 tensor and write float32 into a given buffer,
with torch ops only, so they run wherever the bytes are (CPU, CUDA).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.storage.pages import tune_malloc

Kernel = Callable[[torch.Tensor, torch.Tensor], None]

# Elements per dequantized tile (8 MiB of fp32). Each tile costs ~30 torch ops whatever its
# size, so small tiles are overhead-bound: on 2 threads 2M elements beat 1M by ~10% and 256K
# by 2x, 4M was slower again (bench/quant.py tile sweep).
TILE_ELEMENTS = 1 << 21

_FLOAT_DTYPES: dict[QT, torch.dtype] = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}

tune_malloc()  # dequant tiles allocate multi-MB temporaries on every pass


def type_name(qtype: QT | int) -> str:
    try:
        return QT(qtype).name
    except ValueError:
        return f"ggml type {int(qtype)}"


def block_size(qtype: QT) -> int:
    """Logical elements per block (1 for float types)."""
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: QT) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[qtype][1]


def row_nbytes(qtype: QT, n_cols: int) -> int:
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n_cols % bs:
        raise ModelFormatError(f"row of {n_cols} elements is not a multiple of the {type_name(qtype)} block size {bs}")
    return n_cols // bs * ts


def tensor_nbytes(qtype: QT, shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1]) * row_nbytes(qtype, shape[-1])


def check_supported(qtype: QT | int) -> QT:
    try:
        qt = QT(qtype)
    except ValueError:
        qt = None
    if qt is None or qt not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedModelError(f"tensor type {type_name(qtype)} is not supported (supported: {names})")
    return qt


# ---------------------------------------------------------------------------------------------
# Device-cached constants


def _grid_rows(cls: type) -> np.ndarray:
    """gguf's IQ grid as an int8 [n_entries, width] array (grid values are small integers)."""
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return grid.astype(np.int8)


def _sign_rows(sign_bytes: np.ndarray) -> np.ndarray:
    """[n] sign bytes -> int8 [n, 8] of +1/-1 (bit i set = value i negative)."""
    bits = (sign_bytes.reshape(-1, 1) >> np.arange(8, dtype=np.uint8)) & 1
    return (1 - 2 * bits.astype(np.int8)).astype(np.int8)


@functools.lru_cache(maxsize=None)
def _np_tables() -> dict[str, np.ndarray]:
    """int8 [n_entries, width] lookup tables, from gguf-py's own constants."""
    ksigns = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
    return {
        "iq2xxs": _grid_rows(gq.IQ2_XXS),
        "iq2xs": _grid_rows(gq.IQ2_XS),
        "iq2s": _grid_rows(gq.IQ2_S),
        "iq3xxs": _grid_rows(gq.IQ3_XXS),
        "iq3s": _grid_rows(gq.IQ3_S),
        "iq1s8": np.concatenate((8 * _grid_rows(gq.IQ1_S) + 1, 8 * _grid_rows(gq.IQ1_S) - 1)),
        "ksigns": _sign_rows(ksigns),  # 7-bit index -> 8 signs (parity-completed)
        "signs": _sign_rows(np.arange(256, dtype=np.uint8)),  # raw sign byte -> 8 signs
        "bits": ((np.arange(256, dtype=np.uint8).reshape(-1, 1) >> np.arange(8, dtype=np.uint8)) & 1).astype(np.int8),
    }


_WORD = {2: np.int16, 4: np.int32, 8: np.int64}


@functools.lru_cache(maxsize=None)
def _table(name: str, device: torch.device) -> torch.Tensor:
    """Table `name` on `device`, each int8 row packed into one machine word so that a single
    index_select fetches a whole row."""
    arr = np.ascontiguousarray(_np_tables()[name])
    return torch.from_numpy(arr.view(_WORD[arr.shape[1]]).reshape(-1).copy()).to(device)


def _lookup(name: str, idx: torch.Tensor) -> torch.Tensor:
    """Rows of table `name` at integer `idx`, as int8 [*idx.shape, width]."""
    rows = _table(name, idx.device).index_select(0, idx.reshape(-1).to(torch.int32))
    return rows.view(torch.int8).view(*idx.shape, -1)


# ---------------------------------------------------------------------------------------------
# Field helpers


def _field(b: torch.Tensor, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [lo, hi) of every block reinterpreted as `dtype`; copies only this field when the
    block stride is not aligned to the dtype."""
    f = b[:, lo:hi]
    if dtype == torch.uint8:
        return f
    try:
        return f.view(dtype)
    except RuntimeError:
        return f.contiguous().view(dtype)


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 scale at byte `off` of every block, as float32 [nb, 1]."""
    return _field(b, off, off + 2, torch.float16).float()


def _fields(x: torch.Tensor, shifts: tuple[int, ...], mask: int, dim: int) -> torch.Tensor:
    """Stack (x >> s) & mask for each shift along a new `dim`. Scalar shifts plus one stack are
    much faster on CPU than one broadcast shift by a tensor of shift counts."""
    return torch.stack([(x >> s if s else x) & mask for s in shifts], dim=dim)


def _words(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] viewed as the widest int words its alignment allows (never copies)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if x.shape[-1] % dt.itemsize == 0:
            try:
                return x.view(dt)
            except RuntimeError:
                continue
    return x


def _planes(x: torch.Tensor, width: int, count: int, at: int = 0) -> torch.Tensor:
    """uint8 [..., n] -> [..., count, n]: plane k holds field k (bits k*width.. of every byte)
    moved to bit `at`. Works on whole words with a per-byte mask: shifted-in neighbour bits
    always land outside the mask."""
    w = _words(x)
    mask = sum(((((1 << width) - 1) << at) << (8 * i)) for i in range(w.element_size()))
    parts = []
    for k in range(count):
        sh = k * width - at
        parts.append((w >> sh if sh > 0 else w << -sh if sh < 0 else w) & mask)
    return torch.stack(parts, dim=-2).view(torch.uint8)


def _nibbles(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2, n]: all low nibbles, then all high nibbles (ggml order)."""
    return _planes(x, 4, 2)


def _inner(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """uint8 [nb, n] -> [nb, n * count]: the fields of each byte adjacent, lowest first."""
    return _fields(x, tuple(range(0, count * width, width)), (1 << width) - 1, -1).flatten(-2)


def _spread_bits(x: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, n] -> uint8 [nb, 8n]: bit k of byte j becomes element 8j + k (0/1), the bit
    order of a little-endian word. One table lookup per byte."""
    return _lookup("bits", x).flatten(-2).view(torch.uint8)


# ---------------------------------------------------------------------------------------------
# Kernels: write float32 values of blocks uint8 [nb, type_size] into out [nb, block_size].
# Each mirrors gguf.quants' float ops: the int -> float copy, then the same multiplies/adds
# (a*b == b*a, so `out.mul_(d)` matches `d * q` bit for bit).


def _k_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(b[:, 2:].view(torch.int8), _f16(b, 0), out=out)  # int8 → float32 then × d, in one op


def _k_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 2:]).view(torch.int8)
    q -= 8
    out.view(q.shape).copy_(q)
    out.mul_(_f16(b, 0))


def _k_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 4:])
    out.view(q.shape).copy_(q)
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(b: torch.Tensor, qh_off: int) -> torch.Tensor:
    # bit i of the little-endian uint32 qh is the 5th bit of element i
    ql = _nibbles(b[:, qh_off + 4:]).view(-1, 32)
    return ql.add_(_spread_bits(b[:, qh_off:qh_off + 4]), alpha=16)


def _k_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _q5(b, 2).view(torch.int8)
    q -= 16
    out.copy_(q)
    out.mul_(_f16(b, 0))


def _k_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5(b, 4))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _k_q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).view(nb, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).view(nb, 16, 1)
    o = out.view(nb, 16, 16)
    o.copy_(_planes(b[:, 16:80].reshape(nb, 2, 32), 2, 4).view(nb, 16, 16))
    o.mul_(dl).sub_(ml)


def _k_q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    lsc = _nibbles(b[:, 96:104]).view(nb, 16)
    hsc = _planes(b[:, 104:108], 2, 4).view(nb, 16)
    sc = (lsc | (hsc << 4)).view(torch.int8) - 32
    dl = (_f16(b, 108) * sc.float()).view(nb, 16, 1)
    ql = _planes(b[:, 32:96].reshape(nb, 2, 32), 2, 4).view(nb, 16, 16)
    qh = _planes(b[:, :32], 1, 8, at=2).view(nb, 16, 16)
    # a cleared hmask bit subtracts 4
    q = ql.view(torch.int8) - (qh ^ 4).view(torch.int8)
    o = out.view(nb, 16, 16)
    o.copy_(q)
    o.mul_(dl)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and mins packed in 12 bytes (Q4_K/Q5_K), as float32 [nb, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _k_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    o = out.view(nb, 8, 32)
    o.copy_(_nibbles(b[:, 16:].reshape(nb, 4, 32)).view(nb, 8, 32))
    o.mul_((_f16(b, 0) * sc).view(nb, 8, 1)).sub_((_f16(b, 2) * mn).view(nb, 8, 1))


def _k_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    ql = _nibbles(b[:, 48:].reshape(nb, 4, 32)).view(nb, 8, 32)
    ql |= _planes(b[:, 16:48], 1, 8, at=4)
    o = out.view(nb, 8, 32)
    o.copy_(ql)
    o.mul_((_f16(b, 0) * sc).view(nb, 8, 1)).sub_((_f16(b, 2) * mn).view(nb, 8, 1))


def _k_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).view(nb, 16, 1)
    q = _nibbles(b[:, :128].reshape(nb, 2, 64)).view(nb, 256)
    q |= _planes(b[:, 128:192].reshape(nb, 2, 32), 2, 4, at=4).view(nb, 256)
    q = q.view(torch.int8)
    q -= 32
    o = out.view(nb, 16, 16)
    o.copy_(q.view(nb, 16, 16))
    o.mul_(dl)


def _signed(grid: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    # db * (±g) == (db * g) * ±1 exactly, so signs are applied to the int8 grid values
    grid *= signs
    return grid


def _k_iq2_xxs(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    q = b[:, 2:].reshape(nb, 8, 8)  # per 32 values: 4 grid indices, then a uint32 of signs/scale
    aux = q[:, :, 4:].contiguous().view(torch.int32)  # [nb, 8, 1]
    db = _f16(b, 0).view(nb, 1, 1) * (0.5 + ((aux >> 28) & 0x0F).float()) * 0.25
    sidx = _fields(aux.squeeze(-1), (0, 7, 14, 21), 0x7F, -1)
    o = out.view(nb, 8, 32)
    o.copy_(_signed(_lookup("iq2xxs", q[:, :, :4]), _lookup("ksigns", sidx)).view(nb, 8, 32))
    o.mul_(db)


def _k_iq2_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    qs = _field(b, 2, 66, torch.int16)  # [nb, 32]: 9-bit grid index, 7-bit sign index
    sc = _inner(b[:, 66:74], 4, 2)
    db = (_f16(b, 0) * (0.5 + sc.float()) * 0.25).view(nb, 16, 1)
    o = out.view(nb, 16, 16)
    o.copy_(_signed(_lookup("iq2xs", qs & 0x1FF), _lookup("ksigns", (qs >> 9) & 0x7F)).view(nb, 16, 16))
    o.mul_(db)


def _k_iq2_s(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    sc = _inner(b[:, 74:82], 4, 2)
    db = (_f16(b, 0) * (0.5 + sc.float()) * 0.25).view(nb, 16, 1)
    qh = _inner(b[:, 66:74], 2, 4)
    idx = b[:, 2:34].int() | (qh.int() << 8)
    o = out.view(nb, 16, 16)
    o.copy_(_signed(_lookup("iq2s", idx), _lookup("signs", b[:, 34:66])).view(nb, 16, 16))
    o.mul_(db)


def _k_iq3_xxs(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    aux = _field(b, 66, 98, torch.int32)  # [nb, 8]
    db = (_f16(b, 0) * (0.5 + ((aux >> 28) & 0x0F).float()) * 0.5).view(nb, 8, 1)
    sidx = _fields(aux, (0, 7, 14, 21), 0x7F, -1)
    g = _lookup("iq3xxs", b[:, 2:66]).view(nb, 8, 4, 8)
    o = out.view(nb, 8, 32)
    o.copy_(_signed(g, _lookup("ksigns", sidx)).view(nb, 8, 32))
    o.mul_(db)


def _k_iq3_s(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    sc = _inner(b[:, 106:110], 4, 2)
    db = (_f16(b, 0) * (1 + 2 * sc.int()).float()).view(nb, 8, 1)
    qh = _spread_bits(b[:, 66:74])
    idx = b[:, 2:66].int() | (qh.int() << 8)
    g = _lookup("iq3s", idx).view(nb, 32, 8)
    o = out.view(nb, 8, 32)
    o.copy_(_signed(g, _lookup("signs", b[:, 74:106])).view(nb, 8, 32))
    o.mul_(db)


# IQ1 values are dl * (g + delta) with g in {-1, 0, 1} and delta = ±1/8. The table holds
# 8 * (g + delta) as int8 (rows 2048.. for negative delta) and dl / 8 scales it: dl / 8 is exact
# (dl >= 2^-24 cannot underflow), so the single rounding of the product matches the reference.


def _k_iq1_s(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    qh = _field(b, 34, 50, torch.int16).int()  # [nb, 8]
    dl8 = _f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float() * 0.125
    idx = b[:, 2:34].int().view(nb, 8, 4) | (_fields(qh, (0, 3, 6, 9), 7, -1) << 8)
    idx |= ((qh >> 15) & 1).unsqueeze(-1) << 11
    o = out.view(nb, 8, 32)
    o.copy_(_lookup("iq1s8", idx).view(nb, 8, 32))
    o.mul_(dl8.view(nb, 8, 1))


def _k_iq1_m(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    sc = _field(b, 48, 56, torch.int16).int() & 0xFFFF  # [nb, 4]
    # the fp16 super-block scale is spread over the top nibble of the four scale words
    top = sc >> 12
    dbits = top[:, :1] | (top[:, 1:2] << 4) | (top[:, 2:3] << 8) | (top[:, 3:4] << 12)
    d = (dbits - ((dbits >> 15) << 16)).to(torch.int16).view(torch.float16).float()  # [nb, 1]
    s = _fields(sc, (0, 3, 6, 9), 7, -1).view(nb, 16)
    dl8 = d * (2 * s + 1).float() * 0.125
    qh = _inner(b[:, 32:48], 4, 2).int()  # [nb, 32]: 3 index bits + delta sign per 8 values
    idx = b[:, :32].int() | ((qh & 7) << 8) | ((qh & 8) << 8)
    o = out.view(nb, 16, 16)
    o.copy_(_lookup("iq1s8", idx).view(nb, 16, 16))
    o.mul_(dl8.view(nb, 16, 1))


@functools.lru_cache(maxsize=None)
def _pair_table(kvalues: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 [2, 256]: the codebook value of the low (row 0) and high (row 1) nibble of a byte."""
    kv = np.array(kvalues, dtype=np.float32)
    i = np.arange(256)
    return torch.from_numpy(np.stack((kv[i & 0x0F], kv[i >> 4]))).to(device)


def _kv_pairs(x: torch.Tensor, kvalues: tuple[int, ...], out: torch.Tensor) -> None:
    """4-bit codebook values of packed bytes x [nb, g, 16] into out [nb, g, 2, 16] (low nibbles
    first). One gather indexed by whole bytes, written straight into `out`."""
    nb, g = x.shape[0], x.shape[1]
    tab = _pair_table(kvalues, x.device).view(1, 1, 2, 256).expand(nb, g, 2, 256)
    idx = x.long().unsqueeze(2).expand(nb, g, 2, 16)
    torch.gather(tab, 3, idx, out=out.view(nb, g, 2, 16))


def _k_iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    _kv_pairs(b[:, 2:].unsqueeze(1), gq.IQ4_NL.kvalues, out)
    out.mul_(_f16(b, 0))


def _k_iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    nb = b.shape[0]
    sh = _field(b, 2, 4, torch.int16).int()  # [nb, 1]
    hi = _fields(sh.squeeze(-1), tuple(range(0, 16, 2)), 3, -1)
    lo = _inner(b[:, 4:8], 4, 2).int()
    dl = (_f16(b, 0) * ((lo | (hi << 4)) - 32).float()).view(nb, 8, 1)
    _kv_pairs(b[:, 8:].reshape(nb, 8, 16), gq.IQ4_NL.kvalues, out)
    out.view(nb, 8, 32).mul_(dl)


def _k_mxfp4(b: torch.Tensor, out: torch.Tensor) -> None:
    e = b[:, :1].int()
    # e8m0 scale halved (ggml_e8m0_to_fp32_half): subnormal for e < 2
    d = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)
    _kv_pairs(b[:, 1:].unsqueeze(1), gq.MXFP4.kvalues, out)
    out.mul_(d)


_KERNELS: dict[QT, Kernel] = {
    QT.Q8_0: _k_q8_0,
    QT.Q4_0: _k_q4_0,
    QT.Q4_1: _k_q4_1,
    QT.Q5_0: _k_q5_0,
    QT.Q5_1: _k_q5_1,
    QT.Q2_K: _k_q2_k,
    QT.Q3_K: _k_q3_k,
    QT.Q4_K: _k_q4_k,
    QT.Q5_K: _k_q5_k,
    QT.Q6_K: _k_q6_k,
    QT.IQ1_S: _k_iq1_s,
    QT.IQ1_M: _k_iq1_m,
    QT.IQ2_XXS: _k_iq2_xxs,
    QT.IQ2_XS: _k_iq2_xs,
    QT.IQ2_S: _k_iq2_s,
    QT.IQ3_XXS: _k_iq3_xxs,
    QT.IQ3_S: _k_iq3_s,
    QT.IQ4_NL: _k_iq4_nl,
    QT.IQ4_XS: _k_iq4_xs,
    QT.MXFP4: _k_mxfp4,
}

SUPPORTED_TYPES: frozenset[QT] = frozenset(_KERNELS) | frozenset(_FLOAT_DTYPES)


# ---------------------------------------------------------------------------------------------
# The tensor type


def _as_byte_rows(data: np.ndarray | torch.Tensor, n_rows: int, row_bytes: int) -> torch.Tensor:
    """A zero-copy uint8 [n_rows, row_bytes] torch view of the stored bytes."""
    if isinstance(data, torch.Tensor):
        t = data if data.dtype == torch.uint8 else data.contiguous().view(torch.uint8)
        if t.numel() != n_rows * row_bytes:
            raise ModelFormatError(f"tensor holds {t.numel()} bytes, expected {n_rows * row_bytes}")
        return t.reshape(n_rows, row_bytes)
    arr = data if data.dtype == np.uint8 else data.view(np.uint8)
    if arr.size != n_rows * row_bytes:
        raise ModelFormatError(f"tensor holds {arr.size} bytes, expected {n_rows * row_bytes}")
    arr = arr.reshape(n_rows, row_bytes)
    with warnings.catch_warnings():
        # mmap'ed GGUF data is read-only; we never write through this view
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _rows_range(rows: slice | None, n_rows: int) -> tuple[int, int]:
    if rows is None:
        return 0, n_rows
    start, stop, step = rows.indices(n_rows)
    if step != 1:
        raise ValueError("row slices must be contiguous (step 1)")
    return start, max(start, stop)


class QTensor:
    """A GGUF tensor in its stored ggml block format (no copy of the mmap'ed bytes).

    `raw` is a uint8 [n_rows, bytes_per_row] torch tensor (a view of the GGUF mmap on CPU, or
    a device copy after `.to()`); `shape` is the logical torch shape, reversed(ne).
    """

    __slots__ = ("qtype", "shape", "raw")

    def __init__(self, data: np.ndarray | torch.Tensor, qtype: QT | int, shape: tuple[int, ...]) -> None:
        self.qtype: QT = check_supported(qtype)
        self.shape: tuple[int, ...] = tuple(int(s) for s in shape)
        if not self.shape or min(self.shape) < 0:
            raise ModelFormatError(f"invalid tensor shape {self.shape}")
        self.raw: torch.Tensor = _as_byte_rows(data, self.n_rows, row_nbytes(self.qtype, self.shape[-1]))

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def n_cols(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def __repr__(self) -> str:
        return f"QTensor({self.qtype.name}, shape={self.shape}, device={self.device})"

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> QTensor:
        """Index along the first dim (e.g. one expert of a stacked tensor), zero-copy."""
        if len(self.shape) < 2:
            raise IndexError("cannot index a 1-D QTensor")
        n = self.shape[0]
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"index {i} out of range for dim of size {n}")
        per = self.n_rows // n
        return QTensor(self.raw[j * per:(j + 1) * per], self.qtype, self.shape[1:])

    def to(self, device: torch.device | str) -> QTensor:
        """The same blocks, still quantized, with their bytes on `device`."""
        device = torch.device(device)
        if self.raw.device == device:
            return self
        return QTensor(self.raw.to(device), self.qtype, self.shape)

    def dequantize(
        self,
        rows: slice | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        tile_elements: int = TILE_ELEMENTS,
    ) -> torch.Tensor:
        """Float values of rows `rows` of the flattened [n_rows, n_cols] view as [len, n_cols]
        (the full logical shape when rows is None). Unpacking runs on `device` (default: where
        the bytes live), `tile_elements` at a time; values are computed in float32 and then cast to `dtype`."""
        r0, r1 = _rows_range(rows, self.n_rows)
        dev = self.raw.device if device is None else torch.device(device)
        k, n = self.n_cols, r1 - r0
        out = torch.empty(n, k, dtype=dtype, device=dev)
        # chunked so the unpacking temporaries stay a few MB whatever the tensor size
        step = max(1, tile_elements // max(1, k))
        buf = None if dtype == torch.float32 else torch.empty(min(n, step) * k, dtype=torch.float32, device=dev)
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            dst = out[c0:c1] if buf is None else buf[:(c1 - c0) * k].view(c1 - c0, k)
            self._unpack_into(self.raw[r0 + c0:r0 + c1].to(dev), dst)
            if buf is not None:
                out[c0:c1] = dst
        return out.view(self.shape) if rows is None else out

    def _unpack_into(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """uint8 [r, bytes_per_row] -> float32 out [r, n_cols] (contiguous)."""
        fdt = _FLOAT_DTYPES.get(self.qtype)
        if fdt is not None:
            out.copy_(raw.view(fdt))
        else:
            bs, ts = GGML_QUANT_SIZES[self.qtype]
            _KERNELS[self.qtype](raw.reshape(-1, ts), out.view(-1, bs))


def dequantize(
    data: np.ndarray | torch.Tensor,
    qtype: QT | int,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Dequantize a whole stored tensor to its logical `shape`."""
    return QTensor(data, qtype, shape).dequantize(dtype=dtype, device=device)
