"""Causal attention over the KV cache in one Triton kernel, reading each query's position from the device.

A captured decode step (engine.models.step_graph) cannot hand attention its length from the host: the same graph
runs at every position. Here query row i reads its position from positions[i] and walks keys 0 … positions[i] in
fixed blocks of BLOCK_T, with a running maximum and sum (online softmax) in float32. A (row, head) program does
the same arithmetic in the same order whatever the other rows are: a verify pass gives each row the bits of a
decode step (greedy MTP identity on CUDA). Imported only where engine.ops.triton_q is (CUDA, or the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # keys per iteration of a program's walk


@triton.jit
def _attention_rows(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, scale, q_row, q_head, k_row, v_row, o_row,
                    D: tl.constexpr, DV: tl.constexpr, GROUP: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                    BT: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    length = tl.load(pos_ptr + row).to(tl.int32) + 1  # keys this row sees
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    t = tl.arange(0, BT)
    q = tl.load(q_ptr + row * q_row + h * q_head + d, mask=d < D, other=0.0)
    m = tl.max(tl.full([BT], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BT], tl.float32), 0)
    acc = tl.zeros([BDV], tl.float32)
    for start in range(0, length, BT):
        ts = start + t
        seen = ts < length
        k = tl.load(k_ptr + ts[:, None] * k_row + kvh * D + d[None, :], mask=seen[:, None] & (d[None, :] < D),
                    other=0.0)
        s = tl.where(seen, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        total = total * alpha + tl.sum(p, 0)
        v = tl.load(v_ptr + ts[:, None] * v_row + kvh * DV + dv[None, :], mask=seen[:, None] & (dv[None, :] < DV),
                    other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    tl.store(o_ptr + row * o_row + h * DV + dv, acc / total, mask=dv < DV)


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Queries q [n, H, D] at positions [n] (int64, on q's device) over the cache rows k [n_ctx, H_kv, D],
    v [n_ctx, H_kv, D_v] (float32, contiguous; head h reads KV head h // (H / H_kv)): out [n, H·D_v]."""
    n, n_head, d = q.shape
    n_kv, dv = v.shape[1], v.shape[2]
    qc = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(n, n_head * dv, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    _attention_rows[(n, n_head)](qc, k, v, positions, out, scale, qc.stride(0), qc.stride(1), k.stride(0),
                                 v.stride(0), out.stride(0), D=d, DV=dv, GROUP=n_head // n_kv,
                                 BD=triton.next_power_of_2(d), BDV=triton.next_power_of_2(dv), BT=BLOCK_T)
    return out


# The shapes CI compiles ahead of time: Qwen3.5/3.6 heads (256 wide; 8 or 16 query heads per KV head at the
# sizes shipped) and the small fixtures' 64-wide heads.
AOT_SHAPES = ((256, 256, 8), (256, 256, 16), (64, 64, 2))


def signatures() -> list[tuple[object, dict[str, str], dict[str, int], str]]:
    sig = {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "pos_ptr": "*i64", "o_ptr": "*fp32", "scale": "fp32",
           "q_row": "i64", "q_head": "i64", "k_row": "i64", "v_row": "i64", "o_row": "i64", "D": "constexpr",
           "DV": "constexpr", "GROUP": "constexpr", "BD": "constexpr", "BDV": "constexpr", "BT": "constexpr"}
    return [(_attention_rows, sig, {"D": d, "DV": dv, "GROUP": g, "BD": triton.next_power_of_2(d),
                                    "BDV": triton.next_power_of_2(dv), "BT": BLOCK_T}, f"D{d}xG{g}")
            for d, dv, g in AOT_SHAPES]
