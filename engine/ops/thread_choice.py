"""How many threads a fused pass runs on, chosen from the passes' own measured times.

Two threads are not always faster than one. A 2-core VM's host places its two cores now on one memory path, now on
two, and the placement changes every few seconds (bench/step_profile.py records it); where the cores sit apart, a
hand-over between them costs several times more. Measured on the embedded model's decode step, alternating within
one process: ~190 µs on 2 threads and ~235 on 1 in one placement, ~315 on 2 and ~240 on 1 in the other. A desktop
shares its cores with a browser, and a model whose step is all hand-overs may be best on fewer threads than it has.

So each pass size keeps a count from the ladder T, T/2, …, 1 (T: the threads the backend has), and every `every`
passes runs a probe of PROBE passes on a neighbouring count (lower and higher in turn). The probe's first pass is
dropped (the caches of a thread that joins or leaves are cold for the work it takes or hands back); the median of
the rest against the median of the last passes on the current count decides, and a pass clearly slower than that
(WORSE) ends the probe at once, so a probe of a bad count costs about two passes. A probe that confirms the current
count doubles the interval up to MAX_EVERY passes, a switch starts it again at EVERY. Threads change no bits (every
native pass gives the same bits on any count), so the choice is free to follow the timings.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

EVERY = 64  # passes between probes after a switch
MAX_EVERY = 1024  # … doubled on each confirmation up to this
PROBE = 4  # passes a probe runs on the other count, the first of them not counted
RECENT = 8  # the current count's last passes, its side of the comparison
MARGIN = 0.95  # a probe switches where its median is below this share of the current count's
WORSE = 1.25  # a counted probe pass over this share of the current count's median ends the probe there


def ladder(threads: int) -> list[int]:
    """The counts a choice moves between: threads, halved down to 1 (ascending)."""
    counts, t = {threads}, threads
    while t > 1:
        t //= 2
        counts.add(max(t, 1))
    return sorted(counts)


@dataclass
class _Size:
    """One pass size's choice."""

    threads: int  # the backend's count, the ladder's top
    count: int  # the current choice
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    every: int = EVERY
    since: int = 0  # passes on the current count since the last probe
    probe: int | None = None  # the count a running probe tries
    probe_ns: list[int] = field(default_factory=list)
    probes: int = 0  # probes so far: where the count has two neighbours, they are tried in turn


class ThreadChoice:
    """Per pass size: the thread count for the next pass (`pick`), and what a pass took on it (`observe`)."""

    def __init__(self) -> None:
        self._sizes: dict[int, _Size] = {}
        self.switches = 0  # choices changed (tests, logs)

    def current(self, n: int) -> int | None:
        s = self._sizes.get(n)
        return s.count if s is not None else None

    def pick(self, n: int, threads: int) -> int:
        s = self._sizes.get(n)
        if s is None or s.threads != threads:  # a new size, or the backend's count changed: start from all of them
            s = self._sizes[n] = _Size(threads, threads)
        if threads <= 1:
            return 1
        if s.probe is None and s.since >= s.every and len(s.recent) >= 3:
            counts = ladder(threads)
            i = counts.index(s.count)
            near = [counts[j] for j in (i - 1, i + 1) if 0 <= j < len(counts)]  # lower first
            s.probe, s.probe_ns = near[s.probes % len(near)], []
            s.probes += 1
        return s.probe if s.probe is not None else s.count

    def observe(self, n: int, threads: int, ns: int) -> None:
        """A pass of size n ran on `threads` threads in ns nanoseconds (the count `pick` gave)."""
        s = self._sizes.get(n)
        if s is None:
            return
        if s.probe is None:
            s.recent.append(ns)
            s.since += 1
            return
        s.probe_ns.append(ns)
        now = statistics.median(s.recent)
        worse = len(s.probe_ns) > 1 and ns > WORSE * now
        if len(s.probe_ns) < PROBE and not worse:
            return
        if not worse and statistics.median(s.probe_ns[1:]) < MARGIN * now:
            s.count, s.every = s.probe, EVERY
            s.recent = deque(s.probe_ns[1:], maxlen=RECENT)
            self.switches += 1
        else:
            s.every = min(2 * s.every, MAX_EVERY)
        s.probe, s.since = None, 0
