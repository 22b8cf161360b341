"""MTP among batched sequences: aggregate decode tok/s of k sequences stepping together (engine.batch, what
`serve --parallel N` runs), plain against drafts verified among the rows, on agreement files.

    python bench/batch_mtp.py [--models agreement-mid:0.9,agreement-qwen35-0.8b:0.9] [--sequences 1,2,4]
                              [--tokens 96] [--rounds 3] [--threads 2] [--out bench/results/batch_mtp.json]

Settings per model and sequence count k (one `Batch` each, kept across rounds as the server keeps its batch, so
auto depths and VerifyChoice learn as they would there): `plain` (MTP off), `verify-k3` and `verify-auto` (MTP on,
every batched step verifies the drafts each sequence's depth controller chose: `Batch(verify=True)`), and
`default-auto` / `default-k3` (MTP on, `Batch(verify=None)`: VerifyChoice measures whether verifying among the
rows pays and runs the faster form; what the server does). k = 1 is a sequence alone (its own decoder, no batch
choice). Every sequence its own random 32-token prompt (bench/mtp_agreement.random_prompts' generator), `--tokens`
greedy tokens, EOS ignored; in-process, the settings alternating within each round. Aggregate tok/s = tokens
emitted after each sequence's first / wall time from the first of those; the best round counts, the median of the
rounds' ratios to `plain` of the same round is given beside. Models: `agreement-SHAPE:P`, the shape's agreement
file (bench/mtp_agreement.agreement_file at synthetic.noise_for(P), written under build/bench on first use).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.decode import git_info, machine_info, write_result  # noqa: E402

SETTINGS = {"plain": (False, None, False), "verify-k3": (True, 3, True), "verify-auto": (True, None, True),
            "default-k3": (True, 3, None), "default-auto": (True, None, None)}  # mtp, draft, Batch(verify=)
PROMPT_TOKENS = 32


def model_path(name: str) -> Path:
    from bench.mtp_agreement import agreement_file
    from bench.synthetic import noise_for

    shape, p = name.removeprefix("agreement-").split(":")
    return agreement_file(shape, 0, noise_for(shape, float(p)), ROOT / "build/bench", fresh=False)


def run(eng, batch, k: int, mtp: bool, draft: int | None, tokens: int, seed: int) -> dict:  # type: ignore[no-untyped-def]
    from engine.events import GenerationConfig, Token

    for i in range(k):
        prompt = np.random.default_rng(seed + i).integers(0, 256, PROMPT_TOKENS).tolist()
        batch.add(prompt, GenerationConfig(max_tokens=tokens, stats_interval_s=3600.0, mtp=mtp, draft=draft))
    n, t0, n0, verifies = 0, None, 0, batch.shared_verifies
    firsts: set = set()
    while batch.active:
        for s, ev in batch.step():
            if isinstance(ev, Token):
                if s not in firsts:  # a sequence's first token comes with its prefill
                    firsts.add(s)
                    if t0 is None:
                        t0 = time.perf_counter()
                    continue
                n += len(ev.ids)
    seconds = time.perf_counter() - (t0 or time.perf_counter())
    return {"tok_s": n / max(seconds, 1e-9), "tokens": n, "seconds": seconds,
            "shared_verifies": batch.shared_verifies - verifies}


def model_case(name: str, ks: list[int], rounds: int, tokens: int, threads: int) -> dict:
    from engine.batch import Batch
    from engine.generate import EngineConfig, load

    path = model_path(name)
    eng = load(path, EngineConfig(n_ctx=PROMPT_TOKENS + tokens + 32, n_threads=threads))
    eng.tokenizer.eog_ids = frozenset()  # EOS ignored: every reply decodes `tokens`
    out: dict = {"model": str(path.relative_to(ROOT)), "by_sequences": {}}
    for k in ks:
        batches = {s: Batch(eng, max(ks), verify=v) for s, (_, _, v) in SETTINGS.items()}
        runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        run(eng, batches["plain"], k, False, None, 8, 999)  # warm-up
        for r in range(rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
            for s in order:
                mtp, draft, _ = SETTINGS[s]
                runs[s].append(run(eng, batches[s], k, mtp, draft, tokens, 1000 + 10 * r))
                print(f"{name} k={k} round {r} {s}: {runs[s][-1]['tok_s']:.1f} tok/s "
                      f"({runs[s][-1]['shared_verifies']} shared verifies)", flush=True)
        summary = {s: {"tok_s": max(x["tok_s"] for x in v),
                       "x_plain_median": statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(v, runs["plain"]))}
                   for s, v in runs.items()}
        choice = batches["default-auto"].verify_choice
        out["by_sequences"][str(k)] = {
            "summary": summary, "rounds": runs,
            "verify_choice_window_tok_s": {("verify" if f else "plain"): list(v)
                                           for (kk, f), v in choice.rates.items() if kk == k}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="agreement-mid:0.9,agreement-qwen35-0.8b:0.9")
    ap.add_argument("--sequences", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/batch_mtp.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"command": "python bench/batch_mtp.py " + " ".join(sys.argv[1:]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
                    "machine": machine_info(args.threads), "settings": {s: {"mtp": m, "draft": d, "verify": v}
                                                                        for s, (m, d, v) in SETTINGS.items()},
                    "tokens": args.tokens, "cases": {}}
    for name in args.models.split(","):
        result["cases"][name] = model_case(name, [int(k) for k in args.sequences.split(",")], args.rounds,
                                           args.tokens, args.threads)
        write_result(result, args.out)


if __name__ == "__main__":
    main()
