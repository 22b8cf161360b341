"""Decode speed with MTP speculation off, at fixed depths and auto, with acceptance by depth.

    python bench/mtp.py [--model PATH ...] [--tokens 64] [--rounds 2] [--out bench/results/mtp.json]

Default models: the mid-size synthetic MoE (random weights: acceptance ≈ 0, so this shows the overhead
and auto's fallback) and the embedded default model when one is installed. MTP off and auto alternate
over several rounds so a noisy machine affects them alike (their ratio is the overhead check: auto must
stay ≥ 0.97× off when drafts are never accepted); fixed depths run once. Greedy decoding, fixed prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.generate import EngineConfig, GenerationConfig, Stats, load  # noqa: E402

SETTINGS: list[tuple[str, bool, int | None]] = [("off", False, None), ("k1", True, 1), ("k2", True, 2),
                                                ("k3", True, 3), ("k4", True, 4), ("auto", True, None)]


def run_once(eng, prompt: list[int], n: int, mtp: bool, draft: int | None) -> Stats:
    eng.reset()
    final = None
    for ev in eng.generate(prompt, GenerationConfig(max_tokens=n, mtp=mtp, draft=draft)):
        if isinstance(ev, Stats) and ev.final:
            final = ev
    assert final is not None
    return final


def bench_model(path: Path, prompts: list[list[int]], n: int, rounds: int) -> dict:
    eng = load(path, EngineConfig(n_ctx=1024))
    eng.tokenizer.eog_ids = frozenset()  # measure full-length runs
    rows: dict[str, list[Stats]] = {name: [] for name, _, _ in SETTINGS}
    # off and auto alternate over several rounds (their ratio is the overhead check); fixed depths once.
    for r in range(rounds):
        for prompt in prompts:
            for name, mtp, draft in SETTINGS:
                if r == 0 or name in ("off", "auto"):
                    rows[name].append(run_once(eng, prompt, n, mtp, draft))
    out = {}
    base = statistics.median(s.decode_tok_s for s in rows["off"])
    for name, stats in rows.items():
        tps = statistics.median(s.decode_tok_s for s in stats)
        entry = {"decode_tok_s": tps, "speedup_over_off": tps / base, "runs": len(stats)}
        sp = [s.speculative for s in stats if s.speculative]
        if sp:
            drafted = sum(x["drafted"] for x in sp)
            accepted = sum(x["accepted"] for x in sp)
            tried = np.sum([x["acceptance_by_depth"] for x in sp], axis=0) if sp else []
            entry.update({
                "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
                "mean_accepted_length": statistics.mean(x["mean_accepted_length"] for x in sp),
                "acceptance_by_depth_mean_over_runs": (tried / len(sp)).tolist(),
                "verify_steps": sum(x["verify_steps"] for x in sp), "plain_steps": sum(x["plain_steps"] for x in sp),
            })
        out[name] = entry
        print(path.name, name, json.dumps(entry), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="GGUF path (repeatable)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of off/auto (fixed depths run once)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/mtp.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = [Path(m) for m in args.model] if args.model else []
    if not models:
        from bench.synthetic import cached

        models.append(cached("mid", ROOT / "build/bench"))
        embedded = sorted((ROOT / "resources" / "models").glob("*.gguf"))
        models += embedded[-1:]
    prompts = [np.random.default_rng(i).integers(0, 250, 32).tolist() for i in range(2)]
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": args.threads, "load_avg_at_start": os.getloadavg()[0], "decode_tokens": args.tokens,
        "models": {p.name: bench_model(p, prompts, args.tokens, args.rounds) for p in models},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
