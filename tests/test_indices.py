"""engine.ops.indices: the device products' index rows, kept per (size, device) for short passes."""
from __future__ import annotations

import torch

from engine.ops import indices


def test_index_rows_are_the_values_and_kept_for_short_passes() -> None:
    cpu = torch.device("cpu")
    a, z, r = indices.arange(5, cpu), indices.zeros(5, cpu), indices.repeated(3, 2, cpu)
    assert a.tolist() == [0, 1, 2, 3, 4] and z.tolist() == [0] * 5 and r.tolist() == [0, 0, 1, 1, 2, 2]
    assert {t.dtype for t in (a, z, r)} == {torch.long}
    assert indices.arange(5, cpu) is a and indices.zeros(5, cpu) is z and indices.repeated(3, 2, cpu) is r
    assert indices.repeated(3, 1, cpu) is not r and indices.repeated(3, 1, cpu).tolist() == [0, 1, 2]
    long = indices.SMALL + 1  # a prompt chunk's: made per call, not kept
    assert indices.arange(long, cpu) is not indices.arange(long, cpu)
    assert torch.equal(indices.arange(long, cpu), torch.arange(long))
