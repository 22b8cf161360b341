"""Causal attention over the KV cache: the native kernel (engine/native/attention.c) against its plain loops and
the torch twin (`engine.ops.attention.attention_torch`).

    python bench/attention.py [--threads 2] [--reps 20] [--out bench/results/attention.json]

Head shapes of the mid-size benchmark model (8 query heads, 2 KV heads, 256 dims) and of Qwen3.6-35B-A3B (16, 2,
256); contexts of 512, 4096 and 8192 keys; 1 query (a decode step) and 4 (a verify pass). "native" is `ops.attention`
on the default backend (the engine's call), "plain" the same kernel on the `native-portable` backend (its plain C
loops: scores one key at a time, each output value loaded and stored per key), "avx2" the `native-avx2` backend
where the CPU has it (its AVX2 register forms), "torch" the torch backend; they alternate rep by rep (each evicts the others' data, as the other layers of a decode step do), median counts.
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import ops  # noqa: E402
from engine.cache import KVLayer  # noqa: E402
from engine.ops import native  # noqa: E402

SHAPES = [("mid-size fixture", 8, 2, 256), ("Qwen3.6-35B-A3B", 16, 2, 256)]
CONTEXTS = [512, 4096, 8192]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench/results/attention.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the native library is not built (pip install -e .)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    backends = {"native": ops.default_backend(), "plain": ops.Backend("native", "portable"), "torch": ops.TORCH}
    if "native-avx2" in {b.name for b in ops.available_backends()}:  # what an AVX2-only desktop runs
        backends["avx2"] = ops.backend_named("native-avx2")
    for what, h, h_kv, d in SHAPES:
        scale = d ** -0.5
        for ctx in CONTEXTS:
            kv = KVLayer(torch.randn(ctx + 8, h_kv, d, generator=gen), torch.randn(ctx + 8, h_kv, d, generator=gen))
            for n in (1, 4):
                q = torch.randn(n, h, d, generator=gen)
                pos = ctx - n
                t: dict[str, list[float]] = {p: [] for p in backends}
                for _ in range(args.reps):
                    for p, b in backends.items():
                        t0 = time.perf_counter()
                        ops.attention(q, kv.k, kv.v, pos, scale, b)
                        t[p].append(time.perf_counter() - t0)
                med = {p: statistics.median(v) for p, v in t.items()}
                kv_bytes = 2 * ctx * h_kv * d * 4
                rows.append({"shape": what, "n_head": h, "n_head_kv": h_kv, "head_dim": d, "context": ctx,
                             "queries": n, **{f"{p}_ms": v * 1e3 for p, v in med.items()},
                             "native_kv_gb_s": kv_bytes / med["native"] / 1e9,
                             "over_plain": med["plain"] / med["native"],
                             "over_torch": med["torch"] / med["native"],
                             **({"avx2_over_plain": med["plain"] / med["avx2"]} if "avx2" in med else {})})
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": " ".join(["python", "bench/attention.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": args.threads, "reps": args.reps, "load_avg_at_start": os.getloadavg()[0],
        "torch": torch.__version__, "backends": {p: b.name for p, b in backends.items()}, "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
