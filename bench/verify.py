"""Cost of a multi-token pass (speculative verify, prefill) relative to one decode step, mid-size MoE.

    python bench/verify.py [--threads 2] [--reps 3] [--out bench/results/verify.json]
    python bench/verify.py --model default --threads 1   # the embedded model → bench/results/verify_default.json

For N = 2, 4, 8: one grouped pass over N tokens (as a verify: GDN states captured per position) vs N
single-token steps, both divided by the time of one decode step, in the same run; and the commit that follows
a verify which keeps all but its last token, the most a commit does (it re-runs the GDN recurrence over the
kept tokens from the pass's starting state instead of the pass writing a state copy per position). Also prefill of 512
tokens, grouped (sequential and chunk-parallel GDN) vs the per-token loop, and the quantized weight bytes
each pass reads: decode is bandwidth-bound, so bytes read is the physical floor of each ratio. Last, an
instrumented run per N: the share of a pass spent in the routed experts and the distinct experts per layer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.synthetic import MID, cached  # noqa: E402
from engine import ops  # noqa: E402
from tests.fixtures import restore, snapshot  # noqa: E402
from engine.models.build import load_model  # noqa: E402
from engine.storage.modelfile import open_model  # noqa: E402

# What the ops of the pass being measured read and how long the routed experts took: the backend's observer
# (engine.ops.OpEvent) counts every product's weight bytes (for the routed experts, the distinct experts a pass
# uses, each read once) and times the routed experts.
_bytes_read = [0]
_in_experts: dict = {"s": 0.0, "distinct": [], "on": False}


def _observe(e: ops.OpEvent) -> None:
    _bytes_read[0] += e.nbytes
    if e.op == "moe_experts" and _in_experts["on"]:
        _in_experts["s"] += e.seconds
        _in_experts["distinct"].append(e.experts)


def timed(fn, reps: int, setup=None) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Median seconds of `fn` over `reps` runs (each after an untimed `setup`), and the weight bytes one run reads."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        _bytes_read[0] = 0
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), _bytes_read[0]


def where_time_goes(n: int, fn, reps: int, setup) -> dict:  # type: ignore[no-untyped-def]
    """A separate, instrumented run of a pass over n tokens: the share of its time spent in the routed experts
    and how many distinct experts a MoE layer selects (random routing: the bytes they read grow with it)."""
    _in_experts["on"] = True
    shares, passes, distinct = [], [], []
    for _ in range(reps):
        setup()
        _in_experts["s"], _in_experts["distinct"] = 0.0, []
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        passes.append(t)
        shares.append(_in_experts["s"] / t)
        distinct.append(statistics.mean(_in_experts["distinct"]))
    _in_experts["on"] = False
    return {"n": n, "pass_s": statistics.median(passes), "routed_experts_share": statistics.median(shares),
            "distinct_experts_per_layer": statistics.mean(distinct)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--loop-tokens", type=int, default=24, help="tokens timed for the per-token prefill rate")
    ap.add_argument("--model", default="mid", help="'mid' (the synthetic mid-size MoE), 'default' (the embedded "
                    "model) or a GGUF path")
    ap.add_argument("--out", help="default: bench/results/verify.json for 'mid', verify_default.json for 'default'")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend = ops.default_backend().with_observer(_observe)

    from engine.storage.modelfile import default_model_path
    path = cached("mid", ROOT / "build/bench") if args.model == "mid" else \
        default_model_path() if args.model == "default" else Path(args.model)
    out = args.out or str(ROOT / ("bench/results/verify.json" if args.model == "mid" else
                                  "bench/results/verify_default.json"))
    mf = open_model(path)
    m = load_model(mf, n_ctx=1200, backend=backend)
    rng = np.random.default_rng(0)
    vocab = min(32000, mf.hparams.n_vocab)
    context = rng.integers(0, vocab, 64).tolist()
    draft = rng.integers(0, vocab, 8).tolist()
    cache = m.new_cache(1200)
    m.forward(context, cache, logit_rows="none")
    snap = snapshot(cache)

    def reset() -> None:
        restore(cache, snap, len(context))

    def step(toks: list[int], capture: bool):  # type: ignore[no-untyped-def]
        return m.forward(toks, cache, logit_rows="all", capture=capture)

    def commit_cost(n: int) -> float:
        """A verify's commit when it keeps all but its last token, the most a commit re-runs: the GDN states
        after position n − 2 are re-run from the pass's starting state (engine.cache.StateReplay)."""
        reset()
        res = step(draft[:n], True)
        t0 = time.perf_counter()
        cache.commit(res.captured, n - 2)
        return time.perf_counter() - t0

    # Each repetition times one decode step, the grouped pass and the per-token loop back to back, and the
    # ratios are taken per repetition: the host's speed drifts, so only same-moment timings are compared.
    # The cache is restored to the context before each, outside the timed region.
    timed(lambda: step(draft[:1], False), 1, reset)  # warm-up
    rows = []
    t1s: list[float] = []
    b1 = 0
    for n in (2, 4, 8):
        def loop(n: int = n) -> None:
            for t in draft[:n]:
                m.forward([t], cache, logit_rows="all")

        r_group, r_loop, r_commit, tgs, tls, tcs = [], [], [], [], [], []
        for _ in range(args.reps):
            t1, b1 = timed(lambda: step(draft[:1], False), 1, reset)
            tg, bg = timed(lambda n=n: step(draft[:n], True), 1, reset)
            tl, bl = timed(loop, 1, reset)
            tc = commit_cost(n)
            t1s.append(t1)
            tgs.append(tg)
            tls.append(tl)
            tcs.append(tc)
            r_group.append(tg / t1)
            r_loop.append(tl / t1)
            r_commit.append(tc / t1)
        rows.append({"n": n, "grouped_s": statistics.median(tgs), "per_token_s": statistics.median(tls),
                     "grouped_over_decode": statistics.median(r_group),
                     "per_token_over_decode": statistics.median(r_loop),
                     "grouped_bytes_over_decode": bg / b1, "per_token_bytes_over_decode": bl / b1,
                     "commit_rerun_s": statistics.median(tcs), "commit_rerun_over_decode": statistics.median(r_commit)})
        print(rows[-1], flush=True)
    t1 = statistics.median(t1s)
    breakdown = [where_time_goes(n, lambda n=n: step(draft[:n], n > 1), args.reps, reset) for n in (1, 2, 4, 8)]

    prompt = rng.integers(0, vocab, 512).tolist()
    prefill = {}
    for name, chunked in (("grouped_sequential_gdn", False), ("grouped_chunked_gdn", True)):
        def run(chunked: bool = chunked) -> None:
            c = m.new_cache(1200)
            m.forward(prompt, c, logit_rows="last", chunked=chunked)

        t, b = timed(run, 1)
        prefill[name] = {"seconds": t, "tok_s": 512 / t, "weight_bytes": b}
    c = m.new_cache(1200)
    _bytes_read[0] = 0
    t0 = time.perf_counter()
    for tok in prompt[:args.loop_tokens]:
        m.forward([tok], c, logit_rows="last")
    tl = time.perf_counter() - t0
    prefill["per_token_loop"] = {"tokens_timed": args.loop_tokens, "tok_s": args.loop_tokens / tl,
                                 "weight_bytes_per_token": _bytes_read[0] / args.loop_tokens}
    for name in ("grouped_sequential_gdn", "grouped_chunked_gdn"):
        prefill[name]["speedup_over_per_token"] = prefill[name]["tok_s"] / prefill["per_token_loop"]["tok_s"]

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": args.threads, "load_avg_at_start": os.getloadavg()[0], "torch": torch.__version__,
        "backend": backend.name,
        "model": {"file": path.name, "shape": MID.__dict__ if args.model == "mid" else None},
        "decode_step_s": t1, "decode_step_weight_bytes": b1,
        "verify": rows, "prefill_512": prefill, "routed_experts_share": breakdown,
        "targets": {"n4_over_decode_max": 1.5, "prefill_speedup_min": 5.0},
    }
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
