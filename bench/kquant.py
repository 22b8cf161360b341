"""Q4_K / Q6_K / Q8_0 products: the native kernels (engine.kquant) against the torch paths.

    python bench/kquant.py [--threads 2] [--rounds 5] [--out bench/results/kquant.json]

One product per weight shape of the mid-size benchmark model (bench/synthetic.py MID: Q4_K with Q6_K expert
down projections and LM head), of the embedded model (Q8_0) and of a Q8_0 attention projection of a real
model's width, and row count M (1 = a decode step, 2–8 = verify passes, 64 = a prefill chunk), the paths
alternating round by round (best round counts). On AVX512-VNNI "native" Q4_K, Q6_K and Q8_0 run packed (`kquant.pack`:
16 rows interleaved) and "stored" is the same product on the stored blocks. "torch" is `rowwise_matmul` with the native path switched off
(`engine.kquant.usable` → False: dequantize-then-float for K-quants, the torch integer path engine.q8dot for
Q8_0 rows of ≤ 512 values and dequantize-then-float for wider ones); "native" is `rowwise_matmul` as the
engine runs it.
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
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import mean_seconds  # noqa: E402
from engine import kquant, nativelib  # noqa: E402
from engine.quant import QTensor  # noqa: E402
from engine.quantize import random_blocks  # noqa: E402
from engine.rowwise import rowwise_matmul  # noqa: E402

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
    if not nativelib.available():
        raise SystemExit("the native K-quant library is not built (pip install -e .)")
    rng = np.random.default_rng(0)
    usable = kquant.usable
    rows_out = []
    for qt, n_out, k, what in SHAPES:
        w = QTensor(random_blocks((n_out, k), qt, rng, 1 / np.sqrt(k)), qt, (n_out, k))
        for m in ROWS:
            x = torch.randn(m, k)
            big = n_out * k * m
            reps = max(1, min(200, int(2e9 // (big * 40))))
            paths = ["native", "torch"] + (["stored"] if qt in kquant.PACKED and kquant.packs() else [])
            t = {p: float("inf") for p in paths}
            for _ in range(args.rounds):
                for path in paths:
                    kquant.usable = usable if path != "torch" else (lambda w, x: False)  # type: ignore[assignment]
                    kquant.PACK = path != "stored"
                    t[path] = min(t[path], mean_seconds(lambda: rowwise_matmul(x.clone(), w), reps))
            kquant.usable, kquant.PACK = usable, True  # type: ignore[assignment]
            row = {"type": qt.name, "out": n_out, "in": k, "what": what, "m": m,
                   "native_ms": t["native"] * 1e3, "torch_ms": t["torch"] * 1e3,
                   "speedup": t["torch"] / t["native"], "native_gb_s": w.nbytes / t["native"] / 1e9}
            if "stored" in t:  # packed for VNNI (native) against the stored block order
                row.update(stored_order_ms=t["stored"] * 1e3, packed_speedup=t["stored"] / t["native"])
            rows_out.append(row)
            print(json.dumps(rows_out[-1]))
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": args.threads, "rounds": args.rounds, "load_avg_at_start": os.getloadavg()[0],
        "cpu": platform.processor() or platform.machine(), "kernels": kquant.isa(), "torch": torch.__version__,
        "products": rows_out,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
