"""Element-wise activations between a layer's kernels: natively (kernels.h's silu_f and sigmoid_f, expf), the
expressions engine/native/layer.c computes inside its one-call layer, so both native paths give the same bits; or
the torch twins. Each element is a function of itself alone: batch-invariant in the native form (one scalar
expression per element, whatever the tensor's length)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops import native
from engine.ops.attention import _floats
from engine.ops.backend import Backend


def silu(x: torch.Tensor, backend: Backend) -> torch.Tensor:
    """silu(x): a new tensor."""
    if backend.native and _floats(x):
        return native.silu(x.contiguous())
    return F.silu(x)


def silu_mul(g: torch.Tensor, u: torch.Tensor, backend: Backend) -> torch.Tensor:
    """silu(g) · u (the SwiGLU of a feed-forward): a new tensor."""
    if backend.native and _floats(g, u) and g.shape == u.shape:
        return native.silu_mul(g.clone(memory_format=torch.contiguous_format), u.contiguous())
    return F.silu(g) * u


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, backend: Backend) -> torch.Tensor:
    """x · sigmoid(gate) (gated attention's output gate): a new tensor."""
    if backend.native and _floats(x, gate) and x.shape == gate.shape:
        return native.sigmoid_mul(x.clone(memory_format=torch.contiguous_format), gate.contiguous())
    return x * torch.sigmoid(gate)
