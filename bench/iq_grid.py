"""Grid-codebook IQ products (engine/native/iq_grid.c): GB/s of weight read per type, AVX2 form against portable C.

    python bench/iq_grid.py [--out-rows 4096] [--cols 2048] [--threads 1] [--rounds 5]
                            [--out bench/results/iq_grid.json]

One product per IQ grid type (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) and per row count M (1 = a decode
step, 4 = a verify pass), random valid blocks (engine.storage.quantize.random_iq_blocks), each path `ops.linear` on
the weight bound to the `native-avx2` or `native-portable` backend (those this CPU runs), alternating round by round
(best round counts; the activation quantization is part of each call, as the engine runs it). A Q4_K product of the
same shape is timed alongside as the yardstick of the K-quant products. GB/s: the weight's stored bytes per second.
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
from engine.storage.quantize import random_blocks, random_iq_blocks  # noqa: E402

ROWS = [1, 4]


def _weight(qt: QT, n_out: int, k: int, rng: np.random.Generator) -> QTensor:
    make = random_iq_blocks if qt in native.IQ_GRID_TYPES else random_blocks
    return QTensor(make((n_out, k), qt, rng, 1 / np.sqrt(k)), qt, (n_out, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-rows", type=int, default=4096, help="weight rows (outputs)")
    ap.add_argument("--cols", type=int, default=2048, help="weight columns (a multiple of 256)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/iq_grid.json"))
    args = ap.parse_args()
    if not native.available():
        raise SystemExit("the native library is not built (pip install -e .)")
    torch.set_num_threads(args.threads)
    names = [b.name for b in ops.available_backends()]
    forms = {f: replace(ops.backend_named(f"native-{f}"), threads=args.threads)
             for f in ("avx2", "portable") if f"native-{f}" in names}
    rng = np.random.default_rng(0)
    rows_out = []
    for qt in (*native.IQ_GRID_TYPES, QT.Q4_K):
        w = _weight(qt, args.out_rows, args.cols, rng)
        lins = {f: ops.bind(w, b) for f, b in forms.items()}
        for m in ROWS:
            x = torch.randn(m, args.cols)
            reps = max(1, min(100, int(2e8 // (args.out_rows * args.cols * m))))
            t = {f: float("inf") for f in lins}
            for _ in range(args.rounds):
                for f, lin in lins.items():
                    t[f] = min(t[f], mean_seconds(lambda lin=lin: ops.linear(x.clone(), lin), reps))
            row = {"type": qt.name, "out": args.out_rows, "in": args.cols, "m": m, "bytes": w.nbytes}
            for f, s in t.items():
                row[f"{f}_ms"] = s * 1e3
                row[f"{f}_gb_s"] = w.nbytes / s / 1e9
            if "avx2" in t and "portable" in t:
                row["avx2_speedup"] = t["portable"] / t["avx2"]
            rows_out.append(row)
            print(json.dumps(row))
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": args.threads, "rounds": args.rounds, "load_avg_at_start": os.getloadavg()[0],
        "cpu": platform.processor() or platform.machine(), "forms": {f: b.name for f, b in forms.items()},
        "torch": torch.__version__, "products": rows_out,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
