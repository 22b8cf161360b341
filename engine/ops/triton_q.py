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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

# The types these kernels read, and the bytes of one 256-value unit (a super-block; 8 Q8_0 blocks).
UNIT = 256
UNIT_BYTES = {QT.Q8_0: 8 * 34, QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210, QT.IQ4_XS: 136}
TYPES = tuple(UNIT_BYTES)
BLOCK_N = 16  # rows of the self-check's matrices: one more than a program's outputs at most


@dataclass(frozen=True)
class GemvShape:
    """How `_gemv_pairs` spreads a product over programs: `rows` outputs per program, `units` 256-value units whose
    loads one loop iteration issues together (the sum runs in unit order whatever it is), `warps` per program.
    Fixed per weight type, never by the number of pairs: a verify row keeps a decode step's bits."""
    rows: int
    units: int
    warps: int


# bench/results/gemv_sweep_h200.json (H200, the 35B-A3B and 9B shapes' products, CUDA-graph replays): the fastest
# shape per type over a decode step's calls among those whose results matched. Q4_K and Q5_K at 2-8 rows with 2-4
# warps gave wrong sums there (compiled; right in the interpreter) and are not used; `self_check` runs every form.
GEMV = {QT.Q8_0: GemvShape(4, 4, 4), QT.Q4_K: GemvShape(16, 4, 4), QT.Q5_K: GemvShape(16, 2, 4),
        QT.Q6_K: GemvShape(8, 1, 4), QT.IQ4_XS: GemvShape(16, 1, 4)}
DEQ_ROWS = 16  # rows per program of dequantize_bf16
SUM_ROWS = 256  # outputs per program of slot_sum


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
def _row_dots(base, rmask, x_row, n_units, n_blocks, kv_ptr, QTYPE: tl.constexpr, UBYTES: tl.constexpr,
              BN: tl.constexpr, UPI: tl.constexpr):
    """Σ_k W[r, k]·x[k] for the BN rows whose bytes start at pointers base [BN, 1], x_row pointing at x: float32 [BN].
    Every product below sums through this one function, so a fused launch has the plain product's bits."""
    cols = tl.arange(0, 256)
    acc = tl.zeros([BN, 256], dtype=tl.float32)
    for u0 in range(0, n_units, UPI):
        for j in tl.static_range(UPI):  # UPI units' loads in flight at once; summed in unit order all the same
            u = u0 + j
            w = _unit(base + u * UBYTES, rmask & (u < n_units), u, n_blocks, kv_ptr, QTYPE, BN)
            xm = (u * 256 + cols < n_blocks * 32) & (u < n_units)
            x = tl.load(x_row + u * 256 + cols, mask=xm, other=0.0)
            acc += w * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _pair(sel_ptr, xrow_ptr, x_ptr, x_stride, n_out, mat_bytes, row_bytes, BN: tl.constexpr):
    """This program's pair p = program_id(1) and its BN rows: (p, rows, their mask, their byte offsets [BN, 1] in the
    stack, a pointer to the pair's activation row)."""
    p = tl.program_id(1)
    mat = tl.load(sel_ptr + p).to(tl.int64)
    xr = tl.load(xrow_ptr + p).to(tl.int64)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    off = mat * mat_bytes + rows.to(tl.int64)[:, None] * row_bytes
    return p, rows, rows < n_out, off, x_ptr + xr * x_stride


@triton.jit
def _gemv_pairs(w_ptr, x_ptr, y_ptr, sel_ptr, xrow_ptr, kv_ptr, n_out, n_units, n_blocks, row_bytes, mat_bytes,
                x_stride, y_stride, QTYPE: tl.constexpr, UBYTES: tl.constexpr, BN: tl.constexpr, UPI: tl.constexpr):
    p, rows, rmask, off, x_row = _pair(sel_ptr, xrow_ptr, x_ptr, x_stride, n_out, mat_bytes, row_bytes, BN)
    y = _row_dots(w_ptr + off, rmask, x_row, n_units, n_blocks, kv_ptr, QTYPE, UBYTES, BN, UPI)
    tl.store(y_ptr + p * y_stride + rows, y, mask=rmask)


@triton.jit
def _gemv_glu(g_ptr, u_ptr, x_ptr, y_ptr, sel_ptr, xrow_ptr, kv_ptr, n_out, n_units, n_blocks, row_bytes, mat_bytes,
              x_stride, y_stride, QTYPE: tl.constexpr, UBYTES: tl.constexpr, BN: tl.constexpr, UPI: tl.constexpr):
    """silu(G x) ⊙ (U x) for pair p's rows: the gate and up products of a SwiGLU in one launch."""
    p, rows, rmask, off, x_row = _pair(sel_ptr, xrow_ptr, x_ptr, x_stride, n_out, mat_bytes, row_bytes, BN)
    g = _row_dots(g_ptr + off, rmask, x_row, n_units, n_blocks, kv_ptr, QTYPE, UBYTES, BN, UPI)
    u = _row_dots(u_ptr + off, rmask, x_row, n_units, n_blocks, kv_ptr, QTYPE, UBYTES, BN, UPI)
    e = tl.exp(-tl.abs(g))  # sigmoid without an overflowing exp
    tl.store(y_ptr + p * y_stride + rows, g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * u, mask=rmask)


@triton.jit
def _token_rows(n_out, BN: tl.constexpr):
    """This program's token t = program_id(1), its BN output rows and their mask."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    return tl.program_id(1), rows, rows < n_out


@triton.jit
def _gemv_slots(w_ptr, h_ptr, y_ptr, sel_ptr, wt_ptr, kv_ptr, n_out, k, n_units, n_blocks, row_bytes, mat_bytes,
                h_stride, y_stride, QTYPE: tl.constexpr, UBYTES: tl.constexpr, BN: tl.constexpr, UPI: tl.constexpr):
    """y[t] = Σ_s wt[t, s] · W[sel[t, s]] h[t·k + s], the slots added in order: a token's routed down products and
    their weighted sum in one launch."""
    t, rows, rmask = _token_rows(n_out, BN)
    y = tl.zeros([BN], dtype=tl.float32)
    for s in range(0, k):
        mat = tl.load(sel_ptr + t * k + s).to(tl.int64)
        off = mat * mat_bytes + rows.to(tl.int64)[:, None] * row_bytes
        d = _row_dots(w_ptr + off, rmask, h_ptr + (t * k + s) * h_stride, n_units, n_blocks, kv_ptr, QTYPE, UBYTES,
                      BN, UPI)
        y += tl.load(wt_ptr + t * k + s) * d
    tl.store(y_ptr + t * y_stride + rows, y, mask=rmask)


@triton.jit
def _slot_sum(d_ptr, wt_ptr, y_ptr, n_out, k, BN: tl.constexpr):
    """y[t] = Σ_s wt[t, s] · d[t·k + s], slots in order: `_gemv_slots`' sum over products made elsewhere."""
    t, rows, rmask = _token_rows(n_out, BN)
    y = tl.zeros([BN], dtype=tl.float32)
    for s in range(0, k):
        y += tl.load(wt_ptr + t * k + s) * tl.load(d_ptr + (t * k + s) * n_out + rows, mask=rmask, other=0.0)
    tl.store(y_ptr + t * n_out + rows, y, mask=rmask)


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


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()


def _launch(kernel, grid_rows: int, qtype: QT, n_out: int, n_cols: int, shape: GemvShape | None,  # type: ignore[no-untyped-def]
            *args, **named) -> None:
    """One launch of a product kernel over (row blocks, grid_rows): its own arguments, then the shared geometry."""
    units, n_blocks, row_bytes = _geometry(qtype, n_cols)
    g = shape or GEMV[qtype]
    kernel[(triton.cdiv(n_out, g.rows), grid_rows)](*args, **named, n_blocks=n_blocks, row_bytes=row_bytes, n_units=units,
                                                    mat_bytes=n_out * row_bytes, QTYPE=int(qtype),
                                                    UBYTES=UNIT_BYTES[qtype], BN=g.rows, UPI=min(g.units, units),
                                                    num_warps=g.warps)


def gemv_pairs(raw: torch.Tensor, qtype: QT, n_out: int, n_cols: int, x: torch.Tensor, sel: torch.Tensor,
               xrow: torch.Tensor, shape: GemvShape | None = None) -> torch.Tensor:
    """out[p] = W[sel[p]] @ x[xrow[p]] for the stack raw (uint8, matrices of n_out rows of n_cols values, each
    matrix's bytes contiguous and the stack's matrices at a fixed stride: raw [M, …] or [M·n_out, …]); x float32
    [R, n_cols]; sel, xrow int [P]. Returns float32 [P, n_out]. `shape`: the type's GEMV[qtype] unless given (the
    sweep that chose those, bench/gemv_sweep.py)."""
    p = sel.shape[0]
    out = torch.empty(p, n_out, dtype=torch.float32, device=x.device)
    if p:
        xc = _float_rows(x)
        _launch(_gemv_pairs, p, qtype, n_out, n_cols, shape, raw, xc, out, sel, xrow, _kvalues(x.device), n_out,
                x_stride=xc.stride(0), y_stride=out.stride(0))
    return out


def gemv_glu_pairs(gate: torch.Tensor, up: torch.Tensor, qtype: QT, n_out: int, n_cols: int, x: torch.Tensor,
                   sel: torch.Tensor, xrow: torch.Tensor) -> torch.Tensor:
    """silu(G[sel[p]] x[xrow[p]]) ⊙ U[sel[p]] x[xrow[p]] for two stacks of one type and geometry (a SwiGLU's gate
    and up); each product's bits are gemv_pairs' (the same sums). float32 [P, n_out]."""
    p = sel.shape[0]
    out = torch.empty(p, n_out, dtype=torch.float32, device=x.device)
    if p:
        xc = _float_rows(x)
        _launch(_gemv_glu, p, qtype, n_out, n_cols, None, gate, up, xc, out, sel, xrow, _kvalues(x.device), n_out,
                x_stride=xc.stride(0), y_stride=out.stride(0))
    return out


def gemv_slots(raw: torch.Tensor, qtype: QT, n_out: int, n_cols: int, h: torch.Tensor, sel: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """y[t] = Σ_s weights[t, s] · W[sel[t, s]] h[t·k + s], slots added in order s (a token's routed experts' down
    products and their weighted sum): h float32 [N·k, n_cols], sel [N, k], weights float32 [N, k]. float32 [N, n_out]."""
    n, k = sel.shape
    out = torch.empty(n, n_out, dtype=torch.float32, device=h.device)
    if n:
        hc = _float_rows(h)
        _launch(_gemv_slots, n, qtype, n_out, n_cols, None, raw, hc, out, sel.contiguous(),
                weights.float().contiguous(), _kvalues(h.device), n_out, k, h_stride=hc.stride(0),
                y_stride=out.stride(0))
    return out


def slot_sum(d: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_s weights[t, s] · d[t, s] over slots in order, d float32 [N, k, n] (products made apart, as an expert
    cache's hits and misses are): the bits `gemv_slots` gives the same products. float32 [N, n]."""
    n, k, n_out = d.shape
    out = torch.empty(n, n_out, dtype=torch.float32, device=d.device)
    if n:
        _slot_sum[(triton.cdiv(n_out, SUM_ROWS), n)](d.contiguous(), weights.float().contiguous(), out, n_out, k,
                                                   BN=SUM_ROWS)
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
            xd, zero = x.to(device), torch.zeros_like(idx)
            y = gemv_pairs(dev_raw, qt, rows, cols, xd, zero, idx)
            want = x.double() @ ref.double().T
            if not torch.allclose(y.cpu().double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                return f"{qt.name} product differs from the reference"
            close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))  # noqa: E731
            if not close(gemv_glu_pairs(dev_raw, dev_raw, qt, rows, cols, xd, zero, idx), y / (1 + (-y).exp()) * y):
                return f"{qt.name} gate-up product differs from the plain product"
            wt = torch.tensor([[0.75, -0.5]], device=device)
            if not close(gemv_slots(dev_raw.view(1, -1), qt, rows, cols, xd, zero.view(1, 2), wt)[0],
                         0.75 * y[0] - 0.5 * y[1]):
                return f"{qt.name} weighted slots differ from the plain product"
            if not torch.equal(dequantize_bf16(dev_raw, qt, rows, cols).cpu(), ref.to(torch.bfloat16)):
                return f"{qt.name} dequantization differs from the reference"
    except Exception as e:  # noqa: BLE001 - any failure to build or launch means: not these kernels here
        return f"{type(e).__name__}: {e}"
    return None


# Every kernel as launched, for ahead-of-time compilation (tests compile each for every GPU generation we ship
# for, so a kernel that would not build on a real GPU fails CI on a machine without one).
ARCHS = (80, 86, 89, 90, 120)


def launch_forms() -> list[tuple[object, dict[str, str], dict[str, int], str, int]]:
    """(kernel, signature, constants, tag, warps) of every launch form of these kernels and of
    engine.ops.triton_attention's, triton_norm's and triton_route's."""
    from engine.ops import triton_attention, triton_norm, triton_route

    out = []
    geometry = {"n_units": "i32", "n_blocks": "i32", "row_bytes": "i64", "mat_bytes": "i64", "QTYPE": "constexpr",
                "UBYTES": "constexpr", "BN": "constexpr", "UPI": "constexpr"}
    pairs = {"x_ptr": "*fp32", "y_ptr": "*fp32", "sel_ptr": "*i64", "xrow_ptr": "*i64", "kv_ptr": "*fp32",
             "n_out": "i32", "x_stride": "i64", "y_stride": "i64"}
    products = [(_gemv_pairs, {"w_ptr": "*u8", **pairs}), (_gemv_glu, {"g_ptr": "*u8", "u_ptr": "*u8", **pairs}),
                (_gemv_slots, {"w_ptr": "*u8", "h_ptr": "*fp32", "y_ptr": "*fp32", "sel_ptr": "*i64",
                               "wt_ptr": "*fp32", "kv_ptr": "*fp32", "n_out": "i32", "k": "i32", "h_stride": "i64",
                               "y_stride": "i64"})]
    for qt in TYPES:
        const = {"QTYPE": int(qt), "UBYTES": UNIT_BYTES[qt]}
        g = GEMV[qt]
        for upi in range(1, g.units + 1):  # min(units, a row's units) for every width
            for fn, sig in products:
                full = {**sig, **geometry}
                out.append((fn, {a: full[a] for a in fn.arg_names}, {**const, "BN": g.rows, "UPI": upi},
                            f"{qt.name}/{upi}", g.warps))
        out.append((_dequant_bf16, {"w_ptr": "*u8", "o_ptr": "*i16", "n_rows": "i32", "n_blocks": "i32",
                                    "row_bytes": "i64", "o_stride": "i64", "kv_ptr": "*fp32", "QTYPE": "constexpr",
                                    "UBYTES": "constexpr", "BN": "constexpr"}, {**const, "BN": DEQ_ROWS}, qt.name, 4))
    out.append((_slot_sum, {"d_ptr": "*fp32", "wt_ptr": "*fp32", "y_ptr": "*fp32", "n_out": "i32", "k": "i32",
                            "BN": "constexpr"}, {"BN": SUM_ROWS}, "f32", 4))
    return out + [(*form, 4) for form in triton_attention.signatures() + triton_norm.signatures()
                  + triton_route.signatures()]


def kernel_forms() -> list[tuple[object, dict[str, str], dict[str, int], str, int]]:
    """One launch form per kernel and weight type (the others differ only in tile sizes): what CI builds for the
    GPU generations besides the one it builds every form for."""
    seen: set[tuple[str, object]] = set()
    out = []
    for form in launch_forms():
        key = (form[0].__name__, form[2].get("QTYPE"))  # type: ignore[attr-defined]
        if key not in seen:
            seen.add(key)
            out.append(form)
    return out


def compile_ahead(arch: int, forms: list | None = None) -> dict[str, int]:
    """Compile `forms` (default: every launch form of these kernels and engine.ops.triton_attention's, triton_norm's
    and triton_route's) for CUDA compute capability `arch` (e.g. 90) without a GPU; cubin bytes by kernel. Needs the compiled (not interpreted) kernels: run with
    TRITON_INTERPRET unset."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sizes = {}
    for fn, sig, const, tag, warps in forms or launch_forms():
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps})
        sizes[f"{fn.__name__}[{tag}]"] = len(k.asm["cubin"])  # type: ignore[attr-defined]
    return sizes


FULL_ARCH = 90  # the generation CI builds every launch form for (the H100/H200 the device runs measure)

if __name__ == "__main__":  # python -m engine.ops.triton_q [arch ...]: the ahead-of-time build, as CI runs it
    import json
    import sys

    archs = list(map(int, sys.argv[1:])) or list(ARCHS)
    print(json.dumps({a: compile_ahead(a, None if a == FULL_ARCH or sys.argv[1:] else kernel_forms()) for a in archs}))
