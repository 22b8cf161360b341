"""Timing helpers shared by the benchmarks."""
from __future__ import annotations

import time
from typing import Callable


def mean_seconds(fn: Callable[[], object], reps: int) -> float:
    """Mean seconds of `fn` over `reps` calls, after one warm-up call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps
