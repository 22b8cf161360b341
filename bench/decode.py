"""Baseline prefill / decode speed on the mid-size synthetic MoE, ours vs llama.cpp, same file, same threads.

    python bench/decode.py [--threads 2] [--prompt 512] [--decode 128] [--rounds 3] [--out bench/results/decode.json]

The two engines alternate round by round (which goes first alternates too), each run in a process of its own with
the default OpenMP settings (in one process the two OpenMP runtimes' idle threads, or a passive wait policy set for
one of them, slowed the other), each from a fresh load, so a host whose speed drifts affects both alike; each
side's best round counts for prefill and for decode, and the median of the rounds' paired ratios is given beside.

Also the peak RSS of loading the model (in a fresh process), which must stay ≤ 1.3 × the file size:
weights stay quantized and memory-mapped. Our prefill, the first pass over the model, includes packing the
Q4_K / Q6_K weights for the VNNI products on their first use (engine.ops.linear.NativeLinear.pack, on the
native-avx512vnni backend), as it includes reading the mapped file; llama.cpp repacks its weights while loading,
outside its timed prefill. The engine runs on the default backend (`engine.ops.default_backend()`).
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
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load_rss(path: Path) -> dict:
    """Load in a child process and report its peak RSS (MiB) right after loading."""
    code = (
        "import resource, sys, torch; torch.set_num_threads(1); "
        "from engine.generate import EngineConfig, load; "
        f"e = load({str(path)!r}, EngineConfig(n_ctx=1024)); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    peak_kib = int(out.stdout.strip().splitlines()[-1])
    return {"peak_rss_mib": peak_kib / 1024, "file_mib": path.stat().st_size / 2**20,
            "ratio": peak_kib * 1024 / path.stat().st_size}


def bench_ours(path: Path, prompt: list[int], n_decode: int, threads: int) -> dict:
    import torch

    from engine.models.build import load_model
    from engine.storage.modelfile import open_model

    torch.set_num_threads(threads)
    m = load_model(open_model(path), n_ctx=len(prompt) + n_decode + 8)
    cache = m.new_cache(len(prompt) + n_decode + 8)
    t0 = time.perf_counter()
    logits = None
    chunked = not m.sequential_prefill  # as the Engine's prefill does
    for s in range(0, len(prompt), 256):  # the Engine's prefill chunk
        logits = m.forward(prompt[s:s + 256], cache, chunked=chunked).logits[-1]
    t_prefill = time.perf_counter() - t0
    tok = int(torch.argmax(logits))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(torch.argmax(m.forward([tok], cache).logits[-1]))
    t_decode = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt) / t_prefill, "decode_tok_s": n_decode / t_decode,
            "prefill_s": t_prefill, "decode_s": t_decode}


def bench_llama(path: Path, prompt: list[int], n_decode: int, threads: int) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(prompt) + n_decode + 8, n_batch=512, n_ubatch=512,
                n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=False)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    t0 = time.perf_counter()
    llm.eval(prompt)
    t_prefill = time.perf_counter() - t0
    tok = int(np.argmax(last_logits()))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
    t_decode = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt) / t_prefill, "decode_tok_s": n_decode / t_decode,
            "prefill_s": t_prefill, "decode_s": t_decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode.json"))
    ap.add_argument("--child", choices=["ours", "llama"], help=argparse.SUPPRESS)  # one run, in its own process
    args = ap.parse_args()
    from bench.synthetic import MID, cached

    path = cached("mid", ROOT / "build/bench")
    prompt = np.random.default_rng(0).integers(0, 32000, args.prompt).tolist()
    if args.child:
        run = bench_ours if args.child == "ours" else bench_llama
        print(json.dumps(run(path, prompt, args.decode, args.threads)))
        return

    def child(engine: str) -> dict:
        cmd = [sys.executable, __file__, "--child", engine, "--threads", str(args.threads), "--prompt",
               str(args.prompt), "--decode", str(args.decode)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    rss = load_rss(path)
    rounds: list[tuple[dict, dict]] = []
    for r in range(args.rounds):
        if r % 2 == 0:
            ref_r = child("llama")
            ours_r = child("ours")
        else:
            ours_r = child("ours")
            ref_r = child("llama")
        rounds.append((ours_r, ref_r))
        print(f"round {r}: ours {ours_r}, llama.cpp {ref_r}", flush=True)

    def best(side: int) -> dict:
        runs = [rd[side] for rd in rounds]
        p = max(runs, key=lambda x: x["prefill_tok_s"])
        d = max(runs, key=lambda x: x["decode_tok_s"])
        return {"prefill_tok_s": p["prefill_tok_s"], "prefill_s": p["prefill_s"],
                "decode_tok_s": d["decode_tok_s"], "decode_s": d["decode_s"]}

    ours, ref = best(0), best(1)
    paired = {k: statistics.median(o[f"{k}_tok_s"] / r[f"{k}_tok_s"] for o, r in rounds) for k in ("prefill", "decode")}
    result = {
        "command": " ".join(["python", "bench/decode.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                    "load_avg_at_start": os.getloadavg()[0]},
        "model": {"file": path.name, "shape": MID.__dict__, "bytes": path.stat().st_size},
        "prompt_tokens": args.prompt, "decode_tokens": args.decode,
        "ours": ours, "llama_cpp": ref,
        "ratio_ours_over_llama": {"prefill": ours["prefill_tok_s"] / ref["prefill_tok_s"],
                                  "decode": ours["decode_tok_s"] / ref["decode_tok_s"]},
        "ratio_median_of_rounds": paired,
        "rounds": [{"ours": o, "llama_cpp": r} for o, r in rounds],
        "load_memory": rss,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
