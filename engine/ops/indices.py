"""Constant index rows for the device products (engine.ops.triton_q's pairs: which matrix and which activation row
each output row takes), made once per (size, device) instead of by a kernel in every call.

On CUDA each fresh `arange` / `zeros` is a kernel of its own: the aranges alone were 6,414 kernels over a 17-token run
of the 35B shape, about 8 % of its launches (bench/results/cuda_profile_h200_35b.log), the zeros beside them. A kept
tensor is made by the first pass of its size, which runs eagerly before any graph of that size is captured, so a
captured pass reads it where it already is. Callers only read them. Passes longer than SMALL rows (prompt chunks)
make theirs per call: their sizes vary and a long pass has few launches per row."""
from __future__ import annotations

import torch

SMALL = 64  # rows: decode steps, verifies, draft passes (and short prompts)

_kept: dict[tuple[str, int, int, torch.device], torch.Tensor] = {}


def _get(kind: str, n: int, k: int, device: torch.device) -> torch.Tensor:
    key = (kind, n, k, device)
    t = _kept.get(key)
    if t is None:
        t = _make(kind, n, k, device)
        if n <= SMALL:
            _kept[key] = t
    return t


def _make(kind: str, n: int, k: int, device: torch.device) -> torch.Tensor:
    if kind == "zeros":
        return torch.zeros(n, dtype=torch.long, device=device)
    rows = torch.arange(n, device=device)
    return rows if k == 1 else rows.repeat_interleave(k)


def arange(n: int, device: torch.device) -> torch.Tensor:
    """0 … n−1 (int64)."""
    return _get("arange", n, 1, device)


def zeros(n: int, device: torch.device) -> torch.Tensor:
    """n zeros (int64): every row from the one matrix of a stack of one."""
    return _get("zeros", n, 1, device)


def repeated(n: int, k: int, device: torch.device) -> torch.Tensor:
    """0 … n−1 each k times (int64): the token of each (token, slot) pair, slots innermost."""
    return _get("repeated", n, k, device)
