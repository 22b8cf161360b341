"""A fused decode step on a fixed thread count against the count engine/ops/thread_choice.py chooses, alternating in
one process, with the host's placement measured before each pair.

    python bench/thread_choice.py [--model embedded|mid|PATH] [--seconds 90] [--tokens 200] [--threads 2]
                                  [--out bench/results/thread_choice_<model>.json]

Each iteration: the machine's read bandwidth on 1 and on `--threads` threads (bench/step_profile.py's ReadBandwidth:
torch.sum over a 512 MiB float32 buffer, best of 3), then one greedy reply of `--tokens` tokens (EOS ignored, a fixed
prompt) with the step's thread choice replaced by one that always answers `--threads`, and one with the engine's
own choice (kept across iterations, as an engine keeps it), which goes first alternating by iteration. Per reply: µs per decoded token (the first token's step
excluded), and the chosen count after it. Iterations are split by bench/step_profile.py's placement: "split" where
`--threads` threads read over 1.5 times one thread (each core its own memory path), "contended" where they read less
than one thread (a core taken by something outside the process: the host's other tenants), else "shared"; the
medians of each are the summary. `--resummarize PATH` recomputes an earlier result's summary from its iterations by these rules.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import engine  # noqa: E402,F401  (first, as the app and the CLI import it: torch's OpenMP wait policy)
from bench.decode import git_info, machine_info, write_result  # noqa: E402
from bench.step_profile import ReadBandwidth, placement  # noqa: E402
from engine.events import EngineConfig, GenerationConfig, Token  # noqa: E402
from engine.generate import load  # noqa: E402
from engine.ops.thread_choice import ThreadChoice  # noqa: E402
from engine.sampling import SamplingConfig  # noqa: E402

EMBEDDED = ROOT / "resources/models/foretell-demo.gguf"
def summarize(rows: list[dict], threads: int) -> dict:
    out = {}
    for pl in ("shared", "split", "contended"):
        sel = [r for r in rows if placement(r[f"read_gb_s_{threads}"], r["read_gb_s_1"]) == pl]
        if sel:
            fm, cm = statistics.median(r["fixed_us"] for r in sel), statistics.median(r["chosen_us"] for r in sel)
            out[pl] = {"iterations": len(sel), "fixed_us_median": fm, "chosen_us_median": cm,
                       "chosen_over_fixed": cm / fm}
    return out


class Fixed(ThreadChoice):
    """Always the backend's count: the step as it ran before the choice."""

    def pick(self, n: int, threads: int) -> int:
        return threads

    def observe(self, n: int, threads: int, ns: int) -> None:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--resummarize", help="an earlier result's JSON: its summary recomputed from its iterations")
    args = ap.parse_args()
    if args.resummarize:
        d = json.loads(Path(args.resummarize).read_text())
        for r in d["iterations"]:
            r["placement"] = placement(r[f"read_gb_s_{d['threads']}"], r["read_gb_s_1"])
        d["summary"] = summarize(d["iterations"], d["threads"])
        d["resummarized"] = "python bench/thread_choice.py --resummarize " + args.resummarize
        write_result(d, Path(args.resummarize))
        return
    if args.model == "embedded":
        path = EMBEDDED
    elif args.model == "mid":  # bench/synthetic.py's mid-size MoE, written once (as bench/decode.py does)
        from bench.synthetic import cached
        path = cached("mid", ROOT / "build/bench")
    else:
        path = Path(args.model)
    torch.set_num_threads(args.threads)
    eng = load(str(path), EngineConfig(n_ctx=args.tokens + 128, n_threads=args.threads))
    eng.tokenizer.eog_ids = frozenset()  # every reply decodes exactly its tokens
    greedy = SamplingConfig(temperature=0.0, top_k=1)
    prompt = list(range(300, 364)) if args.model != "embedded" else \
        eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. Once upon a time")
    read = ReadBandwidth(512, 3)

    def read_gb_s(threads: int) -> float:
        return read(threads)["best_gb_s"]

    def reply_us() -> float:
        eng.reset()
        k, t0 = 0, 0
        for ev in eng.generate(prompt, GenerationConfig(max_tokens=args.tokens, sampling=greedy, mtp=False,
                                                        stats_interval_s=3600.0)):
            if isinstance(ev, Token):
                k += len(ev.ids)
                if k == 1:
                    t0 = time.perf_counter_ns()
        return (time.perf_counter_ns() - t0) / (k - 1) / 1e3

    reply_us()  # warm-up
    step = eng.runner.step
    if not step:
        raise SystemExit("bench/thread_choice.py: this model's decode step is not fused (no native backend?)")
    chosen, fixed = step.threads, Fixed()
    rows = []
    end = time.time() + args.seconds
    while time.time() < end:
        one, all_ = read_gb_s(1), read_gb_s(args.threads)
        got = {}
        for who in (("fixed", "chosen") if len(rows) % 2 == 0 else ("chosen", "fixed")):  # each first in turn
            step.threads = fixed if who == "fixed" else chosen
            got[who] = reply_us()
        f, c = got["fixed"], got["chosen"]
        step.threads = chosen
        rows.append({"read_gb_s_1": round(one, 2), f"read_gb_s_{args.threads}": round(all_, 2),
                     "placement": placement(all_, one), "fixed_us": round(f, 2),
                     "chosen_us": round(c, 2), "chosen_count": chosen.current(1), "switches": chosen.switches})
        print(json.dumps(rows[-1]), flush=True)
    summary = summarize(rows, args.threads)
    result = {"command": "python bench/thread_choice.py " + " ".join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
              "machine": machine_info(args.threads), "model": path.name, "tokens": args.tokens,
              "threads": args.threads, "summary": summary, "iterations": rows}
    for pl, s in summary.items():
        print(f"{pl}: {s['iterations']} iterations, fixed {s['fixed_us_median']:.1f} us a token, chosen "
              f"{s['chosen_us_median']:.1f} (x{s['chosen_over_fixed']:.3f})")
    write_result(result, Path(args.out or ROOT / f"bench/results/thread_choice_{args.model}.json"))


if __name__ == "__main__":
    main()
