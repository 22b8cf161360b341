"""Whether a model's weights may get anonymous copies in RAM, decided once per load from the memory available.

The weights are a read-only mapping of the file: the kernel can drop their pages and read them again, so a model
larger than RAM still opens and decodes from the page cache (as llama.cpp's mmap does). Derived forms of a weight
(the packed products' copies, VNNI and AVX2, the stacked small projections of `ops.linear_many`, the draft head's
sketch) are anonymous memory, which cannot be dropped: they are made only when the weights, the sequence state and
the copies that come on top of the weights (the sketch) fit in what is available with room to spare. Otherwise the
weights stay mapped and the engine says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import psutil

GIB = 2**30
# Copies need the model and its state to fit with this much of the available memory left for everything else
# (the app, the page cache of other files, a browser).
HEADROOM = 0.10


@dataclass(frozen=True)
class MemoryPlan:
    copies: bool  # derived anonymous copies of weights allowed (packed forms, stacked projections)
    notice: str | None  # what the user should know, None when the model fits


def available_bytes() -> int:
    """RAM the system could give this process now, page cache that can be dropped included (psutil)."""
    return int(psutil.virtual_memory().available)


def plan_memory(name: str, weight_bytes: int, state_bytes: int, available: int, active_bytes: int,
                packs: bool, extra_bytes: int = 0) -> MemoryPlan:
    """The plan for a model whose weights (on the CPU) take `weight_bytes` of its file, with `state_bytes` of KV and
    recurrent state, given `available` bytes; `active_bytes`: the weight bytes one token reads; `packs`: whether
    the backend would otherwise pack weights (what the user gives up is then named); `extra_bytes`: copies made on top
    of the weights where copies are allowed (ops.sketch_bytes)."""
    need = weight_bytes + state_bytes
    if need + extra_bytes <= available * (1 - HEADROOM):
        return MemoryPlan(True, None)
    gib = f"{weight_bytes / GIB:.1f} GiB of weights and {state_bytes / GIB:.1f} GiB of state"
    if need <= available:
        cost = ("no packed copies are made, so decoding may be somewhat slower than with packed weights" if packs
                else "no copies of them are made")
        return MemoryPlan(False, f"{name}: {gib} nearly fill the {available / GIB:.1f} GiB available: the weights "
                                 f"stay mapped from the file so that other programs can still get memory; {cost}")
    return MemoryPlan(False, f"{name}: {gib} are more than the {available / GIB:.1f} GiB available: the model runs "
                             "from the file through the page cache, and each token may read up to "
                             f"{active_bytes / GIB:.1f} GiB of weights from disk; expect decoding at disk speed, "
                             "many times slower than a model that fits in memory")
