"""A logit row under a token mask (constrained decoding, engine.constrain): the mask is a bit per vocabulary id, 32 ids a
int32 word (llguidance's layout). The greedy choice among the allowed ids, and the row with the others at -inf: the
native kernels on a CPU row (engine/native/token_mask.c, in the instruction-set form of the backend given, else the
machine's default backend), torch elsewhere."""
from __future__ import annotations

import functools

import numpy as np
import torch

from engine.ops import native
from engine.ops.backend import Backend, default_backend


def _native_row(x: torch.Tensor) -> bool:
    return native.available() and x.is_cpu and x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous() \
        and not x.requires_grad


def mask_bools(bits: torch.Tensor, n: int) -> torch.Tensor:
    """A bool per id of a row of n: does the mask allow it (ids past the mask's words: no)."""
    keep = np.zeros(n, dtype=np.bool_)
    m = min(n, bits.numel() * 32)
    keep[:m] = np.unpackbits(bits.cpu().numpy().view(np.uint8), count=m, bitorder="little").view(np.bool_)
    return torch.from_numpy(keep)


@functools.cache
def _default_level() -> int:
    return default_backend().level


def masked_argmax(x: torch.Tensor, bits: torch.Tensor, backend: Backend | None = None) -> int:
    """The first maximum of the row x over the ids the mask allows (the first NaN among them if any, as argmax on the
    masked row); -1 where it allows none."""
    if _native_row(x) and (backend is None or backend.native):
        return native.masked_argmax(x, bits, _default_level() if backend is None else backend.level)
    keep = mask_bools(bits, x.numel()).to(x.device)
    if not bool(keep.any()):
        return -1
    return int(torch.argmax(torch.where(keep, x, float("-inf"))))


def mask_logits(x: torch.Tensor, bits: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """A copy of the row x with every id the mask does not allow at -inf."""
    if _native_row(x) and (backend is None or backend.native):
        out = x.clone()
        native.mask_row(out, bits, _default_level() if backend is None else backend.level)
        return out
    return torch.where(mask_bools(bits, x.numel()).to(x.device), x, float("-inf"))
