"""Per-row norms in one Triton kernel each: RMSNorm (times its weight, and a gate for the Gated DeltaNet output) and
the L2 norm of the delta rule's queries and keys (times a scale).

Their torch twins are 5 to 8 elementwise and reduction kernels a call, and a decode step makes 3 to 5 of these
calls a layer: on the H200 most of the 35B step's ~4,600 launches were such small kernels
(bench/results/cuda_profile_h200_35b.log). One program per row, the row's sum of squares in float32 over one
block of the row: the same arithmetic in the same order whatever the other rows are, so a verify row keeps a
decode step's bits. Imported only where engine.ops.triton_q is (CUDA, or the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rows(x_ptr, w_ptr, g_ptr, y_ptr, d, eps, post, x_row, g_row, y_row, L2: tl.constexpr,
               HAS_W: tl.constexpr, HAS_G: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BD)
    live = cols < d
    x = tl.load(x_ptr + row * x_row + cols, mask=live, other=0.0)
    ss = tl.sum(x * x, 0)
    if L2:  # ggml_l2_norm: x / max(‖x‖, eps)
        y = x / tl.maximum(tl.sqrt_rn(ss), eps)
    else:  # x · 1/sqrt(mean(x²) + eps)
        y = x * (1.0 / tl.sqrt_rn(ss / d + eps))
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=live, other=0.0)
    if HAS_G:
        y = y * tl.load(g_ptr + row * g_row + cols, mask=live, other=0.0)
    tl.store(y_ptr + row * y_row + cols, y * post, mask=live)


def norm_rows(x: torch.Tensor, w: torch.Tensor | None, gate: torch.Tensor | None, eps: float, l2: bool,
              post: float = 1.0) -> torch.Tensor:
    """x [..., d] float32 normed per row of d (RMS, or L2 with `l2`), times w [d], times gate (x's shape), times
    post: a new tensor of x's shape."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    g2 = None
    if gate is not None:
        g2 = gate.reshape(-1, d)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    n = x2.shape[0]
    if n:
        _norm_rows[(n,)](x2, w if w is not None else x2, g2 if g2 is not None else x2, y, d, eps, post,
                         x2.stride(0), g2.stride(0) if g2 is not None else 0, y.stride(0), L2=l2,
                         HAS_W=w is not None, HAS_G=g2 is not None, BD=triton.next_power_of_2(d))
    return y.view(x.shape)


# The widths CI compiles ahead of time (Qwen3.5/3.6: hidden 2048–5120 in a 4096- or 8192-wide block, 256-wide
# attention heads, 128-wide GDN heads; the small fixtures' 64): (block, L2, weight, gate)
AOT_FORMS = ((8192, False, True, False), (4096, False, True, False), (256, False, True, False),
             (128, False, True, True), (128, True, False, False), (64, False, True, False), (64, True, False, False))


def signatures() -> list[tuple[object, dict[str, str], dict[str, int], str]]:
    sig = {"x_ptr": "*fp32", "w_ptr": "*fp32", "g_ptr": "*fp32", "y_ptr": "*fp32", "d": "i32", "eps": "fp32",
           "post": "fp32", "x_row": "i64", "g_row": "i64", "y_row": "i64", "L2": "constexpr", "HAS_W": "constexpr",
           "HAS_G": "constexpr", "BD": "constexpr"}
    return [(_norm_rows, sig, {"L2": l2, "HAS_W": hw, "HAS_G": hg, "BD": bd},
             f"{'l2' if l2 else 'rms'}{bd}{'w' if hw else ''}{'g' if hg else ''}") for bd, l2, hw, hg in AOT_FORMS]
