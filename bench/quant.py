"""Throughput of the dequantizing path per GGUF type, on CPU threads: engine.storage.qtensor's dequantization and
the torch backend's product over dequantized tiles (engine.ops.linear.DequantLinear: x rounded as llama.cpp
rounds it, one product per row).

    .venv/bin/python bench/quant.py [--out bench/results/quant.json] [--threads 2]

Weights are random blocks with moderate fp16 scales (no inf/NaN/denormal slow paths). Each
figure is the best of repeated runs; runs are spread over several rounds through all types, so
a burst of other load on the host cannot spoil every sample of one figure. Medians are kept too.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import ops  # noqa: E402
from engine.ops.linear import DequantLinear  # noqa: E402
from engine.storage import qtensor as quant  # noqa: E402
from engine.storage.qtensor import QTensor  # noqa: E402
from engine.storage.quantize import F16_FIELDS  # noqa: E402  (byte offsets of the fp16 scale fields)



def random_weight(qtype: QT, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == QT.F32:
        return rng.standard_normal((n, k), dtype=np.float32)
    if qtype in (QT.F16, QT.BF16):
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
        if qtype == QT.F16:
            return w.half().numpy()
        return w.to(torch.bfloat16).view(torch.uint8).numpy()
    bs, ts = GGML_QUANT_SIZES[qtype]
    nb = n * k // bs
    blocks = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    halfs = lambda: (rng.standard_normal(nb) * 0.01).astype(np.float16)  # noqa: E731
    for off in F16_FIELDS.get(qtype, ()):
        blocks[:, off:off + 2] = halfs().view(np.uint8).reshape(nb, 2)
    if qtype == QT.IQ1_M:
        d = halfs().view(np.uint16)
        words = blocks[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i in range(4):
            words[:, i] |= ((d >> (4 * i)) & 0xF) << 12
        blocks[:, 48:56] = words.view(np.uint8)
    if qtype == QT.MXFP4:
        blocks[:, 0] = 120 + (blocks[:, 0] & 7)
    return blocks.reshape(n, k // bs * ts)


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)

    def run(self, fn: Callable[[], object], budget_s: float, min_runs: int = 3) -> None:
        fn()  # warm-up: tables, allocator
        start = time.perf_counter()
        n = 0
        while n < min_runs or time.perf_counter() - start < budget_s:
            t0 = time.perf_counter()
            fn()
            self.times.append(time.perf_counter() - t0)
            n += 1

    def summary(self, elements: int) -> dict[str, float]:
        best, med = min(self.times), statistics.median(self.times)
        return {"elements_per_s": elements / best, "median_elements_per_s": elements / med,
                "best_s": best, "median_s": med, "runs": len(self.times)}


def dequant_all(t: QTensor) -> None:
    """The whole tensor, one tile-sized row range per call (what the dequantizing product does)."""
    step = max(1, quant.TILE_ELEMENTS // t.n_cols)
    for r0 in range(0, t.n_rows, step):
        t.dequantize(slice(r0, r0 + step))


def bench_types(types: list[QT], n: int, k: int, budget_s: float, rounds: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    x1, x8 = torch.randn(1, k, generator=gen), torch.randn(8, k, generator=gen)
    weights = {q: QTensor(random_weight(q, n, k), q, (n, k)) for q in types}
    lins = {q: DequantLinear(t, ops.TORCH) for q, t in weights.items()}
    cases = {q: {"dequant": lambda t=t: dequant_all(t), "matmul_x1": lambda q=q: ops.linear(x1, lins[q]),
                 "matmul_x8": lambda q=q: ops.linear(x8, lins[q])} for q, t in weights.items()}
    timings = {(q, name): Timing() for q in types for name in cases[q]}
    for _ in range(rounds):
        for q in types:
            for name, fn in cases[q].items():
                timings[q, name].run(fn, budget_s)
    return [{"type": q.name, "shape": [n, k], "bits_per_weight": 8 * weights[q].nbytes / (n * k),
             **{name: timings[q, name].summary(n * k) for name in cases[q]}} for q in types]


def tile_sweep(types: list[QT], tiles: list[int], n: int, k: int, budget_s: float, rounds: int) -> list[dict[str, object]]:
    """Product throughput per tile size, to justify engine.storage.qtensor.TILE_ELEMENTS."""
    weights = {q: QTensor(random_weight(q, n, k), q, (n, k)) for q in types}
    xs = {"x1": torch.randn(1, k), "x8": torch.randn(8, k)}
    timings = {(q, tile, xn): Timing() for q in types for tile in tiles for xn in xs}
    for _ in range(rounds):
        for (q, tile, xn), tm in timings.items():
            lin = DequantLinear(weights[q], ops.TORCH, tile_elements=tile)
            tm.run(lambda: ops.linear(xs[xn], lin), budget_s)
    return [{"type": q.name, "tile_elements": tile, "tile_mib_fp32": tile * 4 / 2**20,
             **{f"matmul_{xn}_elements_per_s": timings[q, tile, xn].summary(n * k)["elements_per_s"] for xn in xs}}
            for q in types for tile in tiles]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/quant.json"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=4096, help="weight rows")
    ap.add_argument("--k", type=int, default=4096, help="weight columns")
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of repeats per figure and round")
    ap.add_argument("--rounds", type=int, default=3, help="passes over all types")
    ap.add_argument("--types", default="", help="comma-separated type names (default: all supported)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile-size sweep")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    types = [QT[name] for name in args.types.split(",")] if args.types else sorted(quant.SUPPORTED_TYPES, key=int)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = bench_types(types, args.n, args.k, args.budget, args.rounds)
    for r in results:
        ge = {name: r[name]["elements_per_s"] / 1e9 for name in ("dequant", "matmul_x1", "matmul_x8")}  # type: ignore[index]
        print(f"{r['type']:8s} dequant {ge['dequant']:6.2f} Ge/s   matmul x1 {ge['matmul_x1']:6.2f} Ge/s   "
              f"x8 {ge['matmul_x8']:6.2f} Ge/s", flush=True)
    sweep = [] if args.no_sweep else tile_sweep([QT.Q4_K, QT.Q8_0, QT.Q6_K], [1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22],
                                                args.n, args.k, args.budget, args.rounds)
    for s in sweep:
        print(f"sweep {s['type']:5s} tile {s['tile_elements']:>8d}: x1 {s['matmul_x1_elements_per_s'] / 1e9:5.2f} "
              f"x8 {s['matmul_x8_elements_per_s'] / 1e9:5.2f} Ge/s", flush=True)
    report = {
        "benchmark": "engine.storage.qtensor dequantize / tiled matmul throughput (elements of the weight per second)",
        "command": shlex.join([os.path.relpath(sys.executable), *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "threads": torch.get_num_threads(),
        "tile_elements": quant.TILE_ELEMENTS,
        "method": "best of all runs (median also given); each figure is run for --budget seconds in each of "
                  "--rounds passes over all types. dequant = the whole weight as tile-sized row ranges via "
                  "QTensor.dequantize(rows); matmul = ops.linear(x, DequantLinear(w, ops.TORCH)) (dequantize-then-"
                  "multiply, x rounded as llama.cpp rounds it) with fp32 x [1, k] and [8, k]. "
                  "elements = weight elements (n*k) per second",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.perf_counter() - t0,
        "results": results,
        "tile_sweep": sweep,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
