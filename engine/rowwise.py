"""Batch-invariant products: row i of a multi-token pass gets exactly the bits of a one-token pass.

A plain `x @ W.T` lets the BLAS pick different kernels and reduction orders for different numbers
of rows (measured: rows of a 4-row mm differ from the 1-row result). A batched matmul over rows,
each row a [1, in] × [in, out] product against the same (expanded, not copied) weight, runs the
same kernel per row whatever N is, and equals the 1-row mm bit for bit. Speculative verify and
prefill rely on this to be token-identical to plain decoding.
"""
from __future__ import annotations

import threading

import torch

from engine import kquant, q8dot
from engine.quant import TILE_ELEMENTS, QTensor, release_pages

_FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# The activation format llama.cpp's CPU matmul rounds x to for each weight type (ggml-cpu vec_dot_type).
_Q8_0_ACT = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"}
_Q8_K_ACT = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
             "IQ3_S", "IQ4_XS"}


# The last input rounded per weight type, with the thread that rounded it: q/k/v, GDN qkv/z/β/α, router,
# shared and routed experts all multiply the same normed x, so each type's rounding runs once per layer.
_ROUNDED: dict[str, tuple[int, torch.Tensor, int, torch.Tensor]] = {}


def round_activations(x: torch.Tensor, weight_type: str) -> torch.Tensor:
    """x as llama.cpp's CPU backend sees it when multiplying by a `weight_type` matrix.

    ggml quantizes the activations of quantized matmuls: to Q8_0 (blocks of 32, scale = amax/127
    stored as f16) or Q8_K (blocks of 256, scale = −max/127 from the signed extreme, q ≤ 127), and
    rounds them to F16/BF16 for half-precision weights. The integer dot product it then runs equals
    a float dot of these rounded values, so rounding x here reproduces its numbers (spec §8).
    """
    me = threading.get_ident()
    hit = _ROUNDED.get(weight_type)
    if hit is not None and hit[0] == me and hit[1] is x and hit[2] == x._version:
        return hit[3]
    y = _round(x, weight_type)
    if not x.requires_grad:
        _ROUNDED[weight_type] = (me, x, x._version, y)
    return y


def _round(x: torch.Tensor, weight_type: str) -> torch.Tensor:
    if weight_type in _Q8_0_ACT:
        b = x.reshape(-1, 32)
        d = b.abs().amax(-1, keepdim=True) / 127.0
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(b * inv)
        return (q * d.half().float()).reshape(x.shape)
    if weight_type in _Q8_K_ACT:
        b = x.reshape(-1, 256)
        idx = b.abs().argmax(-1, keepdim=True)
        mx = torch.gather(b, 1, idx)
        iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
        q = torch.clamp(torch.round(iscale * b), max=127.0)
        d = torch.where(mx != 0, 1.0 / iscale, torch.zeros_like(mx))
        return (q * d).reshape(x.shape)
    if weight_type == "F16":
        return x.half().float()
    if weight_type == "BF16":
        return x.bfloat16().float()
    return x


def _rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in], w [out, in] float32 → [N, out], one independent product per row."""
    n = x.shape[0]
    return torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(n, -1, -1)).squeeze(1)


def tile_rows(w: QTensor) -> int:
    """Rows per dequantized tile: fixed per weight (never by N), so tiling cannot change results."""
    return max(1, min(w.n_rows, TILE_ELEMENTS // max(w.n_cols, 1)))


Weight = QTensor | torch.Tensor  # a GGUF tensor, or a float parameter while training


def weight_type(w: Weight) -> str:
    return w.qtype.name if isinstance(w, QTensor) else "F32"


def rowwise_matmul(x: torch.Tensor, w: Weight, ggml_activations: bool = True) -> torch.Tensor:
    """y = x @ W.T with W kept quantized: dequantized one tile of rows at a time into float32.

    ggml_activations: round x as llama.cpp's CPU backend does for this weight type (see above).
    A float tensor W (a parameter being trained) takes plain `F.linear`: fast and differentiable,
    not batch-invariant, which training does not need.
    """
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w)
    k, n_out = w.n_cols, w.n_rows
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight {w.shape} expects {k}")
    xf = x.float()  # x itself when already float32, so the rounding memo can recognise it
    if ggml_activations and kquant.usable(w, xf):
        return kquant.matmul(xf, w)
    if ggml_activations and q8dot.usable(w, xf):
        return q8dot.matmul(xf, w)
    if ggml_activations:
        xf = round_activations(xf, w.qtype.name)
    x2 = xf.reshape(-1, k)
    if w.qtype.name == "F32" and w.raw.device == x2.device:
        return _rowwise(x2, w.raw.view(torch.float32).view(n_out, k)).reshape(*x.shape[:-1], n_out)
    step = tile_rows(w)
    if step >= n_out:
        return _rowwise(x2, w.dequantize(slice(0, n_out), device=x2.device)).reshape(*x.shape[:-1], n_out)
    y = torch.empty(x2.shape[0], n_out, dtype=torch.float32, device=x2.device)
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        y[:, r0:r1] = _rowwise(x2, w.dequantize(slice(r0, r1), device=x2.device))
    return y.reshape(*x.shape[:-1], n_out)


# Weights stacked for `project` up to this many bytes in all: the stacked copy is new memory, and on larger
# weights a product's call overhead is a negligible share of its arithmetic.
FUSE_MAX_BYTES = 16 << 20


def project(x: torch.Tensor, ws: tuple[Weight, ...]) -> list[torch.Tensor]:
    """Several weights applied to the same x: one product over their rows stacked when they are small and all
    of one quantized type and width on the integer paths (each product's calls cost more than its arithmetic on
    small models; rows are independent, so the bits are those of separate products)."""
    if len(ws) > 1 and all(isinstance(w, QTensor) for w in ws) and len({(w.qtype, w.n_cols) for w in ws}) == 1 \
            and sum(w.raw.numel() * w.raw.element_size() for w in ws) <= FUSE_MAX_BYTES:  # type: ignore[union-attr]
        xf = x.float()
        if all(kquant.usable(w, xf) for w in ws):
            y = kquant.matmul(xf, _stacked(ws))  # type: ignore[arg-type]
        elif all(q8dot.usable(w, xf) for w in ws):
            y = q8dot.matmul(xf, _stacked(ws))  # type: ignore[arg-type]
        else:
            return [rowwise_matmul(x, w) for w in ws]
        return list(torch.split(y, [w.n_rows for w in ws], dim=-1))  # type: ignore[union-attr]
    return [rowwise_matmul(x, w) for w in ws]


def _stacked(ws: tuple[QTensor, ...]) -> QTensor:
    """The weights' rows in one tensor, made once and kept with the first weight (the set belongs to one layer,
    so it lives and dies with it). Where the parts are views of the model file, their resident pages are dropped
    once copied (engine.quant.release_pages; they reload from the file if something else reads them)."""
    key = tuple(id(w) for w in ws[1:])
    fused = ws[0].fused = ws[0].fused or {}
    w = fused.get(key)
    if w is None:
        raw = torch.cat([w.raw.reshape(w.n_rows, -1) for w in ws])
        w = fused[key] = QTensor(raw, ws[0].qtype, (raw.shape[0], ws[0].n_cols))
        for part in ws:  # the products read the stack: the parts' file pages it was copied from can go
            release_pages(part.raw)
    return w


def take_rows(w: Weight, idx: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Dequantize rows `idx` (e.g. token embeddings) without touching the rest of the tensor."""
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.embedding(idx.reshape(-1).to(w.device), w)
    idx = idx.reshape(-1).to(w.raw.device)
    return QTensor(w.raw[idx], w.qtype, (idx.numel(), w.n_cols)).dequantize(device=device)
