"""Q4_K / Q6_K products through the native kernels in engine/native/kquant.c (engine.nativelib).

llama.cpp multiplies a K-quant weight by activations quantized to Q8_K with integer dot products per
sub-block. Dequantizing the weight to float32 on every pass instead cost ~0.5 GB/s of weights on this
path's target shapes, and every extra token of a multi-token pass re-read the float tile. The kernels
unpack each weight block once and multiply it by all the pass's rows while it is in L1, so a pass of N
tokens reads the weights once; integer sums are exact and each output element's float work is the
same whatever N, so batched passes stay bit-identical to one-token passes.

The library is built with the package (engine.nativelib). Without it, `nativelib.available()` is False and the engine
keeps its torch path (engine.rowwise), which is also what the tests compare the kernels against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT

from engine import nativelib
from engine.lastinputs import LastInputs
from engine.quant import QTensor

QK = 256
TYPES = (QT.Q4_K, QT.Q6_K)
_LIB = nativelib.LIB
# True: run the portable C products even where the AVX512 ones can (tests compare the two).
PORTABLE = False


def isa() -> str:
    """The instruction set the products run on."""
    if _LIB is None:
        return "none"
    return "portable C" if PORTABLE else {1: "avx512bw", 0: "portable C"}[_LIB.kq_isa()]


def usable(w: object, x: torch.Tensor) -> bool:
    """Whether `x @ w.T` takes the native path: a Q4_K/Q6_K weight on the CPU, x on the CPU."""
    return (_LIB is not None and isinstance(w, QTensor) and w.qtype in TYPES and w.raw.device.type == "cpu"
            and x.device.type == "cpu" and w.n_cols % QK == 0)


@dataclass
class Q8KRows:
    """Rows quantized to Q8_K: quants int8 [M, K], scales float32 [M, K/256], sums of 16 quants int16 [M, K/16]."""

    q: torch.Tensor
    d: torch.Tensor
    bsums: torch.Tensor
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


def quantize_rows(x: torch.Tensor) -> Q8KRows:
    """x [..., K] float32 as rows [M, K] in ggml's quantize_row_q8_K. The last two inputs' results are kept:
    attention, GDN, router and the experts multiply the same normed x."""
    hit = _MEMO.get(x)
    if hit is not None:
        return hit
    k = x.shape[-1]
    xc = x.detach().reshape(-1, k).float().contiguous()
    m = xc.shape[0]
    r = Q8KRows(torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // QK), torch.empty(m, k // 16, dtype=torch.int16))
    _LIB.kq_quantize_q8k(xc.data_ptr(), m, k, r.q.data_ptr(), r.d.data_ptr(), r.bsums.data_ptr())  # type: ignore[union-attr]
    return _MEMO.put(x, r)


def _perm(xr: Q8KRows, w: QTensor) -> int:
    return xr.q4k_order().data_ptr() if w.qtype == QT.Q4_K and not PORTABLE and _LIB.kq_isa() == 1 else 0  # type: ignore[union-attr]


def matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y = x @ W.T for float x [..., in] and a Q4_K/Q6_K weight W [out, in] on the CPU."""
    xr = quantize_rows(x)
    n_out = w.n_rows
    raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
    y = torch.empty(xr.rows, n_out)
    _LIB.kq_matmul(int(w.qtype), raw.data_ptr(), raw.numel() // n_out, n_out, xr.q.data_ptr(),  # type: ignore[union-attr]
                   xr.d.data_ptr(), xr.bsums.data_ptr(), _perm(xr, w), w.n_cols, xr.rows, y.data_ptr(), n_out,
                   nativelib.threads(n_out * w.n_cols), PORTABLE)
    return y.reshape(*x.shape[:-1], n_out)


def matmul_pairs(xr: Q8KRows, w: QTensor, xrow: torch.Tensor, experts: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Routed-expert products: out [P, rows] where pair p (sorted by expert; group g = pairs starts[g]…starts[g+1]
    on expert experts[g]) multiplies row xrow[p] of the quantized input by that expert's matrix in the
    stack W [E, rows, in]."""
    e_all = w.shape[0]
    rows = w.n_rows // e_all
    raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
    expert_bytes = raw.numel() // e_all
    p_n = xrow.shape[0]
    out = torch.empty(p_n, rows)
    xrow, experts, starts = (t.to(torch.int64).contiguous() for t in (xrow, experts, starts))
    _LIB.kq_matmul_pairs(int(w.qtype), raw.data_ptr(), expert_bytes, expert_bytes // rows, rows,  # type: ignore[union-attr]
                         xr.q.data_ptr(), xr.d.data_ptr(), xr.bsums.data_ptr(), _perm(xr, w), w.n_cols,
                         xrow.data_ptr(), experts.shape[0], experts.data_ptr(), starts.data_ptr(), out.data_ptr(),
                         nativelib.threads(p_n * rows * w.n_cols), PORTABLE)
    return out
