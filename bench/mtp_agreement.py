"""First-position agreement of bench/synthetic.py's agreement files, measured on both engines.

    python bench/mtp_agreement.py calibrate [--shapes mid,qwen35-9b,qwen36-35b,tiny-mtp] [--levels 0,0.001,...]
                                            [--prompts 8] [--tokens 128]
    python bench/mtp_agreement.py check [--shapes ...] [--p 0,0.6,0.8,0.9,0.99] [--layers 4] [--prompts 4]
                                        [--tokens 64]

Both update bench/results/mtp_agreement.json (only the entries of the shapes they ran).

calibrate: the shape with CALIBRATION_LAYERS trunk layers (the same token map as the whole file: the tensors that
make it are drawn from streams of their own, and the other layers add exact zeros), written at the first level, its
eh_proj rewritten in place for each next one; our engine decodes `--prompts` random prompts greedily, MTP at depth 1,
`--tokens` tokens each: agreement = accepted / drafted. `synthetic.noise_for` interpolates the table.

check: for each P, the file at `noise_for(P)` (`--layers` trunk layers; 0: the shape's own). Ours: agreement at depth
1, the distinct tokens of each greedy run, and whether greedy tokens with MTP equal those without. llama.cpp: its
server's draft-mtp at n_max 1 (bench/decode.py's child, a process of its own): accepted / drafted; where
llama-cpp-python is installed (tests/oracle_llama.py), also its plain greedy tokens: their distinct count and the
share equal to ours. EOS is ignored and decoding is greedy throughout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import git_info, run_child, write_result  # noqa: E402
from bench.synthetic import CALIBRATION, SHAPES, Agreement, noise_for, set_mtp_noise, write_synthetic  # noqa: E402

CALIBRATION_LAYERS = 4  # one full-attention period: the live layer is a full-attention layer, as in every shape
LEVELS = (0.0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512)
PROMPT_TOKENS = 16


def random_prompts(n: int) -> list[list[int]]:
    """`n` fixed prompts of random byte tokens (every vocabulary here has them)."""
    return [np.random.default_rng(1000 + i).integers(0, 256, PROMPT_TOKENS).tolist() for i in range(n)]


def agreement_file(name: str, layers: int, agreement: Agreement, directory: Path, fresh: bool) -> Path:
    """Shape `name` with `layers` trunk layers (0: its own) at `agreement`: written where `fresh` (a file left by
    another version of the writer would otherwise be used) or missing, else only its eh_proj rewritten
    (set_mtp_noise)."""
    s = SHAPES[name] if not layers else replace(SHAPES[name], n_layer=layers)
    path = directory / f"agreement-{name}-{s.n_layer}.gguf"
    if path.exists() and not fresh:
        set_mtp_noise(path, s, agreement)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        # the old file goes first: the 35B-A3B shape's is 22 GB, twice that did not fit beside the rest on our host
        path.unlink(missing_ok=True)
        tmp = path.with_suffix(".tmp")
        try:
            write_synthetic(tmp, s, agreement=agreement).replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a half-written file (a full disk, a stopped run) is not left behind
            raise
    return path


def greedy_runs(path: Path, prompts: list[list[int]], n: int, threads: int,
                with_plain: bool) -> tuple[dict, list[list[int]]]:
    """Our engine's greedy runs with MTP at depth 1 (and without MTP where `with_plain`): the figures, and the tokens
    of each run with MTP."""
    from engine.generate import EngineConfig, load
    from engine.sampling import SamplingConfig
    from tests.generation import collect

    eng = load(path, EngineConfig(n_ctx=PROMPT_TOKENS + n + 16, n_threads=threads))
    eng.tokenizer.eog_ids = frozenset()  # EOS ignored: every run decodes n tokens
    kw = dict(max_tokens=n, sampling=SamplingConfig(temperature=0.0, top_k=1), stats_interval_s=3600.0)
    drafted = accepted = 0
    runs, identical = [], []
    for prompt in prompts:
        eng.reset()
        toks, _, final, _ = collect(eng, prompt, mtp=True, draft=1, **kw)
        drafted += final.speculative.drafted
        accepted += final.speculative.accepted
        runs.append(toks)
        if with_plain:
            eng.reset()
            identical.append(collect(eng, prompt, mtp=False, **kw)[0] == toks)
    out = {"agreement": accepted / drafted, "drafted": drafted, "accepted": accepted,
           "distinct_tokens": [len(set(t)) for t in runs], "tokens_per_run": n}
    if with_plain:
        out["greedy_identical_with_mtp"] = all(identical)
    return out, runs


def llama_agreement(path: Path, prompts: list[list[int]], n: int, threads: int, ours: list[list[int]]) -> dict:
    """llama.cpp's draft-mtp at n_max 1 in its own process (accepted / drafted), and where the oracle is installed
    its plain greedy tokens against ours."""
    spec = {"model": str(path), "prompts": prompts, "warmup_prompt": prompts[0], "n": n, "threads": threads,
            "warmup": False, "n_ctx": PROMPT_TOKENS + n + 16, "mtp": True, "draft": 1}
    res = run_child("llama", spec, False, 1800.0)
    drafted = sum(p["drafted"] for p in res["prompts"])
    accepted = sum(p["accepted"] for p in res["prompts"])
    out: dict = {"agreement": accepted / drafted, "drafted": drafted, "accepted": accepted,
                 "source": "xllamacpp server, draft-mtp n_max 1"}
    try:
        from tests.oracle_llama import llama_greedy
    except ImportError:
        out["oracle"] = "llama-cpp-python not installed"
        return out
    runs = [llama_greedy(path, p, n, threads)[0] for p in prompts]
    out["oracle_distinct_tokens"] = [len(set(t)) for t in runs]
    out["oracle_share_equal_to_ours"] = float(np.mean([np.mean(np.equal(a, b)) for a, b in zip(runs, ours)]))
    return out


def calibration_rows(name: str, levels: list[float], prompts: int, tokens: int, threads: int,
                     directory: Path) -> Iterator[dict]:
    for i, noise in enumerate(levels):
        path = agreement_file(name, CALIBRATION_LAYERS, Agreement(noise), directory, fresh=i == 0)
        t0 = time.perf_counter()
        fig, _ = greedy_runs(path, random_prompts(prompts), tokens, threads, with_plain=False)
        print(f"[{name}] noise {noise:<7g} agreement {fig['agreement']:.3f} ({fig['accepted']}/{fig['drafted']}), "
              f"distinct tokens {fig['distinct_tokens']} ({time.perf_counter() - t0:.0f} s)", flush=True)
        yield {"noise": noise, **fig}


def check_rows(name: str, ps: list[float], layers: int, prompts: int, tokens: int, threads: int,
               directory: Path) -> Iterator[dict]:
    for i, p in enumerate(ps):
        a = noise_for(name, p)
        path = agreement_file(name, layers, a, directory, fresh=i == 0)
        ours, runs = greedy_runs(path, random_prompts(prompts), tokens, threads, with_plain=True)
        ref = llama_agreement(path, random_prompts(prompts), tokens, threads, runs)
        print(f"[{name}] P {p:<4g} noise {a.noise}: ours {ours['agreement']:.3f} ({ours['accepted']}/"
              f"{ours['drafted']}), llama.cpp {ref['agreement']:.3f} ({ref['accepted']}/{ref['drafted']}); distinct "
              f"tokens {ours['distinct_tokens']}, greedy identical with MTP: {ours['greedy_identical_with_mtp']}"
              + (f", oracle equal to ours {ref['oracle_share_equal_to_ours']:.3f}"
                 if "oracle_share_equal_to_ours" in ref else ""), flush=True)
        yield {"p": p, "noise": a.noise, "ours": ours, "llama_cpp": ref}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["calibrate", "check"])
    ap.add_argument("--shapes", default="mid,qwen35-9b,qwen36-35b,tiny-mtp")
    ap.add_argument("--levels", default=",".join(f"{x:g}" for x in LEVELS), help="calibrate: noise levels")
    ap.add_argument("--p", default="0,0.6,0.8,0.9,0.99", help="check: agreements asked for")
    ap.add_argument("--layers", type=int, default=CALIBRATION_LAYERS, help="check: trunk layers (0: the shape's)")
    ap.add_argument("--prompts", type=int, help="default: 8 (calibrate), 4 (check)")
    ap.add_argument("--tokens", type=int, help="default: 128 (calibrate), 64 (check)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=str(ROOT / "build/bench"), help="where the files are written")
    ap.add_argument("--out", default=str(CALIBRATION))
    args = ap.parse_args()
    out, calibrating = Path(args.out), args.command == "calibrate"
    prompts, tokens = args.prompts or (8 if calibrating else 4), args.tokens or (128 if calibrating else 64)
    stamp = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
             "command": " ".join(["python", "bench/mtp_agreement.py", *sys.argv[1:]]),
             "prompts": prompts, "tokens_per_run": tokens, "threads": args.threads}
    for name in args.shapes.split(","):
        if calibrating:
            rows = calibration_rows(name, [float(x) for x in args.levels.split(",")], prompts, tokens, args.threads,
                                    Path(args.dir))
            entry: dict = {**stamp, "trunk_layers": CALIBRATION_LAYERS, "levels": []}
        else:
            rows = check_rows(name, [float(x) for x in args.p.split(",")], args.layers, prompts, tokens,
                              args.threads, Path(args.dir))
            entry = {**stamp, "trunk_layers": args.layers or SHAPES[name].n_layer, "rows": []}
        for row in rows:
            entry["levels" if calibrating else "rows"].append(row)
            # after each row, the file read again: only this shape's entry changes, whatever another run wrote
            result = json.loads(out.read_text()) if out.exists() else {"calibration": {}, "check": {}}
            result["calibration" if calibrating else "check"][name] = entry
            write_result(result, out)


if __name__ == "__main__":
    main()
