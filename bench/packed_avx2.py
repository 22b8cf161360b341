"""The AVX2 packed products at the Qwen3.5-9B dense shape: before (AVX2's stored order), after, and the VNNI form.

    python bench/packed_avx2.py [--threads 2] [--rounds 5] [--rows 1 4] [--out bench/results/packed_avx2.json]
                                [--model FILE.gguf --tokens 24]

The matrices a decode step of bench/synthetic.py's QWEN35_9B reads most of (llama.cpp's Q4_K_M: Q4_K FFN gate and
up, Q6_K FFN down and head; the head as one of 16 row slices), and a Q8_0 FFN matrix (a Q8_0 file), with random
valid blocks, times M activation rows (1 = a decode step, 4 = a verify pass), in three forms: `avx2-stored`
(`native-avx2` with weights left mapped, `copies=False`: what `native-avx2` ran before it packed), `avx2-packed`
(`native-avx2`) and `vnni-packed` (`native-avx512vnni`, where the CPU has it). The forms alternate round by round
(best round's mean counts), so a burst of other load cannot spoil one form's every sample; each figure keeps the
median round too, the load average before and after, and `cpu_ms`, the process's CPU time per call (best round): with
--threads 1 the compute alone, which other processes on the cores hardly move (with more threads it counts the
pool's spinning workers too). `step_ms` adds up one token's FFN and head products
(32 layers × gate, up, down; the 16 head slices): 72 % of the file's bytes, the rest being attention and GDN
projections of the same types.

With --model, whole decodes of that file instead (QWEN35_9B: `python bench/synthetic.py qwen35-9b`): per round, each
form in a process of its own (`engine.load` with the form's backend, a 4-token reply that packs the weights, then
one of --tokens greedy tokens after a 16-token prompt, plain decoding), `decode_tok_s` per run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
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

# (what, type, rows, columns, matrices of it per token at QWEN35_9B)
MATRICES = [("ffn gate / up", QT.Q4_K, 12288, 4096, 64), ("ffn down", QT.Q6_K, 4096, 12288, 32),
            ("head, a 16th", QT.Q6_K, 248320 // 16, 4096, 16), ("Q8_0 ffn gate / up", QT.Q8_0, 12288, 4096, 0)]


def forms(threads: int) -> dict[str, ops.Backend]:
    avx2 = replace(ops.backend_named("native-avx2"), threads=threads)
    out = {"avx2-stored": replace(avx2, copies=False), "avx2-packed": avx2}
    if native.cpu_vnni():
        out["vnni-packed"] = replace(ops.backend_named("native-avx512vnni"), threads=threads)
    return out


def measure(qt: QT, n_out: int, k: int, m: int, backends: dict[str, ops.Backend], rounds: int) -> dict[str, dict]:
    """Each form's best and median round (mean ms over the round's calls) of one product."""
    w = QTensor(torch.from_numpy(random_blocks((n_out, k), qt, np.random.default_rng(0), 1 / np.sqrt(k))), qt,
                (n_out, k))
    lins = {name: ops.bind(w, b) for name, b in backends.items()}
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    reps = max(2, min(50, int(3e8 // w.nbytes)))
    wall: dict[str, list[float]] = {name: [] for name in lins}
    cpu: dict[str, list[float]] = {name: [] for name in lins}
    for _ in range(rounds):
        for name, lin in lins.items():
            c0 = time.process_time()
            wall[name].append(mean_seconds(lambda lin=lin: ops.linear(x.clone(), lin), reps) * 1e3)
            cpu[name].append((time.process_time() - c0) / (reps + 1) * 1e3)  # mean_seconds warms up with one call
    return {name: {"best_ms": min(t), "median_ms": statistics.median(t), "gb_s": w.nbytes / min(t) / 1e6,
                   "cpu_ms": min(cpu[name])} for name, t in wall.items()}


def decode_run(model: str, form: str, tokens: int, threads: int) -> dict:
    """Decode tokens/s of one reply of `model` in `form` (run in a child process: one form's memory at a time)."""
    from bench.decode import final_stats, run_record
    from engine.generate import EngineConfig, GenerationConfig, load
    from engine.sampling import SamplingConfig

    eng = load(model, EngineConfig(n_ctx=256, n_threads=threads, backend=forms(threads)[form]))
    eng.tokenizer.eog_ids = frozenset()  # EOS ignored: every run decodes exactly `tokens`

    def reply(ids: list[int], n: int) -> dict:
        eng.reset()
        gen = GenerationConfig(max_tokens=n, sampling=SamplingConfig(temperature=0.0, top_k=1), mtp=False,
                               stats_interval_s=3600.0)
        return run_record(final_stats(eng, ids, gen))

    reply(list(range(100, 116)), 4)  # packs the weights (on their first products)
    r = reply(list(range(200, 216)), tokens)
    return {"form": form, "decode_tok_s": r["decode_tokens"] / r["decode_s"], "load_avg": os.getloadavg()[0]}


def decodes(model: str, tokens: int, threads: int, rounds: int) -> dict:
    """Each form's decode runs, alternating round by round, and the medians' ratios."""
    runs: dict[str, list[float]] = {form: [] for form in forms(threads)}
    for _ in range(rounds):
        for form in runs:
            child = subprocess.run([sys.executable, __file__, "--child", json.dumps([model, form, tokens, threads])],
                                   capture_output=True, text=True, check=True)
            runs[form].append(json.loads(child.stdout.splitlines()[-1])["decode_tok_s"])
            print(form, runs[form][-1])
    med = {form: statistics.median(t) for form, t in runs.items()}
    out = {"decode_tok_s": runs, "median": med, "packed_over_stored": med["avx2-packed"] / med["avx2-stored"]}
    if "vnni-packed" in med:
        out["avx2_over_vnni"] = med["avx2-packed"] / med["vnni-packed"]
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        torch.set_num_threads(json.loads(sys.argv[2])[3])
        print(json.dumps(decode_run(*json.loads(sys.argv[2]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--out", default=None, help="write the figures here (bench/results/packed_avx2.json)")
    ap.add_argument("--model", default=None, help="whole decodes of this GGUF file instead of the products")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    if not (native.available() and native.cpu_avx2()):
        raise SystemExit("the native library is not built, or this CPU has no AVX2")
    torch.set_num_threads(args.threads)
    backends = forms(args.threads)
    load_before = os.getloadavg()
    head = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "load_avg_before": load_before,
            "cpu": platform.processor() or platform.machine(), "threads": args.threads, "rounds": args.rounds}
    if args.model:
        result = {**head, "model": Path(args.model).name, "tokens": args.tokens,
                  **decodes(args.model, args.tokens, args.threads, args.rounds), "load_avg_after": os.getloadavg()}
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return
    rows = []
    for what, qt, n_out, k, per_token in MATRICES:
        for m in args.rows:
            rows.append({"what": what, "type": qt.name, "out": n_out, "in": k, "m": m, "per_token": per_token,
                         "forms": measure(qt, n_out, k, m, backends, args.rounds)})
            print(json.dumps(rows[-1]))
    steps = {}
    for m in args.rows:
        steps[m] = {}
        for fig in ("best_ms", "cpu_ms"):
            step = {name: sum(r["per_token"] * r["forms"][name][fig] for r in rows if r["m"] == m) for name in backends}
            steps[m][fig] = {"step_ms": step, "packed_over_stored": step["avx2-stored"] / step["avx2-packed"]}
            if "vnni-packed" in step:
                steps[m][fig]["avx2_over_vnni"] = step["vnni-packed"] / step["avx2-packed"]
        print(m, json.dumps(steps[m]))
    if args.out:
        Path(args.out).write_text(json.dumps({**head, "load_avg_after": os.getloadavg(), "products": rows,
                                              "per_token": steps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
