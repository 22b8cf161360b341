"""Q8_0 products of the torch backend: its integer path (engine.ops.torch_int8) against dequantize-then-float.

    python bench/q8dot.py [--threads 1] [--rounds 5] [--prompts 16] [--out bench/results/q8dot.json]

Two measurements, each alternating the two paths round by round (best round counts):
* one product per weight shape of the embedded model (and wider matrices) and row count M (1 = a decode
  step, 2–8 = verify passes, 64 = a prefill chunk): the weight bound to the torch backend's integer product
  (`Int8Linear`) against the same weight dequantized (`DequantLinear`); `engine_integer` says which one the torch
  backend uses for that shape (`Int8Layouts.max_cols`);
* decode of the embedded model answering the first `--prompts` held-out evaluation prompts (greedy, MTP
  off, replies end at EOS, ≤ 64 tokens): tokens over decode time, as in bench/mtp.py.
The "float" decode is the torch backend with its integer path off (`Int8Layouts(max_cols=0)`). The native backends
run Q8_0 in their own kernels (bench/kquant.py); this is the path where the native library is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gguf.quants as gq  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from bench.timing import mean_seconds  # noqa: E402
from engine import ops  # noqa: E402
from engine.events import EngineConfig, GenerationConfig, Stats  # noqa: E402
from engine.generate import load  # noqa: E402
from engine.ops.linear import DequantLinear, Int8Linear  # noqa: E402
from engine.storage.qtensor import QTensor  # noqa: E402
from engine.training.data import eval_prompts  # noqa: E402

SHAPES = [(8192, 256, "LM head"), (512, 256, "attention q / GDN qkv"), (256, 256, "shared expert, out"),
          (256, 128, "expert down"), (256, 512, "MTP eh_proj"), (1024, 1024, "wider model"),
          (2048, 2048, "wider model")]
ROWS = [1, 2, 4, 8, 64]
FLOAT = ops.Backend("torch", "torch", int8=ops.Int8Layouts(max_cols=0))  # the torch backend, integer path off


def bench_products(rounds: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for n, k, what in SHAPES:
        w = QTensor(gq.quantize(rng.standard_normal((n, k)).astype(np.float32), QT.Q8_0), QT.Q8_0, (n, k))
        lin = {True: Int8Linear(w, ops.TORCH), False: DequantLinear(w, ops.TORCH)}
        for m in ROWS:
            x = torch.randn(m, k)
            reps = max(3, int(2e7 / (n * k * max(m, 4))))
            best = {True: float("inf"), False: float("inf")}
            for _ in range(rounds):
                for integer in (True, False):
                    best[integer] = min(best[integer],
                                        mean_seconds(lambda i=integer: ops.linear(x.clone(), lin[i]), reps))
            out.append({"shape": [n, k], "weight": what, "rows": m, "integer_s": best[True], "float_s": best[False],
                        "speedup": best[False] / best[True], "engine_integer": ops.bind(w, ops.TORCH).kind == "int8"})
            print(f"  {n:5d}×{k:<5d} M={m:<3d} integer {best[True] * 1e6:8.1f} µs  float {best[False] * 1e6:8.1f} µs"
                  f"  ×{best[False] / best[True]:.2f}", flush=True)
    return out


def bench_decode(n_prompts: int, rounds: int) -> dict:
    engines = {True: load(None, EngineConfig(backend=ops.TORCH)), False: load(None, EngineConfig(backend=FLOAT))}
    prompts = eval_prompts()[:n_prompts]
    best: dict[bool, dict] = {}
    for _ in range(rounds):
        for integer, eng in engines.items():
            tokens, seconds = 0, 0.0
            for p in prompts:
                eng.reset()
                final = None
                for ev in eng.generate(list(p.messages), GenerationConfig(max_tokens=64, mtp=False)):
                    if isinstance(ev, Stats) and ev.final:
                        final = ev
                assert final is not None
                tokens += max(final.generated_tokens - 1, 0)
                seconds += final.elapsed_s - final.ttft_s
            rate = tokens / seconds
            if integer not in best or rate > best[integer]["decode_tok_s"]:
                best[integer] = {"decode_tokens": tokens, "decode_s": seconds, "decode_tok_s": rate}
    res = {"workload": f"embedded model on the torch backend, first {n_prompts} held-out evaluation prompts, greedy, "
                       "MTP off",
           "integer": best[True], "float": best[False],
           "speedup": best[True]["decode_tok_s"] / best[False]["decode_tok_s"]}
    print(f"  decode: integer {best[True]['decode_tok_s']:.1f} tok/s, float {best[False]['decode_tok_s']:.1f} tok/s "
          f"(×{res['speedup']:.2f})", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench/results/q8dot.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = {"command": "python bench/q8dot.py" + "".join(f" {a}" for a in sys.argv[1:]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpu": platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
                       "load_avg_at_start": os.getloadavg()[0]},
           "torch": torch.__version__}
    print("products (best of rounds):", flush=True)
    res["products"] = bench_products(args.rounds)
    res["decode"] = bench_decode(args.prompts, max(2, args.rounds // 2))
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
