"""Q4_K / Q6_K / Q8_0 products: the native kernels against the torch backend.

    python bench/kquant.py [--threads 2] [--rounds 5] [--out bench/results/kquant.json]

One product per weight shape of the mid-size benchmark model (bench/synthetic.py MID: Q4_K with Q6_K expert
down projections and LM head), of the embedded model (Q8_0) and of a Q8_0 attention projection of a real
model's width, and row count M (1 = a decode step, 2–8 = verify passes, 64 = a prefill chunk), the paths
alternating round by round (best round counts). "native" is the weight bound to the default backend
(`ops.default_backend()`, as the engine runs it: on AVX512-VNNI and on AVX2, Q4_K, Q6_K and Q8_0 packed 16 rows
interleaved); "stored" (where the default backend packs) is the same product in the stored block order (the default
backend with weights left mapped, `copies=False`); "torch" is the `torch` backend (dequantize-then-float for
K-quants, the torch integer path for Q8_0 rows of ≤ 512 values and dequantize-then-float for wider ones). Each path
is `ops.linear` on the weight bound to it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import mean_seconds  # noqa: E402
from engine import ops  # noqa: E402
from engine.ops import native  # noqa: E402
from engine.storage.qtensor import QTensor  # noqa: E402
from engine.storage.quantize import random_blocks  # noqa: E402

SHAPES = [(QT.Q4_K, 4096, 1024, "attention q+gate"), (QT.Q4_K, 1024, 2048, "attention / GDN out"),
          (QT.Q4_K, 512, 1024, "shared expert gate"), (QT.Q6_K, 1024, 256, "expert down"),
          (QT.Q6_K, 32768, 1024, "LM head"), (QT.Q8_0, 768, 256, "embedded q+k+v"),
          (QT.Q8_0, 8192, 256, "embedded LM head"), (QT.Q8_0, 2048, 2048, "Q8_0 attention, 2048 wide")]
ROWS = [1, 2, 4, 8, 64]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/kquant.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the native library is not built (pip install -e .)")
    rng = np.random.default_rng(0)
    default = ops.default_backend()
    backends = {"native": default, "torch": ops.TORCH}
    if default.packs:
        backends["stored"] = replace(default, copies=False)
    rows_out = []
    for qt, n_out, k, what in SHAPES:
        w = QTensor(random_blocks((n_out, k), qt, rng, 1 / np.sqrt(k)), qt, (n_out, k))
        lins = {p: ops.bind(w, b) for p, b in backends.items()}
        for m in ROWS:
            x = torch.randn(m, k)
            big = n_out * k * m
            reps = max(1, min(200, int(2e9 // (big * 40))))
            t = {p: float("inf") for p in lins}
            for _ in range(args.rounds):
                for path, lin in lins.items():
                    t[path] = min(t[path], mean_seconds(lambda lin=lin: ops.linear(x.clone(), lin), reps))
            row = {"type": qt.name, "out": n_out, "in": k, "what": what, "m": m,
                   "native_ms": t["native"] * 1e3, "torch_ms": t["torch"] * 1e3,
                   "speedup": t["torch"] / t["native"], "native_gb_s": w.nbytes / t["native"] / 1e9}
            if "stored" in t:  # packed (native) against the stored block order
                row.update(stored_order_ms=t["stored"] * 1e3, packed_speedup=t["stored"] / t["native"])
            rows_out.append(row)
            print(json.dumps(rows_out[-1]))
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": args.threads, "rounds": args.rounds, "load_avg_at_start": os.getloadavg()[0],
        "cpu": platform.processor() or platform.machine(),
        "backends": {p: b.name for p, b in backends.items()}, "torch": torch.__version__,
        "products": rows_out,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
