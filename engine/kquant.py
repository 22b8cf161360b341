"""Q4_K / Q6_K / Q8_0 products through the native kernels in engine/native/kquant.c and q8_0.c (engine.nativelib).

llama.cpp multiplies a quantized weight by activations it quantizes too (to Q8_K for K-quants, to Q8_0 for
Q8_0), with integer dot products per block. Dequantizing the weight to float32 on every pass instead cost
~0.5 GB/s of weights on this path's target shapes, and every extra token of a multi-token pass re-read the
float tile; the torch integer path for Q8_0 (engine.q8dot) needed some twenty tensor ops per product, which on
small models cost more than the arithmetic. The kernels unpack each weight block once and multiply it by all
the pass's rows while it is in L1, so a pass of N tokens reads the weights once, in one call per product;
integer sums are exact and each output element's float work is the same whatever N, so batched passes stay
bit-identical to one-token passes.

The library is built with the package (engine.nativelib). Without it, `nativelib.available()` is False and the engine
keeps its torch paths (engine.rowwise, engine.q8dot), which the tests also compare the kernels against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT

from engine import nativelib
from engine.lastinputs import LastInputs
from engine.quant import QTensor, release_pages

QK = 256
Q8_0_BLOCK = 32
TYPES = (QT.Q4_K, QT.Q6_K, QT.Q8_0)
_LIB = nativelib.LIB
# True: run the portable C products even where the AVX512 ones can (tests compare the two).
PORTABLE = False
# False: Q4_K / Q6_K / Q8_0 weights run in their stored order even where the packed VNNI products can (tests compare).
PACK = True
PACKED = {QT.Q8_0: 108, QT.Q4_K: 112, QT.Q6_K: 114}  # kquant.c's T_Q8_0_PACKED, T_Q4_K_PACKED, T_Q6_K_PACKED


def isa() -> str:
    """The instruction sets the products run on: the K-quants', then Q8_0's."""
    if _LIB is None:
        return "none"
    if PORTABLE:
        return "portable C"
    kq = {1: "avx512bw", 0: "portable C"}[_LIB.kq_isa()]
    q8 = {2: "avx512vnni", 0: "portable C"}[_LIB.q8_isa()]
    return f"{kq}, Q8_0 {q8}" + (", Q4_K / Q6_K / Q8_0 packed for avx512vnni" if packs() else "")


def usable(w: object, x: torch.Tensor) -> bool:
    """Whether `x @ w.T` takes the native path: a Q4_K/Q6_K/Q8_0 weight on the CPU, x on the CPU."""
    return (_LIB is not None and isinstance(w, QTensor) and w.qtype in TYPES and w.raw.device.type == "cpu"
            and x.device.type == "cpu" and w.n_cols % (Q8_0_BLOCK if w.qtype == QT.Q8_0 else QK) == 0)


@dataclass
class Q8KRows:
    """Rows quantized to Q8_K: quants int8 [M, K], scales float32 [M, K/256], sums of 16 quants int16 [M, K/16];
    or to Q8_0 (`bsums` None): quants int8 [M, K], scales float32 [M, K/32] (f16-rounded)."""

    q: torch.Tensor
    d: torch.Tensor
    bsums: torch.Tensor | None
    _q4k: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    def q4k_order(self) -> torch.Tensor:
        """The quants in the order Q4_K blocks hold their values (made once, for the first Q4_K weight)."""
        if self._q4k is None:
            self._q4k = torch.empty_like(self.q)
            _LIB.kq_q4k_order(self.q.data_ptr(), self.q.shape[0], self.q.shape[1], self._q4k.data_ptr())  # type: ignore[union-attr]
        return self._q4k


_MEMO: LastInputs[Q8KRows] = LastInputs()
_MEMO_Q8_0: LastInputs[Q8KRows] = LastInputs()


def quantize_for(x: torch.Tensor, qtype: QT) -> Q8KRows:
    """x quantized as llama.cpp does for products with a `qtype` weight: Q8_0 rows for Q8_0, else Q8_K."""
    return quantize_q8_0(x) if qtype == QT.Q8_0 else quantize_rows(x)


def quantize_q8_0(x: torch.Tensor) -> Q8KRows:
    """x [..., K] float32 as rows [M, K] in ggml's quantize_row_q8_0 (the same quants and f16-rounded scales
    as engine.q8dot.quantize_rows). The last two inputs' results are kept."""
    return _quantize(x, _MEMO_Q8_0, Q8_0_BLOCK)


def quantize_rows(x: torch.Tensor) -> Q8KRows:
    """x [..., K] float32 as rows [M, K] in ggml's quantize_row_q8_K. The last two inputs' results are kept:
    attention, GDN, router and the experts multiply the same normed x."""
    return _quantize(x, _MEMO, QK)


def _quantize(x: torch.Tensor, memo: LastInputs[Q8KRows], block: int) -> Q8KRows:
    hit = memo.get(x)
    if hit is not None:
        return hit
    k = x.shape[-1]
    xc = x.detach().reshape(-1, k).float().contiguous()
    m = xc.shape[0]
    q, d = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // block)
    if block == Q8_0_BLOCK:
        r = Q8KRows(q, d, None)
        _LIB.q8_quantize_q8_0(xc.data_ptr(), m, k, q.data_ptr(), d.data_ptr())  # type: ignore[union-attr]
    else:
        r = Q8KRows(q, d, torch.empty(m, k // 16, dtype=torch.int16))
        _LIB.kq_quantize_q8k(xc.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), r.bsums.data_ptr(),  # type: ignore[union-attr]
                             PORTABLE)
    return memo.put(x, r)


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _bsums(xr: Q8KRows) -> int:
    return xr.bsums.data_ptr() if xr.bsums is not None else 0


def _perm(xr: Q8KRows, code: int) -> int:
    return xr.q4k_order().data_ptr() if code == QT.Q4_K and not PORTABLE and _LIB.kq_isa() == 1 else 0  # type: ignore[union-attr]


def packs() -> bool:
    """Whether Q4_K / Q6_K / Q8_0 weights run packed (`pack`): with AVX512-VNNI, unless the portable C or the
    stored order is asked for."""
    return PACK and not PORTABLE and _LIB is not None and _LIB.q8_isa() == 2


GROUP = 16  # rows interleaved in a packed weight (kquant.c)


def pack(w: QTensor) -> None:
    """Keep a CPU Q4_K / Q6_K / Q8_0 weight's blocks interleaved 16 rows at a time for the VNNI products (kq_repack;
    the same bytes in number, Q6_K with 1 % of padding), for the products to read instead of the stored ones.
    Only matrices of whole groups (rows per matrix, per expert in a stack, a multiple of 16) are packed. Where
    the stored bytes are a view of the model file their resident pages are dropped (engine.quant.release_pages):
    the file keeps them, and other readers (an embedding lookup, a copy to an accelerator) still find them there."""
    if w.packed is not None or w.qtype not in PACKED or w.raw.device.type != "cpu" or not packs() \
            or len(w.shape) < 2 or w.shape[-2] % GROUP:
        return
    raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
    nb = w.n_cols // (Q8_0_BLOCK if w.qtype == QT.Q8_0 else QK)
    packed = torch.empty(w.n_rows * nb * _LIB.kq_packed_bytes(int(w.qtype)), dtype=torch.uint8)  # type: ignore[union-attr]
    _LIB.kq_repack(int(w.qtype), raw.data_ptr(), w.n_rows, nb, packed.data_ptr(),  # type: ignore[union-attr]
                   torch.get_num_threads())
    w.packed = packed
    release_pages(w.raw)


def _weight(w: QTensor) -> tuple[torch.Tensor, int]:
    """The bytes the products read and their kernel type code: packed where `packs()` and the weight packs (made on
    first use), else the stored blocks."""
    if packs():
        pack(w)
        if w.packed is not None:
            return w.packed, PACKED[w.qtype]
    return (w.raw if w.raw.is_contiguous() else w.raw.contiguous()), int(w.qtype)


def matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y = x @ W.T for float x [..., in] and a Q4_K/Q6_K/Q8_0 weight W [out, in] on the CPU."""
    xr = quantize_for(x, w.qtype)
    n_out = w.n_rows
    raw, code = _weight(w)
    y = torch.empty(xr.rows, n_out)
    _LIB.kq_matmul(code, raw.data_ptr(), raw.numel() // n_out, n_out, xr.q.data_ptr(),  # type: ignore[union-attr]
                   xr.d.data_ptr(), _bsums(xr), _perm(xr, code), w.n_cols, xr.rows, y.data_ptr(), n_out,
                   nativelib.threads(n_out * w.n_cols), PORTABLE)
    return y.reshape(*x.shape[:-1], n_out)


def matmul_pairs(xr: Q8KRows, w: QTensor, xrow: torch.Tensor, experts: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Routed-expert products: out [P, rows] where pair p (sorted by expert; group g = pairs starts[g]…starts[g+1]
    on expert experts[g]) multiplies row xrow[p] of the quantized input (`quantize_for` W's type) by that
    expert's matrix in the stack W [E, rows, in]."""
    e_all = w.shape[0]
    rows = w.n_rows // e_all
    raw, code = _weight(w)
    expert_bytes = raw.numel() // e_all
    p_n = xrow.shape[0]
    out = torch.empty(p_n, rows)
    xrow, experts, starts = _i64(xrow), _i64(experts), _i64(starts)
    n_threads = nativelib.threads(p_n * rows * w.n_cols)
    _LIB.kq_matmul_pairs(code, raw.data_ptr(), expert_bytes, expert_bytes // rows, rows,  # type: ignore[union-attr]
                         xr.q.data_ptr(), xr.d.data_ptr(), _bsums(xr), _perm(xr, code), w.n_cols,
                         xrow.data_ptr(), experts.shape[0], experts.data_ptr(), starts.data_ptr(), out.data_ptr(),
                         n_threads, PORTABLE)
    return out
