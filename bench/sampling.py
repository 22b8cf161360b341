"""The sampler's time per token: Sampler.sample on one logit row per vocabulary size and setting, against the
distribution's definition over the whole row (softmax of the whole row, the whole row sorted for top-p, a draw from
the whole row: how engine/sampling.py sampled until it looked at the candidates only).

    python bench/sampling.py [--vocab 8192,151936,248320] [--reps 40] [--out bench/results/sampling.json]

Rows are random logits (std 4) and a repetition penalty over 64 earlier ids where the setting has one; each figure is
the best of 3 rounds of `--reps` calls, the two forms alternating. One thread (torch.set_num_threads(1)), as a decode
step samples between the native calls.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.decode import git_info, machine_info  # noqa: E402
from engine.sampling import Sampler, SamplingConfig, apply_repetition_penalty  # noqa: E402

SETTINGS = {  # name: the setting (a Qwen3.5 card's recommendation, llama.cpp's defaults, plain temperature)
    "qwen: t0.7 top-k 20 top-p 0.8": SamplingConfig(temperature=0.7, top_k=20, top_p=0.8),
    "llama.cpp: t0.8 top-k 40 top-p 0.95 min-p 0.05 rep 1.1": SamplingConfig(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1),
    "t0.7 top-p 0.8": SamplingConfig(temperature=0.7, top_p=0.8),
    "t1.0": SamplingConfig(temperature=1.0),
}


def whole_row_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution by its definition over the whole row: cut at the k-th logit, softmax, min-p, then the
    whole row sorted for top-p (tests/test_sampling.py's reference too)."""
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, cfg.top_k).values[-1], float("-inf"))
    p = torch.softmax(x, dim=-1)
    if cfg.min_p > 0:
        p = p.masked_fill(p < cfg.min_p * p.max(), 0.0)
    if cfg.top_p < 1.0:
        sp, si = torch.sort(p, descending=True)
        p = p.index_fill(0, si[torch.cumsum(sp, 0) - sp >= cfg.top_p], 0.0)
    return p / p.sum()


def whole_row(logits: torch.Tensor, cfg: SamplingConfig, history: list[int], gen: torch.Generator) -> int:
    """One token by the definition over the whole row, drawn from the whole row."""
    p = whole_row_probs(apply_repetition_penalty(logits, history, cfg), cfg)
    return int(torch.multinomial(p, 1, generator=gen))


def per_call_us(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="8192,151936,248320")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default="bench/results/sampling.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    history = list(range(0, 640, 10))
    cases = []
    for v in (int(s) for s in args.vocab.split(",")):
        logits = torch.randn(v, generator=g) * 4
        for name, cfg in SETTINGS.items():
            sampler, gen = Sampler(SamplingConfig(**{**cfg.__dict__, "seed": 1})), torch.Generator().manual_seed(1)
            ours, whole = [], []
            for _ in range(3):
                ours.append(per_call_us(lambda: sampler.sample(logits, history), args.reps))
                whole.append(per_call_us(lambda: whole_row(logits, cfg, history, gen), args.reps))
            case = {"vocab": v, "setting": name, "sample_us": min(ours), "whole_row_us": min(whole),
                    "speedup": min(whole) / min(ours)}
            cases.append(case)
            print(f"vocab {v:>7,}  {name:<52} {case['sample_us']:8.0f} us  whole row {case['whole_row_us']:8.0f} us"
                  f"  x{case['speedup']:.1f}", flush=True)
    out = {"command": " ".join(["python", *sys.argv]), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "git": git_info(), "machine": machine_info(1), "torch": torch.__version__, "cases": cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
