"""Activations as llama.cpp's CPU backend sees them before a product with a quantized weight (spec §8).

ggml quantizes the activations of quantized matmuls: to Q8_0 (blocks of 32, scale amax/127 stored as f16) for
Q8_0 and the legacy types without a minimum, to Q8_1 (Q8_0's quants and scales, and s = fp16(d·Σq) per block) for
Q4_1 and Q5_1, to Q8_K (blocks of 256, scale from the signed extreme, sums of 16 quants) for K- and IQ-quants, and
rounds them to F16/BF16 for half-precision weights. Integer products take the quantized rows
(`quantize`: one row type, natively or in torch ops, the same bits); float products take x rounded the same way
(`round_for`), since an integer dot product of the rounded values equals a float dot of them.

Several products of a layer multiply the same normed x (q/k/v, the GDN projections, the router, the shared and
routed experts), and a MoE layer alternates x and the experts' h: the results for the last two inputs are kept
per format (recognised by identity and `_version`, so an in-place change is a miss, and per thread, so the
worker and the GUI or a test never see each other's entries).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from engine.ops import native
from engine.ops.backend import ISA_LEVEL

T = TypeVar("T")

# The activation format of each weight type's products (ggml-cpu vec_dot_type).
Q8_0_ACT = frozenset({"Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4"})
Q8_1_ACT = frozenset({"Q4_1", "Q5_1"})
Q8_K_ACT = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                      "IQ3_XXS", "IQ3_S", "IQ4_XS"})


class LastInputs(Generic[T]):
    """The results for the last `size` inputs, by identity, version and thread."""

    def __init__(self, size: int = 2):
        self.size = size
        self._items: list[tuple[int, torch.Tensor, int, T]] = []

    def get(self, x: torch.Tensor) -> T | None:
        items = self._items  # replaced, never changed in place: safe to walk while another thread puts
        if not items:
            return None
        me = threading.get_ident()
        for hit in items:
            if hit[1] is x and hit[0] == me and hit[2] == x._version:
                return hit[3]
        return None

    def put(self, x: torch.Tensor, value: T) -> T:
        keep = self._items[max(0, len(self._items) - self.size + 1):]
        self._items = keep + [(threading.get_ident(), x, x._version, value)]
        return value


@dataclass
class QuantRows:
    """Rows as a native product takes them: quants int8 [M, K], scales float32 [M, K/block] (Q8_0, Q8_1:
    f16-rounded), for Q8_K the sums of 16 quants int16 [M, K/16] (else None), for Q8_1 s = fp16(d·Σq) [M, K/32] as
    float32 (else None); for F16/BF16 the rounded values' 16 bits in q (int16 [M, K]) and no scales."""

    q: torch.Tensor
    d: torch.Tensor | None
    bsums: torch.Tensor | None
    s: torch.Tensor | None = None
    _q4k: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    def blocks(self) -> torch.Tensor:
        """Q8_0 quants as [M, K/32, 32] (the torch integer products' view)."""
        return self.q.view(self.q.shape[0], -1, native.QK_8_0)

    def q4k_order(self) -> torch.Tensor:
        """The quants in the order Q4_K blocks hold their values (made once, for the first Q4_K weight)."""
        if self._q4k is None:
            self._q4k = native.q4_k_order(self.q)
        return self._q4k


_MEMO: dict[str, LastInputs[QuantRows]] = {f: LastInputs() for f in ("Q8_0", "Q8_1", "Q8_K", "F16", "BF16")}
_ROUNDED: dict[str, LastInputs[torch.Tensor]] = {}


def act_format(weight_type: str) -> str:
    """The activation format of a `weight_type` product: "Q8_0", "Q8_1", "Q8_K", "F16", "BF16" or "F32"."""
    if weight_type in Q8_0_ACT:
        return "Q8_0"
    if weight_type in Q8_1_ACT:
        return "Q8_1"
    if weight_type in Q8_K_ACT:
        return "Q8_K"
    return weight_type if weight_type in ("F16", "BF16") else "F32"


def quantize(x: torch.Tensor, fmt: str, on_native: bool, level: int = ISA_LEVEL["avx512vnni"]) -> QuantRows:
    """x [..., K] float32 as rows [M, K] in ggml's quantize_row_q8_0 (fmt "Q8_0"), quantize_row_q8_1 ("Q8_1") or
    quantize_row_q8_K ("Q8_K"), by the native kernels (`on_native`, at instruction-set `level`: Backend.level) or
    torch ops (Q8_0 only): the same bits whatever the form; or rounded to "F16" / "BF16" (to nearest even, in torch:
    the bits engine/native/half.c round_half makes)."""
    memo = _MEMO[fmt]
    hit = memo.get(x)
    if hit is not None:
        return hit
    k = x.shape[-1]
    if not on_native:
        if fmt != "Q8_0":
            raise ValueError("Q8_K rows are made by the native kernels only")
        return memo.put(x, _q8_0_torch(x.reshape(-1, k)))
    xc = x.detach().reshape(-1, k).float().contiguous()
    m = xc.shape[0]
    if fmt in ("F16", "BF16"):
        h = xc.half() if fmt == "F16" else xc.bfloat16()
        return memo.put(x, QuantRows(h.view(torch.int16), None, None))
    if fmt == "Q8_0":
        r = QuantRows(torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // native.QK_8_0), None)
        native.quantize_q8_0(xc, r.q, r.d, level)
    elif fmt == "Q8_1":
        r = QuantRows(torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // native.QK_8_0), None,
                      torch.empty(m, k // native.QK_8_0))
        native.quantize_q8_1(xc, r.q, r.d, r.s, level)  # type: ignore[arg-type]
    else:
        r = QuantRows(torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // native.QK_K),
                      torch.empty(m, k // 16, dtype=torch.int16))
        native.quantize_q8_k(xc, r.q, r.d, r.bsums, level)  # type: ignore[arg-type]
    return memo.put(x, r)


def _q8_0_torch(x: torch.Tensor) -> QuantRows:
    b = x.reshape(x.shape[0], -1, native.QK_8_0)
    d = b.abs().amax(-1).div_(127.0)
    inv = d.reciprocal().nan_to_num_(posinf=0.0)  # ggml: id = d ? 1/d : 0
    q = torch.mul(b, inv.unsqueeze(-1)).round_().to(torch.int8)
    return QuantRows(q.view(x.shape[0], -1), d.half().float(), None)


def round_for(x: torch.Tensor, weight_type: str) -> torch.Tensor:
    """x as llama.cpp's CPU backend sees it when multiplying by a `weight_type` matrix, in float32: quantized and
    dequantized to Q8_0 / Q8_K, or rounded to F16 / BF16. The last input's result per type is kept."""
    if act_format(weight_type) == "F32":
        return x
    memo = _ROUNDED.get(weight_type)
    if memo is None:
        memo = _ROUNDED[weight_type] = LastInputs(1)
    hit = memo.get(x)
    if hit is not None:
        return hit
    y = _round(x, weight_type)
    return y if x.requires_grad else memo.put(x, y)


def _round(x: torch.Tensor, weight_type: str) -> torch.Tensor:
    fmt = act_format(weight_type)
    if fmt in ("Q8_0", "Q8_1"):  # Q8_1's quants and scales are Q8_0's (its s only regroups the minimum's term)
        b = x.reshape(-1, 32)
        d = b.abs().amax(-1, keepdim=True) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(b * inv)
        return (q * d.half().float()).reshape(x.shape)
    if fmt == "Q8_K":
        b = x.reshape(-1, 256)
        idx = b.abs().argmax(-1, keepdim=True)
        mx = torch.gather(b, 1, idx)
        iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
        q = torch.clamp(torch.round(iscale * b), max=127.0)
        d = torch.where(mx != 0, 1.0 / iscale, torch.zeros_like(mx))
        return (q * d).reshape(x.shape)
    if fmt == "F16":
        return x.half().float()
    if fmt == "BF16":
        return x.bfloat16().float()
    return x
