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

from engine.lastinputs import LastInputs
from engine.quant import QTensor

BLOCK = 32
_BYTES = 34  # block_q8_0: f16 scale, then 32 int8 quants
# Above this many rows the block-diagonal GEMM's wasted multiplies (nb× the work) cost more than nb calls.
_BLOCKDIAG_ROWS = 32
# Rows per chunk of a product are bounded so the [rows, nb, out] epilogue temporaries stay a few MB.
_EPILOGUE_ELEMENTS = 1 << 21
# Expert passes up to this many multiply-adds run as one dense GEMM over all selected experts; larger
# ones (prefill) loop over the experts. Both give the same bits.
DENSE_EXPERT_MACS = 1 << 25


@dataclass(frozen=True)
class Planes:
    """A Q8_0 matrix (or a stack of them) split into int8 quants and float32 scales."""

    qs: torch.Tensor  # int8 [..., rows, cols]
    d: torch.Tensor  # float32 [..., rows, cols / 32]


@dataclass(frozen=True)
class Q8Rows:
    """Activation rows quantized to Q8_0: quants int8 [M, nb, 32], scales float32 [M, nb] (f16-rounded)."""

    q: torch.Tensor
    d: torch.Tensor


# Widest rows the integer path takes. Its block layouts cost nb = cols/32 times the multiplies (block-diagonal)
# or nb GEMMs; measured (bench/results/q8dot.json) it beats dequantize-then-float up to 512 columns and loses
# from 2048 on (×0.5 at 4 rows). The choice depends on the weight alone, never on the number of rows, so a
# weight's rows get the same bits in every pass.
MAX_COLS = 512


def usable(w: object, x: torch.Tensor) -> bool:
    """Whether `x @ w.T` takes the integer path: a Q8_0 weight of at most MAX_COLS columns, on the CPU."""
    return (isinstance(w, QTensor) and w.qtype == QT.Q8_0 and w.n_cols <= MAX_COLS and w.raw.device.type == "cpu"
            and x.device.type == "cpu")


def unpack(raw: torch.Tensor, shape: tuple[int, ...]) -> Planes:
    """Planes of Q8_0 blocks stored as uint8 [rows, bytes_per_row], for the logical `shape`."""
    cols = shape[-1]
    b = raw.reshape(-1, cols // BLOCK, _BYTES)
    d = b[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
    qs = b[..., 2:].contiguous().view(torch.int8)
    return Planes(qs.reshape(*shape[:-1], cols), d.reshape(*shape[:-1], cols // BLOCK))


def planes(w: QTensor) -> Planes:
    """The weight's planes as `matmul` takes them, made on first use and kept with the tensor: quants
    [rows, cols] and the scales transposed, [cols/32, rows] contiguous (the epilogue multiplies [M, nb, rows]
    sums by them: 2× faster than through a transposed view)."""
    p = w.planes
    if p is None:
        u = unpack(w.raw, w.shape)
        p = w.planes = Planes(u.qs.view(w.n_rows, w.n_cols), u.d.view(w.n_rows, -1).t().contiguous())
    return p


# The last two inputs quantized (a MoE layer alternates x and the experts' h).
_MEMO: LastInputs[Q8Rows] = LastInputs()


def quantize_rows(x: torch.Tensor) -> Q8Rows:
    """x [..., K] float32 (as rows [M, K]) as ggml's quantize_row_q8_0 makes it; the last input's result is reused, since q/k/v,
    the GDN projections, router, shared and routed experts all multiply the same normed x."""
    hit = _MEMO.get(x)
    if hit is not None:
        return hit
    b = x.reshape(-1, x.shape[-1] // BLOCK, BLOCK)
    d = b.abs().amax(-1).div_(127.0)
    inv = d.reciprocal().nan_to_num_(posinf=0.0)  # ggml: id = d ? 1/d : 0
    return _MEMO.put(x, Q8Rows(torch.mul(b, inv.unsqueeze(-1)).round_().to(torch.int8), d.half().float()))


_EYE: dict[int, torch.Tensor] = {}


def _blockdiag(q: torch.Tensor) -> torch.Tensor:
    """int8 [M, nb, 32] → [M·nb, nb·32]: row (m, b) holds block b of row m, zeros elsewhere."""
    m, nb, _ = q.shape
    eye = _EYE.get(nb)
    if eye is None:
        eye = _EYE[nb] = torch.eye(nb, dtype=torch.int8).view(1, nb, nb, 1)
    return (q.unsqueeze(1) * eye).view(m * nb, nb * BLOCK)


def _block_sums(q: torch.Tensor, w_t: torch.Tensor, diag: bool | None = None) -> torch.Tensor:
    """Exact per-block dot products int32 [M, nb, out] of rows q [M, nb, 32] with weight quants w_t [K, out]
    (a transposed view of the [out, K] plane, or an expert's down plane stored that way). diag: one
    block-diagonal GEMM (True) or one GEMM per block (False); by default by the number of rows."""
    m, nb, _ = q.shape
    if (m <= _BLOCKDIAG_ROWS) if diag is None else diag:
        return torch._int_mm(_blockdiag(q), w_t).view(m, nb, -1)
    return torch.stack([torch._int_mm(q[:, b].contiguous(), w_t[b * BLOCK:(b + 1) * BLOCK])
                        for b in range(nb)], dim=1)


def _epilogue(s: torch.Tensor, dw_t: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """Σ_b (s_b · d_w,b) · d_x,b for s int32 [M, nb, out], dw_t [nb, out] or [M, nb, out], dx [M, nb]."""
    y = s.float().mul_(dw_t)
    return y.mul_(dx.unsqueeze(-1)).sum(1)


def matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """y = x @ W.T for float32 x [..., in] and a Q8_0 weight W [out, in] on the CPU."""
    p = planes(w)
    k, n_out = w.n_cols, w.n_rows
    xr = quantize_rows(x)
    qs, dw_t = p.qs, p.d
    nb = k // BLOCK
    step = max(1, _EPILOGUE_ELEMENTS // (nb * n_out))
    m = xr.q.shape[0]
    if m <= step:
        y = _epilogue(_block_sums(xr.q, qs.t()), dw_t, xr.d)
    else:
        y = torch.cat([_epilogue(_block_sums(xr.q[i:i + step], qs.t()), dw_t, xr.d[i:i + step])
                       for i in range(0, m, step)])
    return y.reshape(*x.shape[:-1], n_out)


def expert_planes(gate: QTensor, up: QTensor, down: QTensor,
                  shared: tuple[QTensor, QTensor, QTensor] | None = None) -> tuple[Planes, Planes]:
    """Planes of stacked experts in the layout `experts` multiplies them in; made once, kept with the gate tensor.
    With `shared` (the shared expert's gate, up, down, F_s = S·F wide), S more experts follow the routed ones:
    shared slice j is rows j·F…(j+1)·F of its gate and up and the same columns of its down, so a pass runs the
    shared expert in the routed experts' products (silu(g)·u is element-wise, down sums over F: the slices'
    outputs add up to the shared expert's)."""
    fused = gate.fused = gate.fused or {}
    key = (id(up), id(down)) + (tuple(id(t) for t in shared) if shared else ())
    hit = fused.get(key)
    if hit is None:
        g, u, d = unpack(gate.raw, gate.shape), unpack(up.raw, up.shape), unpack(down.raw, down.shape)
        if shared:
            f, k = gate.shape[1], gate.shape[2]
            sg, su, sd = (unpack(t.raw, t.shape) for t in shared)
            s_n = sg.qs.shape[0] // f
            g, u = (Planes(torch.cat([r.qs, s.qs.view(s_n, f, k)]), torch.cat([r.d, s.d.view(s_n, f, -1)]))
                    for r, s in ((g, sg), (u, su)))
            d = Planes(torch.cat([d.qs, sd.qs.view(k, s_n, f).transpose(0, 1)]),
                       torch.cat([d.d, sd.d.view(k, s_n, -1).transpose(0, 1)]))
        hit = fused[key] = stack_experts(g, u, d)
    return hit


def shared_slices(routed: tuple[QTensor, QTensor, QTensor], shared: tuple[object, object, object],
                  x: torch.Tensor) -> int:
    """How many routed-expert-sized slices the shared expert makes (0: it cannot join the routed experts'
    products — not all six weights Q8_0 on the CPU with x, or not a multiple of the routed width)."""
    if not all(isinstance(t, QTensor) and usable(t, x) for t in (*routed, *shared)):
        return 0
    f, k = routed[0].shape[1], routed[0].shape[2]
    sg, su, sd = shared  # type: ignore[misc]
    fs = sg.n_rows
    fits = fs % f == 0 and su.shape == sg.shape == (fs, k) and sd.shape == (k, fs)  # type: ignore[attr-defined]
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


# Down projections up to this many multiply-adds in block-diagonal form run as one GEMM; larger ones as one GEMM
# per input block (measured: from ~8 pairs on, the F/32 calls cost less than the block-diagonal's F/32× work).
_DOWN_BLOCKDIAG_MACS = 1 << 22
# The same choice for gate/up over tokens × selected experts (block-diagonal: K/32 times the multiply-adds).
_GATE_UP_BLOCKDIAG_MACS = 1 << 22


def experts(xr: Q8Rows, tokens: torch.Tensor, local: torch.Tensor, counts: list[int],
            gate_up: Planes, down: Planes) -> torch.Tensor:
    """Outputs [P, d] of (token, expert) pairs sorted by expert: pair p runs expert `local[p]` (an index
    into the given experts' planes, laid out by `stack_experts`) on row `tokens[p]` of the quantized input.
    `counts` are the pairs per expert, in order. Every layout gives the same exact integer sums."""
    s_n, f2, k = gate_up.qs.shape
    f = f2 // 2
    t_n, nb = xr.q.shape[0], xr.q.shape[1]
    p_n = tokens.shape[0]
    dense = t_n * k * s_n * f2
    if dense <= DENSE_EXPERT_MACS:  # every token × every given expert: one block-diagonal GEMM or one per block
        s = _block_sums(xr.q, gate_up.qs.view(s_n * f2, k).t(), dense * nb <= _GATE_UP_BLOCKDIAG_MACS)
        s = s.view(t_n, nb, s_n, f2)
        gu = _epilogue(s[tokens, :, local], gate_up.d[local], xr.d[tokens])  # only the pairs' sums are scaled
    else:
        gu = torch.empty(p_n, f2)
        for e, a, b in _spans(counts):
            at = tokens[a:b]
            gu[a:b] = _epilogue(_block_sums(xr.q[at], gate_up.qs[e].t()), gate_up.d[e], xr.d[at])
    h = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
    hr = quantize_rows(h)
    nbf, d_out = down.qs.shape[0], down.qs.shape[3]
    pairs = ARANGE[:p_n]
    if p_n * nbf * s_n * f * d_out <= _DOWN_BLOCKDIAG_MACS:  # block-diagonal over (block, expert)
        xd = torch.zeros(p_n, nbf, nbf, s_n, BLOCK, dtype=torch.int8)
        b_idx = ARANGE[:nbf]
        xd[pairs.unsqueeze(1), b_idx, b_idx, local.unsqueeze(1)] = hr.q
        s = torch._int_mm(xd.view(p_n * nbf, f * s_n), down.qs.view(f * s_n, d_out)).view(p_n, nbf, d_out)
    elif p_n * s_n * f * d_out <= DENSE_EXPERT_MACS:  # one GEMM per block, block-diagonal over experts
        xd = torch.zeros(nbf, p_n, s_n, BLOCK, dtype=torch.int8)
        xd[:, pairs, local] = hr.q.transpose(0, 1)
        s = torch.stack([torch._int_mm(xd[b].view(p_n, s_n * BLOCK), down.qs[b].view(s_n * BLOCK, d_out))
                         for b in range(nbf)], dim=1)
    else:
        y = torch.empty(p_n, d_out)
        for e, a, b in _spans(counts):
            y[a:b] = _epilogue(_block_sums(hr.q[a:b], down.qs[:, e].reshape(f, d_out)), down.d[e], hr.d[a:b])
        return y
    return _epilogue(s, down.d[local], hr.d)


ARANGE = torch.arange(1 << 16)  # index tables sliced instead of made per pass


def _spans(counts: list[int]) -> list[tuple[int, int, int]]:
    out, a = [], 0
    for e, c in enumerate(counts):
        out.append((e, a, a + c))
        a += c
    return out
