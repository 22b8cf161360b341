"""Triton kernels over ggml blocks as stored: the products of quantized weights on CUDA.

Imported only where a CUDA device (or, in tests, Triton's interpreter on CPU tensors: `TRITON_INTERPRET=1` set
before this module is imported) runs them; `triton` is not a dependency of the CPU engine.

  - `gemv_pairs`: pair p multiplies activation row xrow[p] by matrix sel[p] of a stack of quantized matrices (a
    projection is a stack of one, an expert stack or an expert cache's slots the others). One program computes
    BLOCK_N outputs of one pair, reading its rows' blocks once and accumulating super-block by super-block into
    a [BLOCK_N, 256] float32 tile that is summed once at the end. A pair's program does the same arithmetic in
    the same order whatever the other pairs are: a row of an N-row pass has the bits of a one-row pass (batch
    invariance: greedy MTP verify is token-identical to plain decoding).
  - `dequantize_bf16`: rows of a matrix as bfloat16, for torch.matmul over prefill chunks.
Blocks are read where they are (no re-layout): d and dmin as two bytes, scales and quants as bytes, dequantized
with the CPU reference's arithmetic (engine.storage.qtensor) in float32. Activations stay float32.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

# The types these kernels read, and the bytes of one 256-value unit (a super-block; 8 Q8_0 blocks).
UNIT = 256
UNIT_BYTES = {QT.Q8_0: 8 * 34, QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210, QT.IQ4_XS: 136}
TYPES = tuple(UNIT_BYTES)
BLOCK_N = 16  # outputs per program: 16 rows × 256 values is one tile of registers per unit
DEQ_ROWS = 16  # rows per program of dequantize_bf16


@triton.jit
def _f16_at(p, m):
    """The little-endian float16 at byte pointers p (where m; 0 elsewhere), as float32."""
    lo = tl.load(p, mask=m, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min_k4(s, rmask):
    """The 8 6-bit scales and mins of a Q4_K/Q5_K super-block (12 bytes at pointers s [BN, 1]), float32 [BN, 8]."""
    j = tl.arange(0, 8)[None, :]
    m = rmask[:, None] & (j < 8)
    a = tl.load(s + j, mask=m, other=0).to(tl.int32)  # bytes 0..7
    b = tl.load(s + 4 + j, mask=m, other=0).to(tl.int32)  # bytes 4..11
    c = tl.load(s + (j % 4), mask=m, other=0).to(tl.int32)  # bytes 0..3 again, for j ≥ 4
    sc = tl.where(j < 4, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _unit(blk, rmask, u, n_blocks, kv_ptr, QTYPE: tl.constexpr, BN: tl.constexpr):
    """Unit u (256 values) of BN rows whose unit starts at byte pointers blk [BN, 1], as float32 [BN, 256].
    Q8_0: the unit is 8 blocks, blocks past n_blocks are zeros."""
    sub = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]: 32-value sub-block
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    m3 = rmask[:, None, None] & (sub < 8) & (lane < 32)
    b3 = blk[:, :, None]  # [BN, 1, 1]
    if QTYPE == 8:  # Q8_0: 8 blocks of (d f16, 32 × int8)
        ok = m3 & (u * 8 + sub < n_blocks)
        pb = b3 + sub * 34
        d = _f16_at(pb, rmask[:, None, None] & (u * 8 + sub < n_blocks))
        q = tl.load(pb + 2 + lane, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = tl.where(ok, q * d, 0.0)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 bytes of scales/mins, [Q5_K: 32 bytes high bits]
        d = _f16_at(blk, rmask[:, None])  # [BN, 1]
        dmin = _f16_at(blk + 2, rmask[:, None])
        sc, mn = _scale_min_k4(blk + 4, rmask)
        if QTYPE == 12:
            qs = blk[:, :, None] + 16
        else:
            qs = blk[:, :, None] + 48
        byte = tl.load(qs + (sub // 2) * 32 + lane, mask=m3, other=0).to(tl.int32)
        q = (byte >> ((sub % 2) * 4)) & 0xF
        if QTYPE == 13:
            hb = tl.load(b3 + 16 + lane, mask=m3, other=0).to(tl.int32)
            q = q | (((hb >> sub) & 1) << 4)
        w = q.to(tl.float32) * (d * sc)[:, :, None] - (dmin * mn)[:, :, None]
    elif QTYPE == 14:  # Q6_K: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d
        j = sub * 32 + lane  # value index 0..255
        h = j // 128
        r = j % 128
        lo = tl.load(b3 + h * 64 + (r % 64), mask=m3, other=0).to(tl.int32)
        hi = tl.load(b3 + 128 + h * 32 + (r % 32), mask=m3, other=0).to(tl.int32)
        q = ((lo >> ((r // 64) * 4)) & 0xF) | (((hi >> ((r // 32) * 2)) & 3) << 4)
        s = tl.load(b3 + 192 + j // 16, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16_at(b3 + 208, rmask[:, None, None])
        w = (q - 32).to(tl.float32) * (d * s)
    else:  # IQ4_XS (23): d, 16 bits of high scale bits, 4 bytes of low scale bits, 128 bytes of 4-bit indices
        d = _f16_at(blk, rmask[:, None])
        j8 = tl.arange(0, 8)[None, :]
        m2 = rmask[:, None] & (j8 < 8)
        sh = (tl.load(blk + 2, mask=rmask[:, None], other=0).to(tl.int32)
              | (tl.load(blk + 3, mask=rmask[:, None], other=0).to(tl.int32) << 8))
        lo = tl.load(blk + 4 + j8 // 2, mask=m2, other=0).to(tl.int32)
        ls = ((lo >> ((j8 % 2) * 4)) & 0xF) | (((sh >> (2 * j8)) & 3) << 4)
        dl = d * (ls - 32).to(tl.float32)  # [BN, 8]
        byte = tl.load(b3 + 8 + sub * 16 + (lane % 16), mask=m3, other=0).to(tl.int32)
        idx = (byte >> ((lane // 16) * 4)) & 0xF
        w = tl.load(kv_ptr + idx) * dl[:, :, None]
    return tl.reshape(w, (BN, 256))


@triton.jit
def _gemv_pairs(w_ptr, x_ptr, y_ptr, sel_ptr, xrow_ptr, kv_ptr, n_out, n_units, n_blocks, row_bytes, mat_bytes,
                x_stride, y_stride, QTYPE: tl.constexpr, UBYTES: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    p = tl.program_id(1)
    mat = tl.load(sel_ptr + p).to(tl.int64)
    xr = tl.load(xrow_ptr + p).to(tl.int64)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < n_out
    base = w_ptr + mat * mat_bytes + rows.to(tl.int64)[:, None] * row_bytes  # [BN, 1]
    cols = tl.arange(0, 256)
    acc = tl.zeros([BN, 256], dtype=tl.float32)
    for u in range(0, n_units):
        w = _unit(base + u * UBYTES, rmask, u, n_blocks, kv_ptr, QTYPE, BN)
        xm = u * 256 + cols < n_blocks * 32
        x = tl.load(x_ptr + xr * x_stride + u * 256 + cols, mask=xm, other=0.0)
        acc += w * x[None, :]
    tl.store(y_ptr + p * y_stride + rows, tl.sum(acc, axis=1), mask=rmask)


@triton.jit
def _dequant_bf16(w_ptr, o_ptr, n_rows, n_blocks, row_bytes, o_stride, kv_ptr, QTYPE: tl.constexpr,
                  UBYTES: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    u = tl.program_id(1)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < n_rows
    w = _unit(w_ptr + rows.to(tl.int64)[:, None] * row_bytes + u * UBYTES, rmask, u, n_blocks, kv_ptr, QTYPE, BN)
    cols = u * 256 + tl.arange(0, 256)
    m = rmask[:, None] & (cols < n_blocks * 32)[None, :]
    # bfloat16 by round-to-nearest-even on the bits (the interpreter's float cast truncates): same bits everywhere
    bits = w.to(tl.uint32, bitcast=True)
    bf = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * o_stride + cols[None, :], bf.to(tl.int16), mask=m)


def binds(qtype: QT, n_cols: int) -> bool:
    """Whether these kernels multiply a weight of this type and width (whole blocks per row)."""
    return qtype in UNIT_BYTES and n_cols % (32 if qtype == QT.Q8_0 else UNIT) == 0


@functools.cache
def _kvalues(device: torch.device) -> torch.Tensor:
    return torch.tensor(gq.IQ4_NL.kvalues, dtype=torch.float32, device=device)


def _geometry(qtype: QT, n_cols: int) -> tuple[int, int, int]:
    """(units per row, 32-value blocks per row, bytes per row)."""
    n_blocks = n_cols // 32
    units = -(-n_cols // UNIT)
    row_bytes = n_blocks * 34 if qtype == QT.Q8_0 else units * UNIT_BYTES[qtype]
    return units, n_blocks, row_bytes


def gemv_pairs(raw: torch.Tensor, qtype: QT, n_out: int, n_cols: int, x: torch.Tensor, sel: torch.Tensor,
               xrow: torch.Tensor) -> torch.Tensor:
    """out[p] = W[sel[p]] @ x[xrow[p]] for the stack raw (uint8, matrices of n_out rows of n_cols values, each
    matrix's bytes contiguous and the stack's matrices at a fixed stride: raw [M, …] or [M·n_out, …]); x float32
    [R, n_cols]; sel, xrow int [P]. Returns float32 [P, n_out]."""
    units, n_blocks, row_bytes = _geometry(qtype, n_cols)
    mat_bytes = n_out * row_bytes
    p = sel.shape[0]
    out = torch.empty(p, n_out, dtype=torch.float32, device=x.device)
    if p == 0:
        return out
    xc = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    grid = (triton.cdiv(n_out, BLOCK_N), p)
    _gemv_pairs[grid](raw, xc, out, sel, xrow, _kvalues(x.device), n_out, units, n_blocks, row_bytes, mat_bytes,
                      xc.stride(0), out.stride(0), QTYPE=int(qtype), UBYTES=UNIT_BYTES[qtype], BN=BLOCK_N)
    return out


def dequantize_bf16(raw: torch.Tensor, qtype: QT, n_rows: int, n_cols: int) -> torch.Tensor:
    """Rows of a quantized matrix (raw uint8, n_rows rows of whole blocks) as bfloat16 [n_rows, n_cols]."""
    units, n_blocks, row_bytes = _geometry(qtype, n_cols)
    out = torch.empty(n_rows, n_cols, dtype=torch.bfloat16, device=raw.device)
    grid = (triton.cdiv(n_rows, DEQ_ROWS), units)
    _dequant_bf16[grid](raw, out.view(torch.int16), n_rows, n_blocks, row_bytes, out.stride(0), _kvalues(raw.device),
                        QTYPE=int(qtype), UBYTES=UNIT_BYTES[qtype], BN=DEQ_ROWS)
    return out


def self_check(device: torch.device) -> str | None:
    """Run every kernel once on `device` against the torch dequantization (engine.storage.qtensor) of random
    blocks: None when all agree, else what failed (a driver or compiler error, a wrong result)."""
    from engine.storage.qtensor import QTensor, block_size, type_size
    from engine.storage.quantize import F16_FIELDS

    g = torch.Generator().manual_seed(0)
    try:
        for qt in TYPES:
            rows, cols = BLOCK_N + 3, 320 if qt == QT.Q8_0 else 512
            nb = rows * cols // block_size(qt)
            raw = torch.randint(0, 256, (nb, type_size(qt)), dtype=torch.uint8, generator=g)
            for off in F16_FIELDS[qt]:  # finite, modest scales
                raw[:, off:off + 2] = (torch.rand(nb, 1, generator=g) * 0.01).half().view(torch.uint8)
            ref = QTensor(raw.reshape(rows, -1), qt, (rows, cols)).dequantize()
            x = torch.randn(2, cols, generator=g)
            dev_raw = raw.reshape(rows, -1).to(device)
            idx = torch.arange(2, device=device)
            y = gemv_pairs(dev_raw, qt, rows, cols, x.to(device), torch.zeros_like(idx), idx).cpu()
            want = x.double() @ ref.double().T
            if not torch.allclose(y.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                return f"{qt.name} product differs from the reference"
            if not torch.equal(dequantize_bf16(dev_raw, qt, rows, cols).cpu(), ref.to(torch.bfloat16)):
                return f"{qt.name} dequantization differs from the reference"
    except Exception as e:  # noqa: BLE001 - any failure to build or launch means: not these kernels here
        return f"{type(e).__name__}: {e}"
    return None


# Every kernel as launched, for ahead-of-time compilation (tests compile each for every GPU generation we ship
# for, so a kernel that would not build on a real GPU fails CI on a machine without one).
ARCHS = (80, 86, 89, 90, 120)


def _signatures() -> list[tuple[object, dict[str, str], dict[str, int]]]:
    out = []
    for qt in TYPES:
        const = {"QTYPE": int(qt), "UBYTES": UNIT_BYTES[qt]}
        out.append((_gemv_pairs, {"w_ptr": "*u8", "x_ptr": "*fp32", "y_ptr": "*fp32", "sel_ptr": "*i64",
                                  "xrow_ptr": "*i64", "kv_ptr": "*fp32", "n_out": "i32", "n_units": "i32",
                                  "n_blocks": "i32", "row_bytes": "i64", "mat_bytes": "i64", "x_stride": "i64",
                                  "y_stride": "i64", "QTYPE": "constexpr", "UBYTES": "constexpr", "BN": "constexpr"},
                    {**const, "BN": BLOCK_N}))
        out.append((_dequant_bf16, {"w_ptr": "*u8", "o_ptr": "*i16", "n_rows": "i32", "n_blocks": "i32",
                                    "row_bytes": "i64", "o_stride": "i64", "kv_ptr": "*fp32", "QTYPE": "constexpr",
                                    "UBYTES": "constexpr", "BN": "constexpr"}, {**const, "BN": DEQ_ROWS}))
    return out


def compile_ahead(arch: int) -> dict[str, int]:
    """Compile every kernel (these, engine.ops.triton_attention's and triton_norm's) for CUDA compute capability
    `arch` (e.g. 90) without a GPU; cubin bytes by kernel. Needs the compiled (not interpreted) kernels: run with
    TRITON_INTERPRET unset."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.ops import triton_attention, triton_norm

    kernels = [(fn, sig, const, QT(const["QTYPE"]).name) for fn, sig, const in _signatures()]
    sizes = {}
    for fn, sig, const, tag in kernels + triton_attention.signatures() + triton_norm.signatures():
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32))
        sizes[f"{fn.__name__}[{tag}]"] = len(k.asm["cubin"])  # type: ignore[attr-defined]
    return sizes


if __name__ == "__main__":  # python -m engine.ops.triton_q [arch ...]: the ahead-of-time build, as CI runs it
    import json
    import sys

    print(json.dumps({a: compile_ahead(a) for a in (map(int, sys.argv[1:]) if sys.argv[1:] else ARCHS)}))
