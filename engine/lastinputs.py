"""A memo of the last few inputs' results, recognised by identity and version, per thread.

Several products of a layer multiply the same normed x (q/k/v, the GDN projections, the router, the shared
and routed experts), and a MoE layer alternates x and the experts' h: the quantized rows of the last two
inputs are kept so each is quantized once. Identity plus `_version` means an in-place change is a miss;
the thread id keeps the worker thread and the GUI (or a test) from seeing each other's entries.
"""
from __future__ import annotations

import threading
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class LastInputs(Generic[T]):
    def __init__(self, size: int = 2):
        self.size = size
        self._items: list[tuple[int, torch.Tensor, int, T]] = []

    def get(self, x: torch.Tensor) -> T | None:
        me = threading.get_ident()
        for hit in list(self._items):
            if hit[0] == me and hit[1] is x and hit[2] == x._version:
                return hit[3]
        return None

    def put(self, x: torch.Tensor, value: T) -> T:
        self._items[:] = self._items[-(self.size - 1):] + [(threading.get_ident(), x, x._version, value)]
        return value
