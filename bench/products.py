"""Native products per weight type and instruction-set form: weight GB/s of one product.

    python bench/products.py [--out 4096 --in 4096] [--rows 1 4] [--threads 1] [--rounds 5] [--types Q5_K Q4_K]
                             [--bandwidth] [--draft] [--json bench/results/products.json]

The output head of a 248k vocabulary (issue 44's target: its product alone at ≥ 70 % of the read bandwidth):

    python bench/products.py --out 248320 --in 1024 --rows 1 4 --threads 2 --rounds 5 --types Q6_K Q8_0 \
                             --bandwidth --json bench/results/head_product.json

With --draft, a draft pass's logits of one row over the same weight as a head (ops.draft_logits: its 2-bit sketch's
scores of every row, the best candidates' groups exact) are measured too (m 1, product "draft"), as GB/s of the bytes
a draft reads (ops.draft_read_bytes):

    python bench/products.py --out 248320 --in 1024 --rows 1 --threads 2 --rounds 7 --types Q6_K --bandwidth --draft \
                             --json bench/results/head_draft.json

Every type with a native product (engine.ops.native.PRODUCT_TYPES), one weight of --out × --in random valid blocks
(engine.storage.quantize.random_blocks), times M activation rows (1 = a decode step, 4 = a verify pass), in every
native backend this machine runs (`ops.available_backends()`: the AVX512 forms of the types without one run their
AVX2 form). Figures are the weight's stored bytes over the best round's mean time; the backends alternate round by
round, so a burst of other load cannot spoil one form's every sample. Without --json nothing is written.
With --bandwidth the machine's read bandwidth (bench/step_profile.ReadBandwidth: torch.sum over 1 GiB with the same
threads) is measured in every round too, and each figure is also given as a share of the best of those.
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

from bench.step_profile import ReadBandwidth  # noqa: E402
from bench.timing import mean_seconds  # noqa: E402
from engine import ops  # noqa: E402
from engine.ops import native  # noqa: E402
from engine.storage.qtensor import QTensor  # noqa: E402
from engine.storage.quantize import random_blocks  # noqa: E402


def measure(qt: QT, n_out: int, k: int, rows: list[int], backends: list[ops.Backend], rounds: int,
            threads: int, bandwidth: ReadBandwidth | None = None, draft: bool = False) -> list[dict[str, object]]:
    """One row per (M, backend): the product's best mean milliseconds and weight GB/s; with `draft` also per backend
    the draft logits of one row (product "draft"; the bytes a draft reads)."""
    w = QTensor(torch.from_numpy(random_blocks((n_out, k), qt, np.random.default_rng(0), 1 / np.sqrt(k))), qt,
                (n_out, k))
    lins = {b.name: ops.bind(w, b) for b in backends}
    out = []
    cases = [(m, "product") for m in rows] + ([(1, "draft")] if draft else [])
    for m, what in cases:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        run = ops.linear if what == "product" else ops.draft_logits
        nbytes = {name: w.nbytes if what == "product" else ops.draft_read_bytes(lin) for name, lin in lins.items()}
        reps = max(1, min(100, int(2e8 // max(min(nbytes.values()), 1))))
        best = {name: float("inf") for name in lins}
        read_gb_s = 0.0
        for _ in range(rounds):
            for name, lin in lins.items():
                best[name] = min(best[name], mean_seconds(lambda lin=lin: run(x.clone(), lin), reps))
            if bandwidth is not None:
                read_gb_s = max(read_gb_s, bandwidth(threads)["best_gb_s"])
        for name, t in best.items():
            out.append({"type": qt.name, "product": what, "out": n_out, "in": k, "m": m, "backend": name,
                        "threads": threads, "ms": t * 1e3, "bytes": nbytes[name], "gb_s": nbytes[name] / t / 1e9})
            if bandwidth is not None:
                out[-1].update(read_gb_s=read_gb_s, share_of_read=nbytes[name] / t / 1e9 / read_gb_s)
            print(json.dumps(out[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", dest="n_out", type=int, default=4096)
    ap.add_argument("--in", dest="k", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--types", nargs="+", default=[t.name for t in native.PRODUCT_TYPES])
    ap.add_argument("--bandwidth", action="store_true", help="measure the read bandwidth each round too")
    ap.add_argument("--draft", action="store_true", help="a draft pass's logits of one row too (ops.draft_logits)")
    ap.add_argument("--json", default=None, help="write the figures here (bench/results/products.json)")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit("the native library is not built (pip install -e .)")
    torch.set_num_threads(args.threads)
    backends = [replace(b, threads=args.threads) for b in ops.available_backends() if b.native]
    load_at_start = os.getloadavg()[0]
    bandwidth = ReadBandwidth(1024, 3) if args.bandwidth else None
    figures = [row for name in args.types
               for row in measure(QT[name], args.n_out, args.k, args.rows, backends, args.rounds, args.threads,
                                  bandwidth, args.draft)]
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg()[0], "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "products": figures,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
