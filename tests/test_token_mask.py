"""A logit row under a constrained decoding's token mask (engine.ops.token_mask, engine/native/token_mask.c): the greedy
choice among the allowed ids and the masked row, native on a contiguous CPU float32 row and torch on any other, both
equal to masking the row with a bool per id and taking its first maximum."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import ops
from engine.errors import EngineError, NonFiniteLogitsError
from engine.sampling import Sampler, SamplingConfig


def pack(keep: np.ndarray) -> torch.Tensor:
    """llguidance's layout: bit i % 32 of int32 word i / 32 for id i."""
    words = np.zeros((keep.size + 31) // 32 * 32, dtype=np.bool_)
    words[:keep.size] = keep
    return torch.from_numpy(np.packbits(words, bitorder="little").view(np.int32))


def reference(x: torch.Tensor, keep: np.ndarray) -> tuple[int, torch.Tensor]:
    """The row with every id past the mask or not in it at -inf, and its first maximum (-1 where none is allowed)."""
    k = torch.zeros(x.numel(), dtype=torch.bool)
    k[:min(keep.size, x.numel())] = torch.from_numpy(keep[:x.numel()].copy())
    row = torch.where(k, x.float(), float("-inf"))
    return (int(torch.argmax(row)) if bool(k.any()) else -1), row


def masks(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    dense = rng.random(n) < 0.9
    dense[64:160] = True  # whole words allowed (the kernel's plain loop)
    sparse = np.zeros(n, dtype=np.bool_)
    sparse[rng.choice(n, 3, replace=False)] = True
    return [dense, sparse, rng.random(n) < 0.5, np.zeros(n, dtype=np.bool_), np.ones(n, dtype=np.bool_)]


@pytest.mark.parametrize("n_row, n_mask", [(8192, 8192), (1000, 1000), (1003, 990), (70, 100)])
def test_native_and_torch_forms_match_the_masked_row(n_row: int, n_mask: int) -> None:
    """Rows not a multiple of 32 long, masks shorter than the row (a padded head) and longer: both forms agree with the
    reference, on the index and on every value of the masked row."""
    rng = np.random.default_rng(n_row + n_mask)
    x = torch.from_numpy(rng.standard_normal(n_row).astype(np.float32))
    x[[5, 9, 21, 37]] = x.max() + 1  # ties within a vector, in one lane, across words: the first allowed wins
    for keep in masks(n_mask, rng):
        bits = pack(keep)
        want, row = reference(x, keep)
        strided = torch.stack([x, x], 1)[:, 0]  # not contiguous: the torch form
        for form in (x, strided, x.double()):
            assert ops.masked_argmax(form, bits) == want
            assert torch.equal(ops.mask_logits(form, bits).float(), row)
        for b in ops.available_backends():  # every instruction-set form the machine runs, and torch
            assert ops.masked_argmax(x, bits, b) == want, b
            assert torch.equal(ops.mask_logits(x, bits, b), row), b


def test_a_nan_among_the_allowed_ids_is_the_choice_and_one_outside_is_not() -> None:
    x = torch.arange(200, dtype=torch.float32)
    x[[40, 120]] = float("nan")
    keep = np.ones(200, dtype=np.bool_)
    keep[40] = False
    keep2 = keep.copy()
    keep2[120] = False
    for b in ops.available_backends():
        for form in (x, torch.stack([x, x], 1)[:, 0]):
            assert ops.masked_argmax(form, pack(keep), b) == 120
            assert ops.masked_argmax(form, pack(keep2), b) == 199


class FixedMask:
    def __init__(self, keep: np.ndarray):
        self.keep = keep

    def allows(self, token: int) -> bool:
        return bool(self.keep[token])

    def bits(self) -> torch.Tensor:
        return pack(self.keep)


def test_greedy_under_a_mask_takes_the_best_allowed_token_or_says_why_not() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=g)
    keep = np.zeros(4096, dtype=np.bool_)
    keep[[7, 300, 2000]] = True
    greedy = Sampler(SamplingConfig())
    assert greedy.sample(x, [], FixedMask(keep)) == reference(x, keep)[0]
    keep[int(torch.argmax(x))] = True  # the row's own choice allowed: taken without the mask's words
    assert greedy.sample(x, [], FixedMask(keep)) == int(torch.argmax(x))
    with pytest.raises(EngineError, match="allows no token"):
        greedy.sample(x, [], FixedMask(np.zeros(4096, dtype=np.bool_)))
    keep[int(torch.argmax(x))] = False
    bad = x.clone()
    bad[[7, 300, 2000]] = float("-inf")  # nothing finite among the allowed: no token named
    with pytest.raises(NonFiniteLogitsError):
        greedy.sample(bad, [], FixedMask(keep))
