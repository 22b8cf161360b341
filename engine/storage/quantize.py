"""Float → ggml block encoders, for our own GGUF writer (fixtures, benchmarks, the default model).

`gguf.quants.quantize` covers F16/BF16/Q8_0/Q4_0…Q5_1 but not the K-quants, so Q4_K, Q5_K and Q6_K
are encoded here: plain round-to-nearest with per-sub-block scales (no imatrix, no search). The
blocks are valid ggml blocks; the decoder that defines their meaning is ggml's (gguf.quants.dequantize).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

QK_K = 256


def quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    """Encode float weights (..., n) to raw ggml bytes (..., bytes_per_row), as GGUFWriter stores them."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == T.F32:
        return x
    if qtype in _K_ENCODERS:
        if x.shape[-1] % QK_K:
            raise ValueError(f"{qtype.name} needs rows that are a multiple of {QK_K}, got {x.shape[-1]}")
        blocks = x.reshape(-1, QK_K)
        raw = _K_ENCODERS[qtype](blocks)
        return raw.reshape(*x.shape[:-1], -1)
    return gq.quantize(x, qtype)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _affine_sub_blocks(b: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: 8 sub-blocks of 32, value = d·sc·q − dmin·m with 6-bit sc, m and q in [0, levels]."""
    n = b.shape[0]
    sub = b.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # the min term is subtracted, so it is ≥ 0 as stored
    scale = (sub.max(axis=2) - lo) / levels
    mins = -lo
    d = _f16(scale.max(axis=1) / 63.0)
    dmin = _f16(mins.max(axis=1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.rint(np.divide(sub + (dminf * m)[..., None], step, out=np.zeros_like(sub), where=step > 0))
    q = np.clip(q, 0, levels).astype(np.uint8)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    head = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales], axis=1)
    return head, q


def _q4_k(b: np.ndarray) -> np.ndarray:
    head, q = _affine_sub_blocks(b, 15)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(len(b), 128)  # sub-blocks 2c (low) / 2c+1 (high)
    return np.concatenate([head, qs], axis=1)


def _q5_k(b: np.ndarray) -> np.ndarray:
    head, q = _affine_sub_blocks(b, 31)
    low = q & 0xF
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(len(b), 128)
    high = (q >> 4).astype(np.uint8)  # bit j of qh[l] is the 5th bit of sub-block j, element l
    qh = np.zeros((len(b), 32), np.uint8)
    for j in range(8):
        qh |= high[:, j, :] << j
    return np.concatenate([head, qh, qs], axis=1)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    grp = b.reshape(n, 16, 16)
    amax_idx = np.abs(grp).argmax(axis=2)
    vmax = np.take_along_axis(grp, amax_idx[..., None], axis=2)[..., 0]
    scale = vmax / -32.0  # as ggml: the largest magnitude maps to -32
    d = _f16(np.abs(scale).max(axis=1) / 127.0)
    df = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, df[:, None], out=np.zeros_like(scale), where=df[:, None] > 0)), -128, 127).astype(np.int8)
    step = df[:, None] * sc.astype(np.float32)
    q = np.rint(np.divide(grp, step[..., None], out=np.zeros_like(grp), where=step[..., None] != 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, quarter, l]
    ql = np.zeros((n, 2, 64), np.uint8)
    qh = np.zeros((n, 2, 32), np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:64] = (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
    qh[:] = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8).reshape(n, 16), d.view(np.uint8).reshape(n, 2)], axis=1
    )


_K_ENCODERS = {T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}

# Byte offsets of the f16 scale fields per block, and the typical |value| per unit of the first one (random bytes:
# uniform quants and sub-block scales), for random blocks of other types.
F16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.IQ1_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}
_VALUE_PER_SCALE = {T.Q5_K: 300.0, T.Q4_0: 4.6, T.Q4_1: 4.6, T.Q5_0: 9.2, T.Q5_1: 9.2, T.Q2_K: 8.0, T.Q3_K: 40.0, T.IQ4_NL: 70.0,
                    T.IQ4_XS: 1300.0}


def random_blocks(shape: tuple[int, ...], qtype: T, rng: np.random.Generator, std: float) -> np.ndarray:
    """Random but valid ggml blocks whose values have roughly zero mean and the given std.

    For synthetic benchmark models far too large to draw as floats and encode (bytes are drawn
    directly; only the f16 scale fields are set so every value is finite and of the right size).
    """
    if qtype in IQ_GRID_BLOCK_BYTES:
        return random_iq_blocks(shape, qtype, rng, std)
    n = int(np.prod(shape[:-1])) * (shape[-1] // QK_K if qtype in _K_ENCODERS else shape[-1] // 32)
    if qtype == T.Q8_0:
        raw = rng.integers(0, 256, (n, 34), dtype=np.uint8)
        raw[:, :2] = np.full((n, 1), std / 73.0, np.float16).view(np.uint8).reshape(n, 2)
    elif qtype == T.Q4_K:
        raw = rng.integers(0, 256, (n, 144), dtype=np.uint8)
        d = std / 170.0  # d·sc·(q − 7.5) with sc ~ U[0, 63], q ~ U[0, 15]
        raw[:, 0:2] = np.full((n, 1), d, np.float16).view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = np.full((n, 1), d * 7.5, np.float16).view(np.uint8).reshape(n, 2)
    elif qtype == T.Q5_K:
        raw = rng.integers(0, 256, (n, 176), dtype=np.uint8)
        d = std / 330.0  # d·sc·(q − 15.5) with sc ~ U[0, 63], q ~ U[0, 31]
        raw[:, 0:2] = np.full((n, 1), d, np.float16).view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = np.full((n, 1), d * 15.5, np.float16).view(np.uint8).reshape(n, 2)
    elif qtype == T.Q6_K:
        raw = rng.integers(0, 256, (n, 210), dtype=np.uint8)
        raw[:, 192:208] = rng.integers(1, 128, (n, 16), dtype=np.uint8)  # positive int8 sub-block scales
        raw[:, 208:210] = np.full((n, 1), std / (64.0 * 18.5), np.float16).view(np.uint8).reshape(n, 2)
    elif qtype in _VALUE_PER_SCALE or qtype in (T.MXFP4, T.F16, T.BF16):
        return _random_other(shape, qtype, rng, std)
    else:
        raise ValueError(f"random_blocks: {qtype.name} not supported")
    return raw.reshape(*shape[:-1], -1)


# The grid-codebook IQ types' block bytes. Every byte pattern of their blocks is valid (grid indices, signs and
# integer scales use all their bits), so random blocks need only a finite fp16 scale.
IQ_GRID_BLOCK_BYTES = {T.IQ2_XXS: 66, T.IQ2_XS: 74, T.IQ2_S: 82, T.IQ3_XXS: 98, T.IQ3_S: 110, T.IQ1_S: 50,
                       T.IQ1_M: 56}


def random_iq_blocks(shape: tuple[int, ...], qtype: T, rng: np.random.Generator, std: float) -> np.ndarray:
    """Random valid blocks of a grid IQ type whose values have roughly the given std: random bytes, and every
    block's fp16 scale set to std over the values' std at scale 1 (measured on the first blocks drawn)."""
    n = int(np.prod(shape[:-1])) * (shape[-1] // QK_K)
    raw = rng.integers(0, 256, (n, IQ_GRID_BLOCK_BYTES[qtype]), dtype=np.uint8)
    sample = raw[:256].copy()
    _set_iq_scale(sample, qtype, np.float16(1.0))
    unit = float(gq.dequantize(sample, qtype).std())
    _set_iq_scale(raw, qtype, np.float16(std / unit))
    return raw.reshape(*shape[:-1], -1)


def _set_iq_scale(raw: np.ndarray, qtype: T, d: np.float16) -> None:
    bits = int(np.array(d, np.float16).view(np.uint16))
    if qtype == T.IQ1_M:  # the scale's four nibbles are the top nibbles of the block's four 16-bit scale words
        for k in range(4):
            raw[:, 49 + 2 * k] = (raw[:, 49 + 2 * k] & 0x0F) | (((bits >> (4 * k)) & 0xF) << 4)
    else:
        raw[:, 0], raw[:, 1] = bits & 0xFF, bits >> 8


def _random_other(shape: tuple[int, ...], qtype: T, rng: np.random.Generator, std: float) -> np.ndarray:
    """Random bytes with every f16 scale field set per block to ±U[0.5, 1.5] of the size giving about `std`
    (a minimum field likewise, so it takes both signs), MXFP4's E8M0 exponent around that size, F16/BF16 values drawn
    as floats: every block finite and varied, its meaning ggml's (gguf.quants.dequantize)."""
    if qtype in (T.F16, T.BF16):
        import torch

        w = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        return (w.half() if qtype == T.F16 else w.bfloat16()).view(torch.uint8).numpy().reshape(*shape[:-1], -1)
    bs, ts = gq.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape[:-1])) * (shape[-1] // bs)
    raw = rng.integers(0, 256, (n, ts), dtype=np.uint8)
    if qtype == T.MXFP4:  # values kvalue · 2^(e − 128), |kvalue| about 5
        e = int(round(128 + np.log2(std / 5.0)))
        raw[:, 0] = np.clip(e + rng.integers(-1, 2, n), 1, 254).astype(np.uint8)
    else:
        base = std / _VALUE_PER_SCALE[qtype]
        for off in F16_FIELDS[qtype]:
            f = rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n) * base
            raw[:, off:off + 2] = f.astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(*shape[:-1], -1)
