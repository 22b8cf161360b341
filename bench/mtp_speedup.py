"""MTP speedup by MTP agreement, ours and llama.cpp's draft-mtp, on bench/synthetic.py's agreement files.

    python bench/mtp_speedup.py [--shapes mid,qwen35-9b,qwen36-35b] [--p 0,0.6,0.8,0.9,0.99] [--rounds 2]
                                [--depths 1,...,8] [--llama-depths 1,2,3,4] [--prompts 2] [--tokens N] [--threads 2]
                                [--warm-auto] [--out bench/results/mtp_speedup.json]
    python bench/mtp_speedup.py --quick   # tiny-mtp, P 0.9, one prompt of 16 tokens, one round, K ≤ 2

Per shape, the agreement file (bench/mtp_agreement.py's agreement_file, the shape's own depth, in --dir) is written
at the first P and only its eh_proj rewritten for each next one (P = 0: a random head). Per P, in `--rounds` rounds: our plain decode, our
auto depth (and with `--warm-auto` auto starting from the auto memory an unmeasured run on two other prompts left in a
temporary directory, as a model opened a second time starts: EngineConfig.auto_memory_dir, the CLI's and the app's
default) and our fixed depths K (`--depths`), llama.cpp plain and its draft-mtp at n_max K (`--llama-depths`; the
xllamacpp server, `speculative.types = [COMMON_SPECULATIVE_TYPE_DRAFT_MTP]`). Every (engine, setting) is a process of
its own, bench/decode.py's child: a fresh load, a 4-token warm-up, `--threads` threads, greedy, EOS ignored,
`--prompts` random prompts of `--tokens` tokens (default per shape: TOKENS). Settings go in an order rotated round
by round; within a setting the engines alternate, and which goes first alternates by round.

Reported per shape and P: each setting's best round (bench/decode.py best_of) and its decode tok/s by round; the
speedup over the same engine's plain decode (best rounds, and the median of the rounds' paired ratios); acceptance
by draft position (ours from the engine's counters; llama.cpp's timings give accepted / drafted only); our verify
and draft cost in decode steps by K (a verify pass's mean time, and a drafted token's, over the plain run's time
per token in the same round). Per MoE shape once: the routed-expert bytes a verify of K+1 rows reads over all MoE
layers, beside a decode step's, from an instrumented in-process run per K (an engine.ops observer: each pass's
distinct experts, each read once; the op-by-op path, untimed).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import best_of, git_info, machine_info, run_child, summarise, write_result  # noqa: E402
from bench.mtp_agreement import PROMPT_TOKENS, agreement_file, random_prompts  # noqa: E402
from bench.synthetic import SHAPES, noise_for  # noqa: E402

TOKENS = {"mid": 128, "qwen35-9b": 48, "qwen36-35b": 64, "tiny-mtp": 16}  # decoded per prompt (a 9B step is slow)
ENGINES = ("ours", "llama_cpp")
INSTRUMENTED_TOKENS = 24  # per K, for the routed-expert bytes


WARM = "auto-warm"  # auto with the auto memory an earlier process left (--warm-auto)


def settings(depths: list[int], llama_depths: list[int],
             warm: bool = False) -> dict[str, list[tuple[str, bool, int | None]]]:
    """(name, mtp, draft) per engine; llama.cpp has no automatic depth."""
    return {"ours": [("off", False, None), ("auto", True, None)] + ([(WARM, True, None)] if warm else [])
            + [(f"k{k}", True, k) for k in depths],
            "llama_cpp": [("off", False, None)] + [(f"k{k}", True, k) for k in llama_depths]}


def acceptance_by_position(runs: list[dict]) -> list[float]:
    """Accepted / tried at each draft position, over runs' prompts (our engine's counters)."""
    ps = [p for res in runs for p in res["prompts"]]
    tried = np.sum([p["tried_by_depth"] for p in ps], axis=0)
    acc = np.sum([p["accepted_by_depth"] for p in ps], axis=0)
    return [float(a / t) for a, t in zip(acc, tried) if t]


def costs_in_steps(res: dict, plain: dict) -> dict:
    """A verify pass's mean time and a drafted token's, in units of the plain run's time per token."""
    step = plain["decode_s"] / plain["decode_tokens"]
    ps = res["prompts"]
    verify = sum(p["time_s"]["verify"] for p in ps) / max(sum(p["verify_steps"] for p in ps), 1)
    draft = sum(p["time_s"]["draft"] for p in ps) / max(sum(p["drafted"] for p in ps), 1)
    return {"verify_steps": verify / step, "draft_steps": draft / step, "plain_step_ms": 1e3 * step}


def run_p(label: str, path: Path, prompts: list[list[int]], n: int, args: argparse.Namespace) -> dict:
    """One shape at one P: every setting of both engines, in rounds."""
    table = settings(args.depths, args.llama_depths, args.warm_auto)
    names = [s[0] for s in table["ours"]]
    names += [s[0] for s in table["llama_cpp"] if s[0] not in names]  # llama.cpp's depths that ours skip
    base = {"model": str(path), "prompts": prompts, "warmup_prompt": random_prompts(len(prompts) + 1)[-1], "n": n,
            "threads": args.threads, "warmup": True, "n_ctx": PROMPT_TOKENS + n + 64}
    memory = None
    if args.warm_auto:  # an unmeasured process on other prompts leaves the auto memory the measured ones start from
        memory = tempfile.mkdtemp(prefix="auto-memory-")
        run_child("ours", {**base, "mtp": True, "draft": None, "auto_memory_dir": memory,
                           "prompts": random_prompts(len(prompts) + 3)[-2:]}, False, args.child_timeout)
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = ENGINES if r % 2 == 0 else ENGINES[::-1]
        k = r % len(names)
        raw: dict[str, dict] = {e: {} for e in ENGINES}
        for setting in names[k:] + names[:k]:
            for eng in order:
                match = [s for s in table[eng] if s[0] == setting]
                if match:
                    spec = {**base, "mtp": match[0][1], "draft": match[0][2],
                            "auto_memory_dir": memory if setting == WARM else None}
                    raw[eng][setting] = run_child("ours" if eng == "ours" else "llama", spec, False,
                                                  args.child_timeout)
                    s = summarise(raw[eng][setting])
                    print(f"[{label}] round {r} {eng:<9} {setting:<4} {s['decode_tok_s']:9.2f} "
                          f"tok/s" + (f", acceptance {s['acceptance']:.3f}" if "acceptance" in s else ""), flush=True)
        rounds.append({"order": list(order), "raw": raw,
                       **{e: {s: summarise(v) for s, v in raw[e].items()} for e in ENGINES}})
    out: dict = {}
    for e in ENGINES:
        side = {s: best_of([rd[e][s] for rd in rounds]) for s in rounds[0][e]}
        for s, entry in side.items():
            entry["speedup"] = entry["decode_tok_s"] / side["off"]["decode_tok_s"]
            entry["speedup_median_of_rounds"] = statistics.median(
                rd[e][s]["decode_tok_s"] / rd[e]["off"]["decode_tok_s"] for rd in rounds)
            if e == "ours" and s != "off":
                entry["acceptance_by_position"] = acceptance_by_position([rd["raw"][e][s] for rd in rounds])
                by_round = [costs_in_steps(rd["raw"][e][s], rd[e]["off"]) for rd in rounds]
                entry["cost_in_decode_steps"] = {key: statistics.median(c[key] for c in by_round) for key in by_round[0]}
                entry["cost_in_decode_steps_by_round"] = by_round
        out[e] = side
    out["rounds"] = [{"order": rd["order"], **{e: rd[e] for e in ENGINES}} for rd in rounds]
    if memory is not None:
        shutil.rmtree(memory, ignore_errors=True)
    return out


def routed_expert_bytes(path: Path, depths: list[int], threads: int) -> dict:
    """Weight bytes of the distinct routed experts a pass of K+1 rows reads over all trunk MoE layers (and a one-row
    decode step's), and the distinct experts per layer, from an instrumented greedy run per K: every event that
    reports a pass's distinct experts (a fused layer's or the op-by-op experts'), each expert read once."""
    from engine import ops
    from engine.generate import EngineConfig, load
    from engine.sampling import SamplingConfig
    from tests.generation import collect

    distinct: list = []  # (rows, distinct experts) per MoE layer pass
    backend = ops.default_backend().with_observer(lambda e: distinct.append((e.rows, e.experts)) if e.experts else None)
    eng = load(path, EngineConfig(n_ctx=PROMPT_TOKENS + INSTRUMENTED_TOKENS + 16, n_threads=threads, backend=backend))
    eng.tokenizer.eog_ids = frozenset()
    hp, tensors = eng.hp, eng.mf.tensors
    per_expert = sum(tensors[f"blk.0.ffn_{m}_exps.weight"].n_bytes for m in ("gate", "up", "down")) // hp.n_expert
    out: dict = {"bytes_per_expert": per_expert}
    for k in [0, *depths]:
        eng.reset()
        distinct.clear()
        collect(eng, random_prompts(1)[0], max_tokens=INSTRUMENTED_TOKENS, mtp=k > 0, draft=k or None,
                sampling=SamplingConfig(temperature=0.0, top_k=1))
        per_layer = [x for rows, x in distinct if rows == k + 1]  # a verify's K+1 rows (a catch-up of the head's alike)
        mean = statistics.fmean(per_layer)
        out["decode_step" if k == 0 else f"verify_k{k}"] = {
            "bytes": hp.n_layer * mean * per_expert, "distinct_experts_per_layer": mean, "layer_passes": len(per_layer)}
    return out


def parse_depths(text: str) -> list[int]:
    from engine.validate import draft_arg

    return [k for k in map(draft_arg, filter(None, text.split(","))) if k is not None]  # "auto" runs anyway


def main() -> None:
    from engine.validate import MAX_DRAFT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mid,qwen35-9b,qwen36-35b")
    ap.add_argument("--p", default="0,0.6,0.8,0.9,0.99", help="first-position agreements")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--depths", type=parse_depths, default=list(range(1, MAX_DRAFT + 1)), help="our fixed depths")
    ap.add_argument("--llama-depths", type=parse_depths, default=[1, 2, 3, 4], help="llama.cpp's draft-mtp n_max")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, help=f"per prompt (default per shape: {TOKENS})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child-timeout", type=float, default=3600.0, help="seconds one engine run may take")
    ap.add_argument("--dir", default=str(ROOT / "build/bench"), help="where the agreement files are written")
    ap.add_argument("--out", help="default: bench/results/mtp_speedup.json (--quick: build/bench/mtp_speedup_quick.json)")
    ap.add_argument("--warm-auto", action="store_true",
                    help=f"also {WARM}: auto starting from the auto memory (EngineConfig.auto_memory_dir, the CLI's "
                         "and app's default) an unmeasured run on two other prompts left, as a model opened again")
    ap.add_argument("--quick", action="store_true", help="tiny-mtp, P 0.9, one 16-token prompt, one round, K <= 2: "
                    "a check of the script, no figures")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.p, args.rounds, args.prompts = "tiny-mtp", "0.9", 1, 1
        args.depths, args.llama_depths = [1, 2], [1]
    out = Path(args.out or ROOT / ("build/bench/mtp_speedup_quick.json" if args.quick
                                   else "bench/results/mtp_speedup.json"))
    import xllamacpp

    t_start = time.perf_counter()
    result: dict = {
        "command": " ".join(["python", "bench/mtp_speedup.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
        "machine": machine_info(args.threads),
        "llama_cpp": {"package": f"xllamacpp {xllamacpp.__version__}",
                      "draft_p_min": xllamacpp.CommonParams().speculative.draft.p_min},
        "settings": {"rounds": args.rounds, "depths": args.depths, "llama_depths": args.llama_depths,
                     "prompts": args.prompts, "prompt_tokens": PROMPT_TOKENS, "threads": args.threads,
                     "decoding": "greedy, EOS ignored"},
        "shapes": {},
    }
    for name in args.shapes.split(","):
        n = args.tokens or TOKENS[name]
        entry: dict = {"shape": asdict(SHAPES[name]), "tokens_per_prompt": n, "p": {}}
        result["shapes"][name] = entry
        for i, p in enumerate(float(x) for x in args.p.split(",")):
            a = noise_for(name, p)
            path = agreement_file(name, 0, a, Path(args.dir), fresh=i == 0)
            if i == 0:
                entry["file"] = {"name": path.name, "bytes": path.stat().st_size}
                if SHAPES[name].n_expert:
                    entry["routed_expert_bytes"] = routed_expert_bytes(path, args.depths, args.threads)
            entry["p"][f"{p:g}"] = {"noise": a.noise,
                                    **run_p(f"{name} P {p:g}", path, random_prompts(args.prompts), n, args)}
            write_result(result, out)  # after each P: a long run keeps what it measured
    result["duration_s"] = time.perf_counter() - t_start
    write_result(result, out)


if __name__ == "__main__":
    main()
