"""Q8_0 products in integers, the way llama.cpp's CPU backend computes them.

ggml multiplies a Q8_0 weight by activations it first quantizes to Q8_0 (blocks of 32, scale amax/127
stored as f16): per block an exact integer dot product, scaled by d_w·d_x, summed over the blocks. We do
the same with `torch._int_mm` (int8 × int8 → int32) on an int8 copy of the weight's quants, instead of
dequantizing every weight to float32 on every pass: on the embedded model that dequantization was ~60 % of
a decode step. The int8 weight plane (1 byte per weight, plus the scales as float32) is made once per
tensor, as llama.cpp's CPU "repack" buffers are; the weights stay quantized.

Per-block sums need the blocks kept apart. A row x is laid out block-diagonally ([nb, in], block b of x in
row b, zeros elsewhere) so one integer GEMM yields all nb block sums [M, nb, out]; for many rows we run one
GEMM per block instead (no wasted multiplies). Integer sums are exact, so every layout, grouping or chunking
gives the same int32 values, and the float epilogue — (sum · d_w) · d_x, then the sum over blocks, the same
element-wise ops whatever the shape — makes row i of a multi-token pass bit-identical to a one-token pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT

from engine.ops.activations import QuantRows, quantize
from engine.ops.backend import Int8Layouts
from engine.storage.qtensor import QTensor

BLOCK = 32
_BYTES = 34  # block_q8_0: f16 scale, then 32 int8 quants
# Rows per chunk of a product are bounded so the [rows, nb, out] epilogue temporaries stay a few MB.
_EPILOGUE_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class Planes:
    """A Q8_0 matrix (or a stack of them) split into int8 quants and float32 scales."""

    qs: torch.Tensor  # int8 [..., rows, cols]
    d: torch.Tensor  # float32 [..., rows, cols / 32]


def usable(w: QTensor, layouts: Int8Layouts) -> bool:
    """Whether products with w run in integers: a Q8_0 weight on the CPU of at most `layouts.max_cols` columns. Its
    block layouts cost nb = cols/32 times the multiplies or nb GEMMs; measured (bench/results/q8dot.json) it beats
    dequantize-then-float up to 512 columns and loses from 2048 on. The choice depends on the weight alone, never
    on the number of rows, so a weight's rows get the same bits in every pass."""
    return w.qtype == QT.Q8_0 and w.n_cols <= layouts.max_cols and w.raw.device.type == "cpu"


def unpack(raw: torch.Tensor, shape: tuple[int, ...]) -> Planes:
    """Planes of Q8_0 blocks stored as uint8 [rows, bytes_per_row], for the logical `shape`."""
    cols = shape[-1]
    b = raw.reshape(-1, cols // BLOCK, _BYTES)
    d = b[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
    qs = b[..., 2:].contiguous().view(torch.int8)
    return Planes(qs.reshape(*shape[:-1], cols), d.reshape(*shape[:-1], cols // BLOCK))


def planes(w: QTensor) -> Planes:
    """The weight's planes as `matmul` takes them: quants [rows, cols] and the scales transposed, [cols/32, rows]
    contiguous (the epilogue multiplies [M, nb, rows] sums by them: 2× faster than through a transposed view)."""
    u = unpack(w.raw, w.shape)
    return Planes(u.qs.view(w.n_rows, w.n_cols), u.d.view(w.n_rows, -1).t().contiguous())


_EYE: dict[int, torch.Tensor] = {}


def _blockdiag(q: torch.Tensor) -> torch.Tensor:
    """int8 [M, nb, 32] → [M·nb, nb·32]: row (m, b) holds block b of row m, zeros elsewhere."""
    m, nb, _ = q.shape
    eye = _EYE.get(nb)
    if eye is None:
        eye = _EYE[nb] = torch.eye(nb, dtype=torch.int8).view(1, nb, nb, 1)
    return (q.unsqueeze(1) * eye).view(m * nb, nb * BLOCK)


def _block_sums(q: torch.Tensor, w_t: torch.Tensor, diag: bool) -> torch.Tensor:
    """Exact per-block dot products int32 [M, nb, out] of rows q [M, nb, 32] with weight quants w_t [K, out]
    (a transposed view of the [out, K] plane, or an expert's down plane stored that way). diag: one
    block-diagonal GEMM (True) or one GEMM per block (False)."""
    m, nb, _ = q.shape
    if diag:
        return torch._int_mm(_blockdiag(q), w_t).view(m, nb, -1)
    return torch.stack([torch._int_mm(q[:, b].contiguous(), w_t[b * BLOCK:(b + 1) * BLOCK])
                        for b in range(nb)], dim=1)


def _epilogue(s: torch.Tensor, dw_t: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """Σ_b (s_b · d_w,b) · d_x,b for s int32 [M, nb, out], dw_t [nb, out] or [M, nb, out], dx [M, nb]."""
    y = s.float().mul_(dw_t)
    return y.mul_(dx.unsqueeze(-1)).sum(1)


def matmul(x: torch.Tensor, p: Planes, layouts: Int8Layouts) -> torch.Tensor:
    """y = x @ W.T for float32 x [..., in] and a Q8_0 weight W [out, in] as `planes`."""
    qs, dw_t = p.qs, p.d
    n_out, k = qs.shape
    xr = quantize(x, "Q8_0", on_native=False)
    xq = xr.blocks()
    nb = k // BLOCK
    step = max(1, _EPILOGUE_ELEMENTS // (nb * n_out))
    chunks = [(i, min(xr.rows, i + step)) for i in range(0, xr.rows, step)]
    y = torch.cat([_epilogue(_block_sums(xq[a:b], qs.t(), b - a <= layouts.blockdiag_rows), dw_t, xr.d[a:b])
                   for a, b in chunks]) if len(chunks) > 1 else \
        _epilogue(_block_sums(xq, qs.t(), xr.rows <= layouts.blockdiag_rows), dw_t, xr.d)
    return y.reshape(*x.shape[:-1], n_out)


def expert_planes(gate: QTensor, up: QTensor, down: QTensor,
                  shared: tuple[QTensor, QTensor, QTensor] | None = None) -> tuple[Planes, Planes]:
    """Planes of stacked experts in the layout `experts` multiplies them in (the caller keeps them). With `shared` (the shared expert's gate, up, down, F_s = S·F wide), S more experts follow the routed ones:
    shared slice j is rows j·F…(j+1)·F of its gate and up and the same columns of its down, so a pass runs the
    shared expert in the routed experts' products (silu(g)·u is element-wise, down sums over F: the slices'
    outputs add up to the shared expert's)."""
    g, u, d = unpack(gate.raw, gate.shape), unpack(up.raw, up.shape), unpack(down.raw, down.shape)
    if shared:
        f, k = gate.shape[1], gate.shape[2]
        sg, su, sd = (unpack(t.raw, t.shape) for t in shared)
        s_n = sg.qs.shape[0] // f
        g, u = (Planes(torch.cat([r.qs, s.qs.view(s_n, f, k)]), torch.cat([r.d, s.d.view(s_n, f, -1)]))
                for r, s in ((g, sg), (u, su)))
        d = Planes(torch.cat([d.qs, sd.qs.view(k, s_n, f).transpose(0, 1)]),
                   torch.cat([d.d, sd.d.view(k, s_n, -1).transpose(0, 1)]))
    return stack_experts(g, u, d)


def shared_slices(routed: tuple[QTensor, QTensor, QTensor], shared: tuple[QTensor, QTensor, QTensor],
                  layouts: Int8Layouts) -> int:
    """How many routed-expert-sized slices the shared expert makes (0: it cannot join the routed experts'
    products — not all six weights integer Q8_0 on the CPU, or not a multiple of the routed width)."""
    if not all(isinstance(t, QTensor) and usable(t, layouts) for t in (*routed, *shared)):
        return 0
    f, k = routed[0].shape[1], routed[0].shape[2]
    sg, su, sd = shared
    fs = sg.n_rows
    fits = fs % f == 0 and su.shape == sg.shape == (fs, k) and sd.shape == (k, fs)
    return fs // f if fits else 0


def stack_experts(g: Planes, u: Planes, d: Planes) -> tuple[Planes, Planes]:
    """Expert planes as `experts` takes them. Gate and up stacked: quants [E, 2F, d], scales [E, d/32, 2F] (one
    GEMM computes both). Down block-major: quants [F/32, E, 32, d] (block b of every expert's input is one
    contiguous [E·32, d] slab, so the per-block products need no copy), scales [E, F/32, d]."""
    gu = Planes(torch.cat([g.qs, u.qs], 1), torch.cat([g.d, u.d], 1).transpose(1, 2).contiguous())
    e_n, d_out, f = d.qs.shape
    qs = d.qs.view(e_n, d_out, f // BLOCK, BLOCK).permute(2, 0, 3, 1).contiguous()
    return gu, Planes(qs, d.d.transpose(1, 2).contiguous())


def select(gate_up: Planes, down: Planes, at: torch.Tensor) -> tuple[Planes, Planes]:
    """The planes of experts `at` (in that order)."""
    return (Planes(gate_up.qs.index_select(0, at), gate_up.d.index_select(0, at)),
            Planes(down.qs.index_select(1, at), down.d.index_select(0, at)))


def experts(xr: QuantRows, tokens: torch.Tensor, local: torch.Tensor, counts: list[int],
            gate_up: Planes, down: Planes, layouts: Int8Layouts) -> torch.Tensor:
    """Outputs [P, d] of (token, expert) pairs sorted by expert: pair p runs expert `local[p]` (an index
    into the given experts' planes, laid out by `stack_experts`) on row `tokens[p]` of the Q8_0 input rows.
    `counts` are the pairs per expert, in order. Every layout gives the same exact integer sums: small passes
    run block-diagonal GEMMs (one call, nb× the multiplies), larger ones a GEMM per block, prefill one expert
    at a time (`layouts` sets where)."""
    s_n, f2, k = gate_up.qs.shape
    f = f2 // 2
    xq = xr.blocks()
    t_n, nb = xq.shape[0], xq.shape[1]
    p_n = tokens.shape[0]
    dense = t_n * k * s_n * f2
    if dense <= layouts.dense_expert_macs:  # every token × every given expert: one block-diagonal GEMM or one per block
        s = _block_sums(xq, gate_up.qs.view(s_n * f2, k).t(), dense * nb <= layouts.gate_up_blockdiag_macs)
        s = s.view(t_n, nb, s_n, f2)
        gu = _epilogue(s[tokens, :, local], gate_up.d[local], xr.d[tokens])  # only the pairs' sums are scaled
    else:
        gu = torch.empty(p_n, f2)
        for e, a, b in _spans(counts):
            at = tokens[a:b]
            gu[a:b] = _epilogue(_block_sums(xq[at], gate_up.qs[e].t(), b - a <= layouts.blockdiag_rows),
                                gate_up.d[e], xr.d[at])
    h = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
    hr = quantize(h, "Q8_0", on_native=False)
    hq = hr.blocks()
    nbf, d_out = down.qs.shape[0], down.qs.shape[3]
    pairs = ARANGE[:p_n]
    if p_n * nbf * s_n * f * d_out <= layouts.down_blockdiag_macs:  # block-diagonal over (block, expert)
        xd = torch.zeros(p_n, nbf, nbf, s_n, BLOCK, dtype=torch.int8)
        b_idx = ARANGE[:nbf]
        xd[pairs.unsqueeze(1), b_idx, b_idx, local.unsqueeze(1)] = hq
        s = torch._int_mm(xd.view(p_n * nbf, f * s_n), down.qs.view(f * s_n, d_out)).view(p_n, nbf, d_out)
    elif p_n * s_n * f * d_out <= layouts.dense_expert_macs:  # one GEMM per block, block-diagonal over experts
        xd = torch.zeros(nbf, p_n, s_n, BLOCK, dtype=torch.int8)
        xd[:, pairs, local] = hq.transpose(0, 1)
        s = torch.stack([torch._int_mm(xd[b].view(p_n, s_n * BLOCK), down.qs[b].view(s_n * BLOCK, d_out))
                         for b in range(nbf)], dim=1)
    else:
        y = torch.empty(p_n, d_out)
        for e, a, b in _spans(counts):
            y[a:b] = _epilogue(_block_sums(hq[a:b], down.qs[:, e].reshape(f, d_out), b - a <= layouts.blockdiag_rows),
                               down.d[e], hr.d[a:b])
        return y
    return _epilogue(s, down.d[local], hr.d)


ARANGE = torch.arange(1 << 16)  # index tables sliced instead of made per pass


def _spans(counts: list[int]) -> list[tuple[int, int, int]]:
    out, a = [], 0
    for e, c in enumerate(counts):
        out.append((e, a, a + c))
        a += c
    return out
