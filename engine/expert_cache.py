"""GPU-resident cache of routed experts for layers whose experts live on the CPU.

Per layer, a fixed number of slots on the accelerator holds the quantized blocks of recently used
experts (still quantized: a slot is the expert's gate/up/down bytes). Replacement is SLRU: a new expert
enters the probationary segment; one used again while cached moves to the protected segment (80 % of the
slots), whose overflow falls back to the probationary MRU end; the victim is the probationary LRU. One
burst of once-used experts (a long prompt) therefore cannot flush the experts every token keeps using.

Fills copy from pinned host memory with non_blocking copies (asynchronous on CUDA). Experts that are
routed in the current pass are pinned for it and never evicted mid-pass. On the CPU (tests), the "device"
slots are ordinary CPU tensors, so the same bookkeeping and copies run without a GPU. A layer's bound experts
use it through engine.ops.experts_bound.CachedExperts, which runs the hits from the slots and the misses by the
experts it wraps.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.storage.qtensor import QTensor


class SLRU:
    """Keys → slot numbers with segmented-LRU replacement (pure bookkeeping, no tensors)."""

    def __init__(self, capacity: int, protected_fraction: float = 0.8):
        self.capacity = capacity
        self.protected_cap = int(capacity * protected_fraction) if capacity > 1 else 0
        self.probation: OrderedDict[int, int] = OrderedDict()  # key → slot, LRU first
        self.protected: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, key: int) -> bool:
        return key in self.probation or key in self.protected

    def get(self, key: int) -> int | None:
        """The key's slot, counting a use (probation → protected), or None."""
        if key in self.protected:
            self.protected.move_to_end(key)
            return self.protected[key]
        slot = self.probation.pop(key, None)
        if slot is None:
            return None
        self.protected[key] = slot
        if len(self.protected) > self.protected_cap:  # demote the protected LRU to probation's MRU end
            old, old_slot = self.protected.popitem(last=False)
            self.probation[old] = old_slot
        return slot

    def put(self, key: int, pinned: set[int] | frozenset[int] = frozenset()) -> tuple[int, int | None] | None:
        """Admit `key` (not cached): (its slot, the evicted key or None), or None when every slot holds a
        pinned key."""
        if self.capacity == 0:
            return None
        if self.free:
            slot = self.free.pop()
            self.probation[key] = slot
            return slot, None
        for seg in (self.probation, self.protected):
            victim = next((k for k in seg if k not in pinned), None)
            if victim is not None:
                slot = seg.pop(victim)
                self.probation[key] = slot
                return slot, victim
        return None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_moved: int = 0

    def as_dict(self) -> dict:
        n = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "bytes_moved": self.bytes_moved, "hit_rate": self.hits / n if n else 0.0}


class ExpertCache:
    """One layer's cache: `capacity` slots on `device` for the experts of host tensors gate/up/down."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor, capacity: int, device: torch.device,
                 miss_policy: str = "load"):
        self.n_expert = gate.shape[0]
        self.device = device
        self.miss_policy = miss_policy
        self.host = []
        self.slots = []
        self.expert_bytes = 0
        for w in (gate, up, down):
            raw = w.raw.view(self.n_expert, -1)
            if device.type == "cuda":
                raw = raw.pin_memory()  # asynchronous host → device copies need page-locked memory
            self.host.append(raw)
            self.slots.append(torch.empty(capacity, raw.shape[1], dtype=torch.uint8, device=device))
            self.expert_bytes += raw.shape[1]
        self.meta = [(w.qtype, (w.n_rows // self.n_expert, w.n_cols)) for w in (gate, up, down)]
        self.lru = SLRU(capacity)
        self.stats = CacheStats()
        self.occupancy_peak = 0

    @property
    def capacity(self) -> int:
        return self.lru.capacity

    def lookup(self, experts: list[int]) -> tuple[dict[int, int], list[int]]:
        """Split the pass's experts into hits {expert: slot} and misses (counted in the stats)."""
        hits: dict[int, int] = {}
        misses: list[int] = []
        for e in experts:
            slot = self.lru.get(e)
            if slot is None:
                misses.append(e)
            else:
                hits[e] = slot
        self.stats.hits += len(hits)
        self.stats.misses += len(misses)
        return hits, misses

    def load(self, experts: list[int], pinned: set[int]) -> dict[int, int]:
        """Copy experts into slots (evicting unpinned ones); returns {expert: slot} of those admitted."""
        placed: dict[int, int] = {}
        for e in experts:
            got = self.lru.put(e, pinned)
            if got is None:
                continue
            slot, evicted = got
            if evicted is not None:
                self.stats.evictions += 1
            for host, dev in zip(self.host, self.slots):
                dev[slot].copy_(host[e], non_blocking=True)
            self.stats.bytes_moved += self.expert_bytes
            placed[e] = slot
        self.occupancy_peak = max(self.occupancy_peak, len(self.lru))
        return placed

    def weights(self, slots: list[int]) -> tuple[QTensor, QTensor, QTensor]:
        """The cached experts at `slots` as quantized [U·rows, cols] tensors on the device."""
        sel = torch.tensor(slots, dtype=torch.long, device=self.device)
        out = []
        for dev, (qtype, (rows, cols)) in zip(self.slots, self.meta):
            raw = dev.index_select(0, sel).view(len(slots) * rows, -1)
            out.append(QTensor(raw, qtype, (len(slots) * rows, cols)))
        return out[0], out[1], out[2]
