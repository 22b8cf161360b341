"""Decode speed of two source trees of the engine, alternating: is a restructuring even?

Each round runs each tree's engine in a process of its own (the tree first on its PYTHONPATH, its own native library),
in turn, the first one alternating between rounds: it loads the model, decodes one warm-up reply, then `--replies`
greedy replies of `--tokens` tokens (end-of-generation ignored, MTP as `--mtp`) and prints its microseconds per decoded
token (from the final Stats). bench/identity.py checks the bits; this checks the time.

    python bench/ab_trees.py A_TREE B_TREE --model M.gguf [--model ...] --rounds 6 --out bench/results/ab_trees.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.decode import git_info, write_result  # noqa: E402

# Run inside each tree's process: only the engine API both trees share (engine.generate.load, Engine.generate, Stats).
CHILD = """
import json, sys
import numpy as np
from engine.generate import load
from engine.events import EngineConfig, GenerationConfig, Stats
model, tokens, replies, threads, mtp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
eng = load(None if model == "embedded" else model, EngineConfig(n_ctx=tokens + 64, n_threads=threads))
eng.tokenizer.eog_ids = frozenset()
gen = GenerationConfig(max_tokens=tokens, mtp=mtp != "off", draft=None if mtp in ("off", "auto") else int(mtp),
                       stats_interval_s=3600.0)
out = []
for r in range(replies + 1):
    eng.reset()
    prompt = np.random.default_rng(r).integers(5, 200, 8).tolist()
    final = [e for e in eng.generate(prompt, gen) if isinstance(e, Stats) and e.final][-1]
    if r:
        out.append(1e6 / final.decode_tok_s)
print(json.dumps(out))
"""


def run_tree(tree: Path, model: str, tokens: int, replies: int, threads: int, mtp: str) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", CHILD, model, str(tokens), str(replies), str(threads), mtp],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--model", action="append", required=True, help='a GGUF path, or "embedded"')
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--replies", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mtp", default="off", help='"off", "auto" or a fixed depth')
    ap.add_argument("--out", type=Path, default=Path("bench/results/ab_trees.json"))
    args = ap.parse_args()
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    result: dict = {"command": " ".join(sys.argv), "git": git_info(), "trees": {k: str(v) for k, v in trees.items()},
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "models": {}}
    for model in (m if m == "embedded" else str(Path(m).resolve()) for m in args.model):
        rounds = []
        for i in range(args.rounds):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            got = {k: run_tree(trees[k], model, args.tokens, args.replies, args.threads, args.mtp) for k in order}
            rounds.append({"first": order[0], **{f"{k}_us": got[k] for k in "ab"}})
            print(f"{Path(model).name} round {i}: a {statistics.median(got['a']):.1f} us, "
                  f"b {statistics.median(got['b']):.1f} us a token", flush=True)
        med = {k: statistics.median(us for r in rounds for us in r[f"{k}_us"]) for k in "ab"}
        per_round = [statistics.median(r["b_us"]) / statistics.median(r["a_us"]) for r in rounds]
        result["models"][model] = {"rounds": rounds, "median_us": med, "b_over_a": med["b"] / med["a"],
                                   "b_over_a_by_round": per_round,
                                   "b_over_a_spread": [min(per_round), max(per_round)]}
        print(f"{Path(model).name}: b/a {med['b'] / med['a']:.3f} (rounds {min(per_round):.3f}..{max(per_round):.3f})")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
