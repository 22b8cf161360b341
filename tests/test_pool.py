"""The kernels' thread pool (engine/native/pool.c): every item of a call runs exactly once, whatever the number of
threads (more than the cores, more than the items), the segment split and stealing, back-to-back calls, and a busy
process holding a core (solo mode); which thread runs an item never changes its bits."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine import ops
from engine.storage.qtensor import QTensor
from engine.storage.quantize import random_blocks
from tests.conftest import backend_params

NATIVE = backend_params(native_only=True)


def _linear(rows: int, backend: ops.Backend) -> ops.Linear:
    w = QTensor(random_blocks((rows, 256), T.Q8_0, np.random.default_rng(rows), 1 / 16), T.Q8_0, (rows, 256))
    return ops.bind(w, backend)


@pytest.mark.parametrize("backend", NATIVE)
def test_every_item_once_for_any_thread_count(backend: ops.Backend) -> None:
    """16-row items: 1, 3, 37 and 63 of them (fewer than the threads, not a multiple of them), on 1 to 8 threads,
    many calls in a row: each output row is written by its item and only by it, with the one-thread bits."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for rows in (16, 48, 16 * 37, 1000):
        ref = ops.linear(x.clone(), _linear(rows, replace(backend, threads=1)))
        for threads in (2, 3, 5, 8):
            lin = _linear(rows, replace(backend, threads=threads))
            for _ in range(50):
                y = torch.full((3, rows), float("nan"))
                y[:] = ops.linear(x.clone(), lin)
                assert torch.equal(y, ref), (rows, threads)


@pytest.mark.parametrize("backend", NATIVE[:1])
def test_calls_finish_with_a_core_taken(backend: ops.Backend) -> None:
    """With a busy process on the machine, 2-thread calls give the same bits and each call finishes in bounded
    time (the caller claims what is left; a stalled worker puts the pool in solo mode instead of every call waiting
    for it)."""
    lin1, lin2 = _linear(4096, replace(backend, threads=1)), _linear(4096, replace(backend, threads=2))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1))
    ref = ops.linear(x.clone(), lin1)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        worst = 0.0
        for _ in range(2000):
            t0 = time.perf_counter()
            y = ops.linear(x.clone(), lin2)
            worst = max(worst, time.perf_counter() - t0)
            assert torch.equal(y, ref)
    finally:
        spin.kill()
        spin.wait()
    # one call is ~0.1 ms of work; a scheduler slice is a few ms. Without the caller finishing alone, calls waited
    # for the preempted worker's slice again and again; a handful of slices is the bound for the worst one.
    assert worst < 0.25, worst


_SOLO_RULE = """
from engine.ops import native
ms = 1_000_000
t = 1000 * ms
assert native.pool_after_call(t, t + 1 * ms, t + 2 * ms, 0) == 0  # a good call
assert native.pool_after_call(t, t + 1 * ms, t + 4 * ms, 0) == 0  # the caller waited 3 ms: a one-off
t += 50 * ms
assert native.pool_after_call(t, t + 1 * ms, t + 4 * ms, 0) == t + 4 * ms + 20 * ms  # the second: solo
t += 30 * ms
assert native.pool_after_call(t, t + 1 * ms, t + 2 * ms, 2 * ms) == t + 2 * ms + 40 * ms  # caller off its core
t += 50 * ms
assert native.pool_after_call(t, t + 1 * ms, t + 2 * ms, 0) == 0  # a good call: off, and back to 20 ms
t += 1000 * ms
assert native.pool_after_call(t, t + 1 * ms, t + 4 * ms, 0) == 0  # long after: a one-off again
assert native.pool_after_call(t, t + 1 * ms, t + 5 * ms, 0) == t + 5 * ms + 20 * ms
assert native.pool_after_call(t, t + 1 * ms, t + 2 * ms, 0) == 0
print("ok")
"""


def test_one_stall_alone_does_not_put_the_pool_on_one_thread() -> None:
    """Solo mode's rule (pool.c after_call), fed call timings in a fresh process: one stall (a worker preempted for
    3 ms, or the caller off its core) is a one-off and changes nothing; a second within 200 ms starts 20 ms of solo
    mode, a third right after it 40 ms; a call without a stall ends it; a stall long after the last is again a
    one-off."""
    r = subprocess.run([sys.executable, "-c", _SOLO_RULE], capture_output=True, text=True, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_engine_makes_torch_threads_wait_passively_without_leaking_the_setting() -> None:
    """Imported before torch, the engine has libgomp load with OMP_WAIT_POLICY=PASSIVE (spinning torch threads took
    the pool's cores) and removes the variable again, so child processes get the environment they were given; a
    policy the user set is left alone."""
    code = "import os, engine, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "None"
    # libgomp shows what it read as it loads (with torch): spinning off, where by default it spins 300000 rounds
    shown = subprocess.run([sys.executable, "-c", "import engine, torch"], capture_output=True, text=True,
                           env={**env, "OMP_DISPLAY_ENV": "verbose"}, check=True).stderr
    assert "GOMP_SPINCOUNT = '0'" in shown, shown
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, check=True)
    assert out.stdout.strip() == "ACTIVE"
