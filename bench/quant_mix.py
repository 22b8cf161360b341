"""Decode and prefill in the popular quantization mixes, ours vs llama.cpp on the same files, and ours per ISA form.

    python bench/quant_mix.py [--shape mid] [--mixes UD-Q4_K_M,Q5_K_M,IQ4_XS,Q3_K_M,Q2_K,MXFP4_MOE] [--threads 2]
                              [--rounds 3] [--prompt 128] [--decode 64] [--out bench/results/quant_mix.json]

The committed bench/results/quant_mix.json is made on a quiet machine by exactly:

    python bench/quant_mix.py --shape mid --rounds 3

The model: bench/synthetic.py's mid-size MoE (24 layers, 64 experts top-8, hidden 1024, random weights) written in
F16, then quantized by llama.cpp itself (`llama_model_quantize`, tests/quantized.py) into each mix: UD-Q4_K_M-like
(the Q4_K_M ftype with tensor-type overrides: Q8_0 attention, GDN and shared expert, Q4_K routed gate/up, Q5_K
routed down), Q5_K_M, IQ4_XS, Q3_K_M, Q2_K, MXFP4_MOE. The JSON records the types each file holds per role and
which of them take no native product on our default backend (engine.ops.coverage: the same notice `inspect` and
the CLI print).

Runs reuse bench/decode.py's machinery: every (engine, setting) run is a process of its own from a fresh load with
`--threads` threads, warmed up by 4 untimed tokens, plain greedy decode (no MTP: random weights accept no drafts),
EOS ignored; llama.cpp is its server in-process (xllamacpp). Within a round the runs alternate and which engine
goes first alternates by round; each run's best round counts. "ours" is our default backend; `native-<isa>` rows
are ours forced to each instruction-set form this CPU runs (an AVX2-only desktop gets the native-avx2 row); forms
the CPU lacks are listed as unavailable, not run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import best_of, git_info, machine_info, run_child, summarise  # noqa: E402

MIXES = ("UD-Q4_K_M", "Q5_K_M", "IQ4_XS", "Q3_K_M", "Q2_K", "MXFP4_MOE")


def quantized_mix(src: Path, mix: str) -> Path:
    """`src` (F16) quantized by llama.cpp into `mix`, written once beside it."""
    from tests.quantized import UD_Q4_K_M, llama_quantize

    out = src.with_name(f"{src.stem.removesuffix('-f16')}-{mix}.gguf")
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        if mix == "UD-Q4_K_M":
            llama_quantize(src, tmp, "Q4_K_M", overrides=UD_Q4_K_M, threads=os.cpu_count() or 2)
        else:
            llama_quantize(src, tmp, mix, threads=os.cpu_count() or 2)
        tmp.replace(out)
    return out


def file_facts(path: Path) -> dict:
    """Types per role, and what takes no native product on the default backend."""
    from engine import ops
    from engine.models.build import load_model
    from engine.ops.coverage import product_coverage
    from engine.storage.modelfile import open_model
    from tests.quantized import tensor_roles

    backend = ops.default_backend()
    cov = product_coverage(load_model(open_model(path), n_ctx=16, backend=backend), backend.name)
    return {"file": path.name, "bytes": path.stat().st_size, "types": tensor_roles(path), "products": cov.as_dict()}


def our_forms() -> tuple[list[str], list[str]]:
    """Our native ISA forms this CPU runs, and those it does not."""
    from engine import ops
    from engine.ops.backend import NATIVE_ISAS

    have = [b.name for b in ops.available_backends() if b.native]
    return have, [f"native-{isa}" for isa in NATIVE_ISAS if f"native-{isa}" not in have]


def run_mix(path: Path, forms: list[str], args: argparse.Namespace) -> dict:
    prompt = np.random.default_rng(0).integers(0, 500, args.prompt).tolist()
    warm = np.random.default_rng(1).integers(0, 500, 16).tolist()
    base = {"model": str(path), "prompts": [prompt], "warmup_prompt": warm, "n": args.decode, "threads": args.threads,
            "warmup": True, "n_ctx": args.prompt + args.decode + 64, "mtp": False, "draft": None}
    from engine import ops

    default = ops.default_backend().name  # "ours" runs it: its form is not run twice
    runs = {"llama_cpp": ("llama", None), "ours": ("ours", None), **{f: ("ours", f) for f in forms if f != default}}
    rounds: list[dict] = []
    for r in range(args.rounds):
        names = list(runs) if r % 2 == 0 else list(reversed(runs))
        rd = {}
        for name in names:
            child, backend = runs[name]
            res = run_child(child, {**base, "backend": backend}, False, args.child_timeout)
            rd[name] = summarise(res)
            rd[name]["backend"] = res["backend"]
            print(f"[{path.name}] round {r} {name:<18}: decode {rd[name]['decode_tok_s']:8.2f} tok/s, prefill "
                  f"{rd[name]['prefill_tok_s']:8.1f} tok/s", flush=True)
        rounds.append(rd)
    best = {name: best_of([rd[name] for rd in rounds]) for name in runs}
    ref = best["llama_cpp"]
    return {"runs": best,
            "ours_over_llama_cpp": {name: {"decode": b["decode_tok_s"] / ref["decode_tok_s"],
                                           "prefill": b["prefill_tok_s"] / ref["prefill_tok_s"]}
                                    for name, b in best.items() if name != "llama_cpp"},
            "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="mid", choices=["mid", "tiny"], help="bench/synthetic.py shape")
    ap.add_argument("--mixes", default=",".join(MIXES), help="comma-separated, of " + ", ".join(MIXES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded")
    ap.add_argument("--child-timeout", type=float, default=1800.0)
    ap.add_argument("--dir", default=str(ROOT / "build/bench"), help="where the model files are written")
    ap.add_argument("--out", default=str(ROOT / "bench/results/quant_mix.json"))
    args = ap.parse_args()
    mixes = [m for m in args.mixes.split(",") if m]
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        ap.error(f"unknown mix {unknown[0]} (one of {', '.join(MIXES)})")

    import xllamacpp

    from bench.synthetic import SHAPES, cached

    t0 = time.perf_counter()
    forms, missing = our_forms()
    src = cached(args.shape, args.dir, float_source=True)
    result: dict = {
        "command": " ".join(["python", "bench/quant_mix.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
        "machine": machine_info(args.threads),
        "llama_cpp": f"xllamacpp {xllamacpp.__version__} ({xllamacpp.get_system_info().strip()})",
        "model": {"shape": args.shape, **SHAPES[args.shape].__dict__, "source": src.name},
        "settings": {"threads": args.threads, "rounds": args.rounds, "prompt": args.prompt, "decode": args.decode,
                     "decoding": "greedy, plain (no MTP), EOS ignored, 4 warm-up tokens"},
        "our_forms": forms, "our_forms_unavailable_on_this_cpu": missing, "mixes": {},
    }
    paths = {mix: quantized_mix(src, mix) for mix in mixes}
    facts = {mix: file_facts(p) for mix, p in paths.items()}
    for mix, path in paths.items():
        print(f"== {mix}: {path.name}", flush=True)
        result["mixes"][mix] = {**facts[mix], **run_mix(path, forms, args)}
    result["machine"]["load_avg_at_end"] = list(os.getloadavg())
    result["duration_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for mix, m in result["mixes"].items():
        q = m["ours_over_llama_cpp"]
        print(f"{mix:<10} llama.cpp {m['runs']['llama_cpp']['decode_tok_s']:7.2f} tok/s; ours "
              + ", ".join(f"{k} ×{v['decode']:.2f}" for k, v in q.items()))
    print(f"wrote {args.out} ({result['duration_s']:.0f} s)")


if __name__ == "__main__":
    main()
