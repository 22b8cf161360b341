"""Where the time of one decode step goes: native kernels, torch ops around them, Python, idle threads.

    python bench/step_profile.py [--threads 2] [--reps 10] [--prof-reps 3] [--models embedded,mid]
                                 [--out bench/results/step_profile.json]

For each model (the embedded default model, resources/models/*.gguf, and the mid-size synthetic MoE of
bench/synthetic.py) and each case (N = 1: one decode step; N = 4: one pass over 4 tokens as a speculative verify,
GDN states captured), the cache is rewound to the same 64-token context before every pass (tests.fixtures
snapshot/restore, outside the timed region), as bench/verify.py does. Three runs of the same pass:

* plain: a model built on `ops.default_backend()` with no observer and no profiler; `--reps` passes, best and
  median wall time. The same passes give the thread idle share: with T threads (`--threads`, torch's intra-op
  count, which the native calls use too) idle = T × wall − process CPU time (time.process_time, all threads),
  summed over the passes, as a share of T × wall. Caveat: threads that spin-wait between ops count as busy (the
  kernels' pool workers spin briefly before they sleep, engine/native/pool.c; torch's OpenMP threads likewise, with
  OMP_WAIT_POLICY / GOMP_SPINCOUNT recorded). On a loaded
  machine a thread waiting for a core is off-CPU too: the time the process's threads spent runnable but waiting
  (/proc/self/task/*/schedstat, where the kernel keeps it) is reported as `runqueue_wait_share` of T × wall, and
  `sleeping_share` = idle − that wait is the engine's own idleness (threads asleep, e.g. OpenMP workers while
  Python or a one-thread op runs). The load average at start and end is recorded.
* observed: a second copy of the model built on the same backend `.with_observer(cb)`; every engine op (linear,
  linear_many, moe_experts, attention, delta_rule) reports an OpEvent: its wall seconds and the weight bytes it
  read. Their sum is (1) the time inside native kernels / engine ops (per op name too), and the bytes give the
  achieved weight bandwidth. Plain and observed passes alternate, so machine drift hits both alike.
* profiled: the observed model under torch.profiler (CPU activities only, `--prof-reps` passes, each inside a
  record_function range). The observer drops a zero-length record_function marker right after each op, so each
  op's interval is known on the profiler's clock: it ends at the marker's time and starts OpEvent.seconds before
  it (the perf_counter → profiler clock offset is the median over all markers of marker time − perf_counter read
  just before it, so the observer's own delay is not taken as op time). (2) the time of torch ops outside the
  engine ops is the sum of the *self* CPU time of every profiler event (aten ops; our own ranges excluded) whose
  midpoint lies in the pass but outside every op interval; self times never count a nested op twice, and torch
  ops run inside an engine op (output buffers, activation quantization in torch, ...) belong to (1) (reported
  apart as `torch_inside_ops_s`). The `aten::_unique2` the observer itself runs before each moe_experts (to count
  distinct experts) is instrumentation: it is reported as `observer_unique_s` and left out of (2). (3) Python is
  the rest: pass wall − (1) − (2) − observer_unique (on the profiled pass it includes the profiler's per-op
  bookkeeping outside self times).

Instrumentation inflates time (observer callbacks, the profiler's per-op records), so the reported `split` is scaled
to the plain median pass time P: kernel = median kernel seconds of the observed passes (the observer adds a Python
callback per op but does not slow the op itself), capped at P; the rest, P − kernel, is divided between torch ops
outside and Python in the ratio the profiled passes measured (median over passes of torch_out / (torch_out +
python)). `split_uniform` gives the other plain reading: the profiled pass's own shares times P. Both, the raw
per-run numbers and the overhead of each instrumentation (median pass time over plain's) are in the JSON.

Bandwidth: the machine's read bandwidth is measured here with torch.sum over a `--bw-mib` (≥ 512) MiB float32
buffer with T threads (and with 1), best of `--bw-reps`, GB/s = 1e9 bytes/s; the pass's achieved weight
bandwidth is its weight bytes (observer) over the plain median wall time, over the observed kernel time, and over
the time of the ops that read weights (linear, linear_many, moe_experts). A small model's weights may sit in the
CPU caches, so its achieved figure can exceed the DRAM read bandwidth.
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402,F401  (before torch, as the app and the CLI: it sets torch's OpenMP wait policy)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from bench.decode import git_info  # noqa: E402
from bench.synthetic import MID, cached  # noqa: E402
from engine import ops  # noqa: E402
from engine.models.build import load_model  # noqa: E402
from engine.storage.modelfile import default_model_path, open_model  # noqa: E402
from engine.storage.pages import huge_empty  # noqa: E402
from tests.fixtures import restore, snapshot  # noqa: E402

N_CTX = 1200
CONTEXT = 64
# "layer": a whole decoder layer in one native call (ops.fuse_layer); its seconds include the recurrence/attention
WEIGHT_OPS = ("linear", "linear_many", "moe_experts", "layer")
MARK = "foretell_op_"
STEP = "foretell_step_"
FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
         "avx512_bf16", "amx_tile")


# --- the machine -----------------------------------------------------------------------------------

def cpu_info() -> dict:
    model, flags, cache = platform.processor() or platform.machine(), set(), None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key, val = key.strip(), val.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = val
            elif key == "flags" and not flags:
                flags = set(val.split())
            elif key == "cache size" and cache is None:
                cache = val
    except OSError:
        pass
    return {"model": model, "flags": {f: f in flags for f in FLAGS}, "cache_size": cache,
            "logical_cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


class ReadBandwidth:
    """GB/s of torch.sum over a `mib` MiB float32 buffer in huge pages (pages touched before timing), best and median
    of reps.
    Random values: a buffer of ones, every page alike, read at 74 GB/s on a 2-core VM whose memory gives 45 (the
    host merges identical pages). The same VM measured 45 and 63-75 GB/s on 2 threads minutes apart (where the
    host places its two cores), so each case measures it again before and after its passes."""

    def __init__(self, mib: int, reps: int):
        self.mib, self.reps = mib, reps
        # In transparent huge pages, as the packed weights are (engine.storage.pages.huge_empty): the machine's best
        self.buf = huge_empty(mib << 20).view(torch.float32).uniform_(generator=torch.Generator().manual_seed(0))

    def __call__(self, threads: int) -> dict:
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        self.buf.sum()  # warm-up
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            self.buf.sum()
            times.append(time.perf_counter() - t0)
        torch.set_num_threads(prev)
        nbytes = self.buf.numel() * 4
        return {"threads": threads, "buffer_mib": self.mib, "reps": self.reps, "best_gb_s": nbytes / min(times) / 1e9,
                "median_gb_s": nbytes / statistics.median(times) / 1e9}


# --- the observer ----------------------------------------------------------------------------------

class Recorder:
    """Backend observer: keeps every OpEvent; with `mark`, also drops a zero-length profiler range after each op
    and the perf_counter time just before it (to put the op's interval on the profiler's clock)."""

    def __init__(self) -> None:
        self.events: list[ops.OpEvent] = []
        self.ends: list[float] = []  # perf_counter when the observer was called (≈ the op's end)
        self.marks: list[float] = []  # perf_counter just before the marker
        self.mark = False

    def __call__(self, e: ops.OpEvent) -> None:
        t_end = time.perf_counter()
        self.events.append(e)
        self.ends.append(t_end)
        if self.mark:
            i = len(self.events) - 1
            self.marks.append(time.perf_counter())
            with record_function(f"{MARK}{i}"):
                pass

    def reset(self) -> None:
        self.events, self.ends, self.marks = [], [], []


def sched_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a core (/proc/self/task/*/schedstat,
    second field); None where the kernel does not keep it."""
    total, seen = 0, False
    for t in glob.glob("/proc/self/task/*/schedstat"):
        try:
            total += int(open(t).read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9 if seen else None


def op_table(events: list[ops.OpEvent]) -> dict:
    out: dict = {}
    for e in events:
        d = out.setdefault(e.op, {"calls": 0, "seconds": 0.0, "weight_bytes": 0})
        d["calls"] += 1
        d["seconds"] += e.seconds
        d["weight_bytes"] += e.nbytes
    return out


# --- the passes ------------------------------------------------------------------------------------

class Runner:
    """A model, its cache at the context, and one pass of n tokens from it."""

    def __init__(self, path: Path, backend: ops.Backend, context: list[int], draft: list[int]):
        self.model, self.backend = load_model(open_model(path), n_ctx=N_CTX, backend=backend), backend
        self.cache = self.model.new_cache(N_CTX)
        self.model.forward(context, self.cache, logit_rows="none")
        self.snap, self.pos, self.draft = snapshot(self.cache), len(context), draft

    def reset(self) -> None:
        restore(self.cache, self.snap, self.pos)

    def run(self, n: int) -> None:
        self.model.forward(self.draft[:n], self.cache, logit_rows="all", capture=n > 1)


def plain_and_observed(plain: Runner, observed: Runner, rec: Recorder, n: int, reps: int, threads: int) -> dict:
    """`reps` plain passes and `reps` observed ones, alternating; CPU time of the plain ones for the idle share."""
    for r in (plain, observed):  # warm-up
        r.reset()
        r.run(n)
    walls, cpus, waits, o_walls, o_kernel, o_weight_s, o_bytes, o_ops = [], [], [], [], [], [], [], []
    for _ in range(reps):
        plain.reset()
        w0 = sched_wait_s()
        c0, t0 = time.process_time(), time.perf_counter()
        plain.run(n)
        t1, c1 = time.perf_counter(), time.process_time()
        w1 = sched_wait_s()
        walls.append(t1 - t0)
        cpus.append(c1 - c0)
        if w0 is not None and w1 is not None:
            waits.append(w1 - w0)

        observed.reset()
        rec.reset()
        t0 = time.perf_counter()
        observed.run(n)
        o_walls.append(time.perf_counter() - t0)
        o_kernel.append(sum(e.seconds for e in rec.events))
        o_weight_s.append(sum(e.seconds for e in rec.events if e.op in WEIGHT_OPS))
        o_bytes.append(sum(e.nbytes for e in rec.events))
        o_ops.append(op_table(rec.events))
    wall_sum, cpu_sum = sum(walls), sum(cpus)
    wait = sum(waits) if len(waits) == reps else None
    ops_mean: dict = {}
    for name in o_ops[0]:
        ops_mean[name] = {"calls": o_ops[0][name]["calls"],
                          "seconds": statistics.median(t[name]["seconds"] for t in o_ops),
                          "weight_bytes": o_ops[0][name]["weight_bytes"]}
    return {
        "plain": {"reps": reps, "best_s": min(walls), "median_s": statistics.median(walls),
                  "mean_s": wall_sum / reps, "cpu_s_per_pass": cpu_sum / reps},
        "threads_idle": {"threads": threads, "wall_s_total": wall_sum, "cpu_s_total": cpu_sum,
                         "idle_s_total": threads * wall_sum - cpu_sum,
                         "idle_share": (threads * wall_sum - cpu_sum) / (threads * wall_sum),
                         "cpu_per_wall": cpu_sum / wall_sum,
                         # of the idle share: threads runnable but waiting for a core (a busy machine), and the
                         # rest (threads asleep or blocked: the engine's own idleness)
                         "runqueue_wait_share": None if wait is None else wait / (threads * wall_sum),
                         "sleeping_share": None if wait is None else
                         (threads * wall_sum - cpu_sum - wait) / (threads * wall_sum)},
        "observed": {"reps": reps, "median_s": statistics.median(o_walls), "best_s": min(o_walls),
                     "kernel_s": statistics.median(o_kernel), "weight_ops_s": statistics.median(o_weight_s),
                     "weight_bytes": statistics.median(o_bytes), "ops": ops_mean},
    }


def profiled(observed: Runner, rec: Recorder, n: int, reps: int) -> dict:
    """Passes of the observed model under torch.profiler: per pass, kernel (observer), torch ops outside the
    engine ops (self CPU time), Python (the rest)."""
    observed.reset()
    observed.run(n)  # warm-up
    rec.reset()
    rec.mark = True
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(reps):
            observed.reset()
            with record_function(f"{STEP}{k}"):
                observed.run(n)
    rec.mark = False
    evs = list(prof.events())

    steps: dict[int, tuple[float, float]] = {}
    marks: dict[int, float] = {}
    others = []
    for e in evs:
        name = e.name
        if name.startswith(STEP):
            steps[int(name[len(STEP):])] = (e.time_range.start, e.time_range.end)
        elif name.startswith(MARK):
            marks[int(name[len(MARK):])] = e.time_range.start
        else:
            others.append(e)
    if len(marks) != len(rec.events):
        raise RuntimeError(f"{len(marks)} markers for {len(rec.events)} ops: the profiler lost some")
    # perf_counter → profiler clock (µs)
    offset = statistics.median(marks[i] - rec.marks[i] * 1e6 for i in marks)
    # op intervals on the profiler clock, by start
    iv = sorted(((rec.ends[i] - e.seconds) * 1e6 + offset, rec.ends[i] * 1e6 + offset, i)
                for i, e in enumerate(rec.events))
    iv_starts = [s for s, _, _ in iv]
    step_list = sorted((s, e, k) for k, (s, e) in steps.items())
    step_starts = [s for s, _, _ in step_list]

    per = {k: {"torch_out_us": 0.0, "torch_in_us": 0.0, "unique_us": 0.0, "torch_out_events": 0,
               "kernel_s": 0.0, "ops": 0} for k in steps}
    # observer events → pass
    for (s, e_, i) in iv:
        j = bisect.bisect_right(step_starts, s) - 1
        if j >= 0 and s < step_list[j][1]:
            p = per[step_list[j][2]]
            p["kernel_s"] += rec.events[i].seconds
            p["ops"] += 1
    for e in others:
        mid = 0.5 * (e.time_range.start + e.time_range.end)
        j = bisect.bisect_right(step_starts, mid) - 1
        if j < 0 or mid >= step_list[j][1]:
            continue  # outside every pass (the cache rewinds)
        p = per[step_list[j][2]]
        m = bisect.bisect_right(iv_starts, mid) - 1
        inside = m >= 0 and mid < iv[m][1]
        self_us = e.self_cpu_time_total
        if inside:
            p["torch_in_us"] += self_us
        elif e.name in ("aten::_unique2", "aten::unique", "aten::_unique") or \
                (e.cpu_parent is not None and e.cpu_parent.name in ("aten::_unique2", "aten::unique")):
            p["unique_us"] += self_us
        else:
            p["torch_out_us"] += self_us
            p["torch_out_events"] += 1
    rows = []
    for k, (s, e_) in sorted(steps.items()):
        p = per[k]
        wall = (e_ - s) / 1e6
        torch_out, unique = p["torch_out_us"] / 1e6, p["unique_us"] / 1e6
        python = wall - p["kernel_s"] - torch_out - unique
        rows.append({"wall_s": wall, "kernel_s": p["kernel_s"], "torch_outside_s": torch_out,
                     "observer_unique_s": unique, "python_s": python, "torch_inside_ops_s": p["torch_in_us"] / 1e6,
                     "engine_ops": p["ops"], "torch_events_outside": p["torch_out_events"]})
    med = sorted(rows, key=lambda r: r["wall_s"])[len(rows) // 2]  # the median pass, whose parts add up
    ratio = statistics.median(r["torch_outside_s"] / max(r["torch_outside_s"] + r["python_s"], 1e-12) for r in rows)
    return {"reps": reps, "median_pass": med, "torch_share_of_non_kernel": ratio,
            "shares": {"kernel": med["kernel_s"] / med["wall_s"], "torch_outside": med["torch_outside_s"] / med["wall_s"],
                       "python": (med["python_s"] + med["observer_unique_s"]) / med["wall_s"]}}


def native_sections(plain: Runner, n: int, reps: int) -> dict | None:
    """`reps` plain passes with layer.c's section clock on (engine.ops.native.trace_start): per pass, the time of
    each section of the fused layers and the weight bytes it read; outside_layers: the rest of the pass (embedding,
    output head, Python between the layer calls). None where the layers do not run natively."""
    from engine.ops import native
    if not native.available() or not plain.backend.native:
        return None
    walls = []
    native.trace_start()
    for _ in range(reps):
        plain.reset()
        t0 = time.perf_counter()
        plain.run(n)
        walls.append(time.perf_counter() - t0)
    sec = native.trace_stop()
    wall = sum(walls) / reps
    out = {name: {"ms_per_pass": 1e3 * s.seconds / reps, "share_of_pass": s.seconds / reps / wall,
                  "marks_per_pass": s.marks / reps, "weight_mb_per_pass": s.weight_bytes / reps / 1e6,
                  "gb_s": s.weight_bytes / s.seconds / 1e9 if s.seconds else None} for name, s in sec.items()}
    inside = sum(s.seconds for k, s in sec.items() if k not in ("pool_wait", "prefetch")) / reps
    return {"reps": reps, "mean_pass_ms": 1e3 * wall, "sections": out, "outside_layers_ms": 1e3 * (wall - inside)}


def case(plain: Runner, observed: Runner, rec: Recorder, n: int, args: argparse.Namespace,
         probe: ReadBandwidth) -> dict:
    before = probe(args.threads)["best_gb_s"]
    one_before = probe(1)["best_gb_s"] if args.threads > 1 else None
    r = plain_and_observed(plain, observed, rec, n, args.reps, args.threads)
    r["native_sections"] = native_sections(plain, n, args.reps)
    r["profiled"] = prof = profiled(observed, rec, n, args.prof_reps)
    p, o = r["plain"]["median_s"], r["observed"]
    kernel = min(o["kernel_s"], p)
    torch_out = (p - kernel) * prof["torch_share_of_non_kernel"]
    python = p - kernel - torch_out
    r["split"] = {"pass_s": p, "kernel_s": kernel, "torch_outside_s": torch_out, "python_s": python,
                  "kernel_share": kernel / p, "torch_outside_share": torch_out / p, "python_share": python / p,
                  "threads_idle_share": r["threads_idle"]["idle_share"],
                  "threads_runqueue_wait_share": r["threads_idle"]["runqueue_wait_share"]}
    r["split_uniform"] = {k: v * p for k, v in prof["shares"].items()}
    r["plain_path"] = "one native call" if plain.model.step is not None else "a call per layer"
    r["instrumentation_overhead"] = {"observer": o["median_s"] / p - 1,
                                     "observer_and_profiler": prof["median_pass"]["wall_s"] / p - 1}
    after = probe(args.threads)["best_gb_s"]
    one_after = probe(1)["best_gb_s"] if args.threads > 1 else None
    bw = max(before, after)  # the better of the two: the share is not flattered by a slow moment
    nbytes = o["weight_bytes"]
    r["bandwidth"] = {"weight_bytes": nbytes, "per_pass_wall_gb_s": nbytes / p / 1e9,
                      "per_kernel_gb_s": nbytes / o["kernel_s"] / 1e9,
                      "per_weight_ops_gb_s": nbytes / o["weight_ops_s"] / 1e9,
                      "machine_read_gb_s": bw, "machine_read_before_after_gb_s": [before, after], "pass_wall_share_of_machine": nbytes / p / 1e9 / bw,
                      "weight_ops_share_of_machine": nbytes / o["weight_ops_s"] / 1e9 / bw,
                      "one_thread_read_before_after_gb_s": [one_before, one_after],
                      "placement": placement(bw, max(one_before, one_after)) if one_before else None}
    return r


def placement(threads_gb_s: float, one_gb_s: float) -> str:
    """Where the host had put the threads, read from the bandwidth they get: "shared" when T threads read little
    more than one (one memory path between them: on the CI VM 45-50 GB/s on 2, 35-40 on 1), "split" when they read
    well over 1.5 times one (each its own path: 62-79 on 2, 32-36 on 1), "contended" when they read less than one (a
    core taken from outside the process: 33 on 2, 41 on 1). The decode step does not speed up in the split placement
    (7.2-7.9 ms either way on the mid fixture), so its share of the machine drops there."""
    return "split" if threads_gb_s > 1.5 * one_gb_s else "contended" if threads_gb_s < one_gb_s else "shared"


# --- output ----------------------------------------------------------------------------------------

def table(results: dict) -> str:
    head = (f"{'model':<10}{'N':>2} {'best ms':>8} {'med ms':>8} | {'kernel':>6} {'torch':>6} {'python':>6} | "
            f"{'idle':>5} {'rq':>5} | {'MB/pass':>8} {'GB/s wall':>9} {'GB/s wops':>9} {'%mach':>6} | {'obs+':>5} {'prof+':>5}")
    lines = [head, "-" * len(head)]
    for mname, m in results.items():
        for n, c in m["cases"].items():
            s, b, ov = c["split"], c["bandwidth"], c["instrumentation_overhead"]
            w = s["threads_runqueue_wait_share"]
            rq = "  n/a" if w is None else f"{100 * w:4.1f}%"
            lines.append(
                f"{mname:<10}{n:>2} {1e3 * c['plain']['best_s']:8.2f} {1e3 * c['plain']['median_s']:8.2f} | "
                f"{100 * s['kernel_share']:5.1f}% {100 * s['torch_outside_share']:5.1f}% {100 * s['python_share']:5.1f}% | "
                f"{100 * s['threads_idle_share']:4.1f}% {rq} | {b['weight_bytes'] / 1e6:8.2f} {b['per_pass_wall_gb_s']:9.2f} "
                f"{b['per_weight_ops_gb_s']:9.2f} {100 * b['pass_wall_share_of_machine']:5.1f}%"
                f"{'*' if b.get('placement') == 'split' else ' '}| "
                f"{100 * ov['observer']:4.0f}% {100 * ov['observer_and_profiler']:4.0f}%")
    lines.append("kernel/torch/python: shares of the plain median pass (see method.split_scaling); idle: thread idle "
                 "share of threads × wall, rq: the part of it spent waiting for a core; GB/s wall: weight bytes / "
                 "plain median, wops: / time of the weight-reading ops; %mach: wall GB/s over the measured read "
                 "bandwidth (*: measured in the split placement, see bandwidth.placement); obs+/prof+: pass time "
                 "added by the observer / observer + profiler")
    lines.append("")
    lines.append("engine ops (observed passes, median ms per pass, calls):")
    for mname, m in results.items():
        for n, c in m["cases"].items():
            parts = ", ".join(f"{k} {1e3 * v['seconds']:.2f} ({v['calls']})" for k, v in
                              sorted(c["observed"]["ops"].items(), key=lambda kv: -kv[1]["seconds"]))
            lines.append(f"  {mname} N={n}: {parts}")
    lines.append("")
    lines.append("native layer sections (mean ms per pass, GB/s of the weight-reading ones):")
    for mname, m in results.items():
        for n, c in m["cases"].items():
            ns = c.get("native_sections")
            if not ns:
                continue
            parts = ", ".join(f"{k} {v['ms_per_pass']:.2f}" + (f" ({v['gb_s']:.1f} GB/s)" if v["gb_s"] else "")
                              for k, v in ns["sections"].items() if v["ms_per_pass"] >= 0.005)
            pf = ns["sections"].get("prefetch")
            if pf:
                parts += f"; prefetch jobs {pf['marks_per_pass']:.0f} ({pf['weight_mb_per_pass']:.1f} MB handed out)"
            lines.append(f"  {mname} N={n} ({ns['mean_pass_ms']:.2f} ms): {parts}; outside the layers "
                         f"{ns['outside_layers_ms']:.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10, help="plain and observed passes per case")
    ap.add_argument("--prof-reps", type=int, default=3, help="profiled passes per case")
    ap.add_argument("--models", default="embedded,mid", help="comma list of 'embedded', 'mid' or GGUF paths")
    ap.add_argument("--bw-mib", type=int, default=1024, help="buffer of the read-bandwidth measurement (MiB)")
    ap.add_argument("--bw-reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/step_profile.json"))
    ap.add_argument("--label", default=None, help="what build this is (docs/benchmarks.md shows it)")
    args = ap.parse_args()
    if args.bw_mib < 512:
        ap.error("--bw-mib must be at least 512")
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load_start + args.threads > cores + 0.5:
        print(f"warning: load average {load_start:.1f} on {cores} cores: with {args.threads} threads, passes will "
              "wait for cores (see runqueue_wait_share)", flush=True)
    torch.set_num_threads(args.threads)
    backend = ops.default_backend()
    probe = ReadBandwidth(args.bw_mib, args.bw_reps)
    bw = [probe(args.threads)]
    if args.threads != 1:
        bw.append(probe(1))
    bw_t = bw[0]["best_gb_s"]
    print(f"read bandwidth: {bw_t:.1f} GB/s ({args.threads} threads)", flush=True)

    results: dict = {}
    for spec in [s.strip() for s in args.models.split(",") if s.strip()]:
        if spec == "mid":
            path, shape = cached("mid", ROOT / "build/bench"), MID.__dict__
        elif spec in ("embedded", "default"):
            path, shape = default_model_path(), None
        else:
            path, shape = Path(spec), None
        t0 = time.perf_counter()
        vocab = min(32000, open_model(path).hparams.n_vocab)
        rng = np.random.default_rng(0)
        context, draft = rng.integers(0, vocab, CONTEXT).tolist(), rng.integers(0, vocab, 8).tolist()
        rec = Recorder()
        plain = Runner(path, backend, context, draft)
        observed = Runner(path, backend.with_observer(rec), context, draft)
        print(f"{spec}: {path.name} loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        cases = {}
        for n in (1, 4):
            cases[str(n)] = case(plain, observed, rec, n, args, probe)
            s = cases[str(n)]["split"]
            print(f"  N={n}: {1e3 * s['pass_s']:.2f} ms, kernel {100 * s['kernel_share']:.1f}%, torch "
                  f"{100 * s['torch_outside_share']:.1f}%, python {100 * s['python_share']:.1f}%, idle "
                  f"{100 * s['threads_idle_share']:.1f}%", flush=True)
        results[spec] = {"file": path.name, "shape": shape, "cases": cases}
        del plain, observed

    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_info(), "label": args.label,
        "run_s": time.perf_counter() - t_start,
        "threads": args.threads, "reps": args.reps, "prof_reps": args.prof_reps,
        "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg()[0],
        "torch": torch.__version__, "backend": backend.name, "cpu": cpu_info(),
        "omp_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        "read_bandwidth": bw,
        "method": {
            "pass": "N=1: forward([t], logit_rows='all'); N=4: forward(4 tokens, logit_rows='all', capture=True) "
                    "as a speculative verify; cache rewound to a 64-token context before each pass, untimed",
            "kernel": "sum of OpEvent.seconds from a backend observer (observed passes, median)",
            "plain_path": "how the plain model ran the pass: a pass of up to 16 rows is one native call for the "
                          "whole trunk (ops.FusedStep) where nothing observes it, while the observed model runs a "
                          "call per layer: its kernel seconds then exceed the plain pass (kernel_s is capped at "
                          "pass_s, and the split reads kernel ≈ 100%: the Python around the one call is inside it)",
            "torch_outside": "torch.profiler CPU events, self CPU time, midpoint inside the pass and outside "
                             "every engine op interval (marker after each op on the profiler clock)",
            "python": "pass wall − kernel − torch_outside",
            "split_scaling": "split: pass_s = plain median; kernel_s = observed median kernel seconds (≤ pass_s); "
                             "pass_s − kernel_s divided between torch_outside and python in the profiled passes' "
                             "median ratio. split_uniform: profiled median pass's shares × pass_s",
            "threads_idle": "threads × Σ wall − Σ process CPU time over the plain passes, / (threads × Σ wall); "
                            "spin-waiting OpenMP threads count as busy; runqueue_wait_share: the part of it the "
                            "threads spent runnable, waiting for a core (schedstat); sleeping_share: the rest",
            "native_sections": "plain passes with engine/native/trace.c's section clock on: time between marks "
                               "in layer.c and moe.c per section, weight bytes of the products; pool_wait (callers "
                               "waiting for other threads' items) lies inside the other sections; prefetch: the "
                               "ranges handed to the workers between products (pool_prefetch), jobs and MB, no time",
            "bandwidth": "weight bytes per pass (observer) / plain median wall (per_pass_wall), / observed kernel "
                         "seconds (per_kernel), / seconds of linear+linear_many+moe_experts+layer (per_weight_ops; "
                         "a fused layer's seconds include its recurrence or attention); "
                         "machine: torch.sum over a float32 buffer of random values, best of reps, 1e9 B/s, "
                         "measured before and after each case's passes, the better of the two; placement: "
                         "'split' where that is over 1.5 times the better one-thread figure measured beside it, "
                         "'contended' where it is below it, else 'shared' (the host gives the two threads one memory "
                         "path or one each, or something outside the process takes a core)",
        },
        "models": results,
    }
    out["run_s"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print()
    print(table(results))
    print(f"\nwrote {args.out} in {out['run_s']:.0f} s")


if __name__ == "__main__":
    main()
