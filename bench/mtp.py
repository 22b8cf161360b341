"""Decode speed with MTP speculation off, at fixed depths and auto, with acceptance by depth.

    python bench/mtp.py [--model PATH ...] [--prompts 48] [--tokens 64] [--rounds 2] [--threads N]
                        [--out bench/results/mtp.json]
    python bench/mtp.py --threads 1 --out bench/results/mtp_1thread.json   # one core
    python bench/mtp.py --model resources/models/foretell-demo.gguf --settings auto --rounds 6   # auto against off

Two workloads:
* the embedded default model answering the first `--prompts` held-out evaluation prompts
  (`engine.training.data.eval_prompts`, the chat turns it was trained for; replies end at EOS as in the
  app, at most 64 tokens);
* the mid-size synthetic MoE (random weights: acceptance ≈ 0, so it shows the overhead of drafting and
  auto's fallback), `--random-prompts` fixed random prompts, EOS ignored, `--random-tokens` tokens each,
  settings off / K=1 / auto (a decode step of this model is ~50× the embedded model's).
Each setting's speed is all decoded tokens over all decode time (everything after the first token, so
prefill is excluded: with MTP on, the head's pass over the prompt runs with prefill, and the mean time to
first token is reported beside), summed over the prompts; settings alternate prompt by prompt, in an order rotated
from prompt to prompt, over `--rounds` rounds so a noisy machine affects them alike; the best round counts,
and the ratio over all rounds and the median over rounds of each round's ratio (paired) are given too. Greedy decoding throughout.
"""
from __future__ import annotations

import argparse
import dataclasses
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

from bench.decode import git_info  # noqa: E402
from engine.chat import Message  # noqa: E402
from engine.generate import EngineConfig, GenerationConfig, Stats, load  # noqa: E402
from engine.events import MAX_DRAFT  # noqa: E402

SETTINGS: list[tuple[str, bool, int | None]] = [("off", False, None), ("k1", True, 1), ("k2", True, 2),
                                                ("k3", True, 3), ("k4", True, 4), ("auto", True, None)]


def run_once(eng, prompt, n: int, mtp: bool, draft: int | None) -> Stats:  # type: ignore[no-untyped-def]
    eng.reset()
    final = None
    for ev in eng.generate(prompt, GenerationConfig(max_tokens=n, mtp=mtp, draft=draft)):
        if isinstance(ev, Stats) and ev.final:
            final = ev
    assert final is not None
    return final


def summarise(stats: list[Stats]) -> dict:
    tokens = sum(max(s.generated_tokens - 1, 0) for s in stats)
    seconds = sum(s.elapsed_s - s.ttft_s for s in stats)
    out: dict = {"decode_tokens": tokens, "decode_s": seconds, "decode_tok_s": tokens / seconds,
                 # prompt processing, with MTP the head's pass over the prompt too (not in decode_s)
                 "ttft_ms_mean": 1e3 * sum(s.ttft_s for s in stats) / len(stats)}
    sp = [dataclasses.asdict(s.speculative) for s in stats if s.speculative]
    if sp:
        tried = np.sum([x["tried_by_depth"] for x in sp], axis=0)
        acc = np.sum([x["accepted_by_depth"] for x in sp], axis=0)
        hist = np.sum([x["accepted_length_histogram"] for x in sp], axis=0)
        drafted = sum(x["drafted"] for x in sp)
        accepted = sum(x["accepted"] for x in sp)
        steps = sum(x["verify_steps"] for x in sp)
        k = int(np.max(np.nonzero(tried)[0], initial=-1)) + 1
        out.update({
            "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
            "acceptance_by_depth": [float(a / t) for a, t in zip(acc[:k], tried[:k])],
            "tried_by_depth": tried[:k].tolist(), "verify_steps": steps,
            "plain_steps": sum(x["plain_steps"] for x in sp),
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
            "accepted_length_histogram": hist[:k + 1].tolist() if k else [],
            "time_s": {key: sum(x["time_s"][key] for x in sp) for key in sp[0]["time_s"]},
        })
    return out


def bench_model(eng, prompts: list, n: int, rounds: int,  # type: ignore[no-untyped-def]
                settings: list[tuple[str, bool, int | None]]) -> dict:
    per_round: list[dict[str, list[Stats]]] = []
    for _ in range(rounds):
        rows: dict[str, list[Stats]] = {name: [] for name, _, _ in settings}
        for i, prompt in enumerate(prompts):
            # rotate the order prompt by prompt, so no setting always runs first or after the same one
            r = (i + len(per_round)) % len(settings)
            for name, mtp, draft in settings[r:] + settings[:r]:
                rows[name].append(run_once(eng, prompt, n, mtp, draft))
        per_round.append(rows)
    out = {}
    for name, _, _ in settings:
        summaries = [summarise(r[name]) for r in per_round]
        best = max(summaries, key=lambda s: s["decode_tok_s"])
        best["decode_tok_s_by_round"] = [s["decode_tok_s"] for s in summaries]
        best["decode_tok_s_all_rounds"] = sum(s["decode_tokens"] for s in summaries) / sum(s["decode_s"] for s in summaries)
        out[name] = best
    base, base_all = out["off"]["decode_tok_s"], out["off"]["decode_tok_s_all_rounds"]
    for name, entry in out.items():
        entry["speedup_over_off"] = entry["decode_tok_s"] / base
        # the same ratio over every round: less at the mercy of one lucky round when the host's speed drifts
        entry["speedup_over_off_all_rounds"] = entry["decode_tok_s_all_rounds"] / base_all
        # paired: within a round the settings alternate prompt by prompt, so a round's ratio compares like with
        # like; the median over rounds is the figure least moved by the host's drift between rounds
        entry["speedup_over_off_median_round"] = float(np.median(
            [a / b for a, b in zip(entry["decode_tok_s_by_round"], out["off"]["decode_tok_s_by_round"])]))
        print(f"  {name:<5} {entry['decode_tok_s']:8.1f} tok/s  ×{entry['speedup_over_off']:.2f}"
              f" (all rounds ×{entry['speedup_over_off_all_rounds']:.2f},"
              f" median round ×{entry['speedup_over_off_median_round']:.2f})"
              + (f"  acceptance by depth {[round(a, 3) for a in entry['acceptance_by_depth']]}"
                 if "acceptance_by_depth" in entry else ""), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="GGUF path (repeatable; default: the mid-size "
                    "synthetic MoE and the embedded model)")
    ap.add_argument("--prompts", type=int, default=48, help="evaluation prompts for the embedded model")
    ap.add_argument("--tokens", type=int, default=64, help="max new tokens per prompt (embedded model)")
    ap.add_argument("--random-prompts", type=int, default=6, help="prompts for random-weight models")
    ap.add_argument("--random-tokens", type=int, default=24, help="new tokens per prompt for random-weight models")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads (default: every core, as the app runs)")
    ap.add_argument("--settings", default=",".join(name for name, _, _ in SETTINGS),
                    help="the settings to run, of " + ", ".join(name for name, _, _ in SETTINGS) + " (off always runs)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/mtp.json"))
    args = ap.parse_args()
    chosen = {"off", *args.settings.split(",")}
    if not chosen <= {name for name, _, _ in SETTINGS}:
        ap.error(f"--settings: unknown {sorted(chosen - {name for name, _, _ in SETTINGS})}")
    torch.set_num_threads(args.threads)
    from bench.synthetic import cached
    from engine.storage.modelfile import default_model_path
    from engine.training.data import eval_prompts

    models = [Path(m) for m in args.model] if args.model else [default_model_path(),
                                                               cached("mid", ROOT / "build/bench")]
    results = {}
    for path in models:
        eng = load(path, EngineConfig(n_ctx=1024, n_threads=args.threads))
        if path.resolve() == default_model_path().resolve():  # the embedded model: chat prompts
            items = eval_prompts(240)[:args.prompts]
            prompts = [[Message(m.role, m.content) for m in it.messages] for it in items]
            workload = f"first {len(prompts)} held-out evaluation prompts, replies end at EOS (≤ {args.tokens} tokens)"
            n, settings = args.tokens, [x for x in SETTINGS if x[0] in chosen]
        else:  # random weights: fixed random prompts, full-length runs
            eng.tokenizer.eog_ids = frozenset()
            prompts = [np.random.default_rng(i).integers(0, 250, 32).tolist() for i in range(args.random_prompts)]
            n = args.random_tokens
            workload = f"{len(prompts)} random 32-token prompts, {n} new tokens each, EOS ignored"
            settings = [x for x in SETTINGS if x[0] in ("off", "k1", "auto") and x[0] in chosen]
        print(f"{path.name}: {workload}", flush=True)
        results[path.name] = {"workload": workload, "settings": bench_model(eng, prompts, n, args.rounds, settings)}
    result = {
        "command": " ".join(["python", "bench/mtp.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
        "machine": {"cpu": platform.machine(), "cores": os.cpu_count(), "threads": args.threads,
                    "load_avg_at_start": os.getloadavg()[0]},
        "max_depth": MAX_DRAFT, "max_new_tokens": args.tokens, "rounds": args.rounds, "decoding": "greedy",
        "models": results,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
