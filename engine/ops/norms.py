"""Per-row transforms: RMSNorm (with an optional gate, as the Gated DeltaNet output uses it), the L2 norm of the
delta rule's queries and keys, and RoPE, natively in one call each, in one Triton kernel each on the Triton backend
(the norms: engine/ops/triton_norm.py), or by their torch twins.

The native form sums squares in double as ggml does (engine/native/norm.c); the twins are the plain torch
formulas (differentiable: training runs them). Both are per-row, so a pass over N rows gives each row the bits of a
one-row pass.
"""
from __future__ import annotations

import torch

from engine.ops import native
from engine.ops.attention import _floats
from engine.ops.backend import Backend


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x · 1/sqrt(mean(x²) + eps) · w over the last dim; `w` is the stored GGUF weight (already 1+w)."""
    return x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


def l2_norm_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_l2_norm: x / max(‖x‖, eps)."""
    return x / torch.clamp(x.pow(2).sum(-1, keepdim=True).sqrt(), min=eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, backend: Backend,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., d] with weight w [d]; times `gate` (x's shape: a gate already through its activation)."""
    if _native(backend, x, w, gate):
        return native.norm_rows(x, w, gate, eps, l2=False)
    if _triton(backend, x, w, gate):
        from engine.ops import triton_norm

        return triton_norm.norm_rows(x, w, gate, eps, l2=False)
    y = rms_norm_torch(x, w, eps)
    return y if gate is None else y * gate


def l2_norm(x: torch.Tensor, eps: float, backend: Backend, scale: float = 1.0) -> torch.Tensor:
    """x [..., d] / max(‖x‖, eps) per row, times `scale`."""
    if _native(backend, x):
        return native.norm_rows(x, None, None, eps, l2=True, post=scale)
    if _triton(backend, x):
        from engine.ops import triton_norm

        return triton_norm.norm_rows(x, None, None, eps, l2=True, post=scale)
    y = l2_norm_torch(x, eps)
    return y if scale == 1.0 else y * scale


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """NEOX pairing (i, i + n_rot/2) on dims [0, n_rot) of every head; x: [N, H, D], cos/sin: [N, n_rot/2]."""
    half = n_rot // 2
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c, rest], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, backend: Backend) -> torch.Tensor:
    """x [N, H, D] rotated (NEOX pairing on the first n_rot dims) by the rows cos/sin [N, n_rot/2] of its positions:
    a new tensor."""
    if _native(backend, x, cos, sin):
        return native.rope_neox(x.clone(memory_format=torch.contiguous_format), cos.contiguous(), sin.contiguous(),
                                n_rot)
    return apply_rope_torch(x, cos, sin, n_rot)


def _native(backend: Backend, *ts: torch.Tensor | None) -> bool:
    return backend.native and _floats(*(t for t in ts if t is not None))


def _triton(backend: Backend, *ts: torch.Tensor | None) -> bool:
    """The Triton backend's kernel: float32 rows, not training (the torch twins are the differentiable form)."""
    return backend.kind == "triton" and all(t.dtype == torch.float32 and not t.requires_grad
                                            for t in ts if t is not None)
