"""Shapes × llama.cpp's own quantizations: our decode and prefill against llama.cpp's on the same file, per cell.

    python bench/sweep.py [--quick] [--shapes embedded,vocab50k,mid,...] [--quants Q8_0,Q4_K_M,...] [--threads 2]
                          [--rounds 2] [--prompt 128] [--decode 64] [--dir build/bench/sweep] [--prune]
                          [--out bench/results/sweep.json]

The committed bench/results/sweep.json is the quick subset (~10 minutes on 2 shared cores, its files already made):

    python bench/sweep.py --quick

The whole matrix (hours; quantizing the big shapes takes most of it; `--prune` deletes each shape's files once its
cells are measured, so the 35B-A3B shape's ~30 GB is the most on disk at once):

    python bench/sweep.py --prune --out bench/results/sweep_full.json

and slices of it, bench/results/sweep_9b.json and sweep_08b.json:

    python bench/sweep.py --shapes qwen35-9b --quants Q4_K_M --rounds 2 --prompt 64 --decode 32 \
        --out bench/results/sweep_9b.json
    python bench/sweep.py --shapes qwen35-0.8b --quants Q4_K_M --rounds 2 --prompt 64 --decode 32 \
        --out bench/results/sweep_08b.json

Shapes (SWEEP_SHAPES): the embedded model as shipped (already quantized; its float weights are not in the repository,
so it is one "as-is" cell); bench/synthetic.py's VOCAB50K (hidden 256, a GPT-2-size vocabulary of 50,259 rows in
the output head, 4 layers, 16 experts top-4), MID (the mid MoE), QWEN35_08B and QWEN35_2B (dense, the 248,320-token
vocabulary), QWEN35_9B (dense) and QWEN36_35B (the 35B-A3B MoE). The big ones are written with fewer layers (hidden,
heads, experts, FFN widths and the whole vocabulary kept; the JSON records the layer count) so that the F16 source
and its quantizations fit a 45 GB disk and 24 GB of memory. Each synthetic shape is written once in F16 with random
weights (bench/synthetic.write_synthetic(float_source=True)) and quantized by llama.cpp itself
(`llama_model_quantize`, tests/quantized.py), so every type choice is llama.cpp's, its fallbacks on odd row widths
included: Q8_0, Q6_K, Q5_K_M, Q4_K_M, IQ4_XS, Q3_K_M, Q2_K, MXFP4_MOE (MoE shapes only), UD-Q4_K_XL-like
(UD_Q4_K_XL below) and Q4_0 (the 32-value 4-bit type many downloads still are); by name only (`--quants`), llama.cpp's
low-bit grid-codebook mixes IQ3_XXS, IQ2_XXS, IQ2_M and IQ1_M (LOW_BIT: made with a flat importance matrix). The JSON records per file the types each role holds and what takes no native product.

Per cell (bench/quant_mix.run_mix, through bench/decode.py's child runners): every (engine, form) run is a process
of its own from a fresh load with `--threads` threads, 4 untimed warm-up tokens, one random `--prompt`-token prompt,
`--decode` greedy tokens, EOS ignored, no MTP; llama.cpp is its server in-process (xllamacpp). Within a round the
runs alternate and which engine goes first alternates by round; each run's best round counts. "ours" is our default
backend; the `native-<isa>` rows are ours forced to each instruction-set form this CPU runs (native-avx2: what an
AVX2-only desktop gets; native-avxvnni: an Intel desktop core with AVX-VNNI); forms the CPU lacks are listed as
unavailable. Which path our decode ran per form (the one-call fused step or op by op: `Runner.step_path()` where the
engine has it, else whether `Runner.step` is set) is read from a load of the same file in a process of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUANTS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "IQ4_XS", "Q3_K_M", "Q2_K", "MXFP4_MOE", "UD-Q4_K_XL", "Q4_0")
# llama.cpp's low-bit grid-codebook mixes (the IQ2_XXS/IQ3_XXS downloads of big MoE models), asked for by name only:
# llama.cpp makes them with an importance matrix (tests/quantized.py passes a flat one)
LOW_BIT = ("IQ3_XXS", "IQ2_XXS", "IQ2_M", "IQ1_M")
AS_IS = "as-is"  # the embedded model's one cell: the file as shipped
MOE_ONLY = frozenset({"MXFP4_MOE"})
ISA_FORMS = ("avx512vnni", "avx512", "avxvnni", "avx2")  # the hardware forms; portable C is no host's form
QUICK = {"shapes": ("embedded", "vocab50k", "mid"), "quants": ("Q4_K_M", "Q8_0", "IQ4_XS"), "rounds": 3,
         "prompt": 64, "decode": 32}

# A UD-Q4_K_XL-like mix (unsloth's "dynamic" 4-bit, XL size): llama.cpp's Q4_K_M ftype with tensor-type overrides in
# the spirit of tests/quantized.UD_Q4_K_M (Q8_0 attention, GDN and shared expert; routed gate/up Q4_K, routed down
# Q5_K), one size up where the bytes are few or errors compound: dense FFN gate/up Q4_K and down Q6_K, the token
# embedding Q6_K and the output head Q8_0. Regexes searched in tensor names, the first that matches wins; llama.cpp
# keeps the router (ffn_gate_inp) in F32 whatever the overrides say.
UD_Q4_K_XL = {r"ffn_down_exps": "Q5_K", r"ffn_(gate|up)_exps": "Q4_K", r"shexp": "Q8_0", r"attn_|ssm_": "Q8_0",
              r"ffn_down\.weight": "Q6_K", r"ffn_(gate|up)\.weight": "Q4_K", r"token_embd\.weight": "Q6_K",
              r"^output\.weight": "Q8_0"}
DENSE_ROLES = (("dense ffn gate/up", re.compile(r"\.ffn_(gate|up)\.weight$")),
               ("dense ffn down", re.compile(r"\.ffn_down\.weight$")))


@dataclass(frozen=True)
class SweepShape:
    synthetic: str | None  # key of bench.synthetic.SHAPES; None: the embedded model
    n_layer: int | None  # layers written (None: the shape's own)
    source: str  # where its numbers come from


SWEEP_SHAPES = {
    "embedded": SweepShape(None, None, "resources/models/*.gguf as shipped: already quantized by its training run; "
                                       "its float weights are not in the repository, so it is measured as-is only"),
    "vocab50k": SweepShape("vocab50k", None,
                           "bench/synthetic.py VOCAB50K: hidden 256, GPT-2's 50,259-token vocabulary"),
    "mid": SweepShape("mid", None, "bench/synthetic.py MID (the trunk issue's mid-size MoE)"),
    "qwen35-0.8b": SweepShape("qwen35-0.8b", None,
                              "Qwen/Qwen3.5-0.8B: 24 layers, hidden 1,024, 8 / 2 heads from its published card "
                              "(fitmygpu.com/models/qwen-3.5-0.8b, via the search tool); FFN 3,584 and 16 GDN heads "
                              "for QK and V from its config.json as recalled: the config itself was not in the "
                              "searchable corpus"),
    "qwen35-2b": SweepShape("qwen35-2b", 8,
                            "Qwen/Qwen3.5-2B: 24 layers, hidden 2,048, 8 / 2 heads from its published card "
                            "(fitmygpu.com/models/qwen-3.5-2b); FFN 6,144 and 16 GDN heads as recalled from its "
                            "config.json (not in the searchable corpus); written with 8 of its 24 layers"),
    "qwen35-9b": SweepShape("qwen35-9b", 4, "bench/synthetic.py QWEN35_9B; written with 4 of its 32 layers"),
    "qwen36-35b": SweepShape("qwen36-35b", 4, "bench/synthetic.py QWEN36_35B; written with 4 of its 40 layers"),
}


# ---------------------------------------------------------------------------------------------- pure parts
def is_moe(name: str) -> bool:
    from bench.synthetic import SHAPES

    sh = SWEEP_SHAPES[name]
    return sh.synthetic is not None and SHAPES[sh.synthetic].n_expert > 0


def plan_cells(shapes: list[str], quants: list[str]) -> list[tuple[str, str]]:
    """The (shape, quantization) cells to measure, in order: the embedded model as-is only, MXFP4_MOE on MoE shapes
    only."""
    bad = [s for s in shapes if s not in SWEEP_SHAPES] + [q for q in quants if q not in QUANTS + LOW_BIT]
    if bad:
        raise ValueError(f"unknown shape or quantization {bad[0]!r} (shapes: {', '.join(SWEEP_SHAPES)}; "
                         f"quantizations: {', '.join(QUANTS + LOW_BIT)})")
    cells: list[tuple[str, str]] = []
    for s in shapes:
        if SWEEP_SHAPES[s].synthetic is None:
            cells.append((s, AS_IS))
            continue
        cells += [(s, q) for q in quants if q not in MOE_ONLY or is_moe(s)]
    return cells


def cell_key(shape: str, quant: str) -> str:
    return f"{shape}/{quant}"


def form_speeds(cell: dict) -> dict[str, float]:
    """Our decode tok/s per backend form in a measured cell ("ours" counted under the backend it ran)."""
    return {r["backend"]: r["decode_tok_s"] for name, r in cell["runs"].items() if name != "llama_cpp"}


def avx2_over_avx512(cell: dict, form: str = "native-avx2") -> float | None:
    """A 256-bit form's decode (native-avx2: an AVX2-only desktop; native-avxvnni: an Intel desktop core with
    AVX-VNNI) over the better AVX512 form's, where the cell ran both."""
    f = form_speeds(cell)
    wide = [f[k] for k in ("native-avx512vnni", "native-avx512") if k in f]
    return f[form] / max(wide) if wide and form in f else None


def decode_median_of_rounds(cell: dict) -> float:
    """The median over rounds of each round's decode ratio ours / llama.cpp (a contended host moves single rounds)."""
    return statistics.median(rd["ours"]["decode_tok_s"] / rd["llama_cpp"]["decode_tok_s"] for rd in cell["rounds"])


def summarise_cells(cells: dict[str, dict]) -> dict:
    """Every measured cell's ratios (ours / llama.cpp: best rounds, and the median of the rounds' decode ratios), the
    median cell, the count at or above 1.0×, and the AVX2 forms' decode over the AVX512 forms'."""
    done = {k: c for k, c in cells.items() if "ours_over_llama_cpp" in c}
    per = {k: {"decode": c["ours_over_llama_cpp"]["ours"]["decode"],
               "decode_median_of_rounds": decode_median_of_rounds(c),
               "prefill": c["ours_over_llama_cpp"]["ours"]["prefill"], "avx2_over_avx512": avx2_over_avx512(c),
               "avxvnni_over_avx512": avx2_over_avx512(c, "native-avxvnni")}
           for k, c in done.items()}
    out: dict = {"cells": per, "measured": len(per), "failed": sorted(k for k in cells if k not in done)}
    if not per:
        return out
    by_decode = sorted(per, key=lambda k: per[k]["decode"])
    forms = [v["avx2_over_avx512"] for v in per.values() if v["avx2_over_avx512"] is not None]
    vnni256 = [v["avxvnni_over_avx512"] for v in per.values() if v["avxvnni_over_avx512"] is not None]
    out.update({
        "median_cell": by_decode[(len(by_decode) - 1) // 2],  # the lower median: a cell that was measured
        "median_decode": statistics.median(v["decode"] for v in per.values()),
        "median_prefill": statistics.median(v["prefill"] for v in per.values()),
        "decode_at_least_1": sum(v["decode"] >= 1.0 for v in per.values()),
        "decode_median_of_rounds_at_least_1": sum(v["decode_median_of_rounds"] >= 1.0 for v in per.values()),
        "prefill_at_least_1": sum(v["prefill"] >= 1.0 for v in per.values()),
        "both_at_least_1": sum(v["decode"] >= 1.0 and v["prefill"] >= 1.0 for v in per.values()),
        "worst_decode_cell": by_decode[0],
        "avx2_over_avx512_median": statistics.median(forms) if forms else None,
        "avx2_over_avx512_min": min(forms) if forms else None,
        "avxvnni_over_avx512_median": statistics.median(vnni256) if vnni256 else None,
        "avxvnni_over_avx512_min": min(vnni256) if vnni256 else None,
    })
    return out


# ---------------------------------------------------------------------------------------------- files
def shape_of(name: str):  # type: ignore[no-untyped-def]
    """The bench.synthetic.Shape a sweep shape writes (its layer count reduced where SWEEP_SHAPES says)."""
    from bench.synthetic import SHAPES

    sh = SWEEP_SHAPES[name]
    assert sh.synthetic is not None
    base = SHAPES[sh.synthetic]
    return replace(base, n_layer=sh.n_layer) if sh.n_layer else base


def source_file(name: str, directory: Path) -> Path:
    """The shape's F16 source, written once under `directory`."""
    from bench.synthetic import write_synthetic

    s = shape_of(name)
    path = directory / f"{name}-{s.n_layer}L-f16.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_synthetic(tmp, s, float_source=True)
        tmp.replace(path)
    return path


def quantized_file(name: str, quant: str, directory: Path) -> Path:
    """The cell's file: the embedded model itself, or the F16 source quantized by llama.cpp, written once."""
    if SWEEP_SHAPES[name].synthetic is None:
        from engine.storage.modelfile import default_model_path

        return Path(default_model_path())
    src = source_file(name, directory)
    out = src.with_name(src.name.replace("-f16.gguf", f"-{quant}.gguf"))
    if not out.exists():
        from tests.quantized import llama_quantize

        tmp = out.with_suffix(".tmp")
        xl = quant == "UD-Q4_K_XL"
        llama_quantize(src, tmp, "Q4_K_M" if xl else quant, overrides=UD_Q4_K_XL if xl else None,
                       threads=os.cpu_count() or 2)
        tmp.replace(out)
    return out


def prune(name: str, directory: Path) -> list[str]:
    """Delete a synthetic shape's files (its F16 source and quantizations)."""
    if SWEEP_SHAPES[name].synthetic is None:
        return []
    gone = sorted(directory.glob(f"{name}-{shape_of(name).n_layer}L-*.gguf"))
    for p in gone:
        p.unlink()
    return [p.name for p in gone]


# ---------------------------------------------------------------------------------------------- facts (a child)
def facts_main(path: str, forms: list[str]) -> None:
    """Print one file's facts: bytes, types per role, products without a native kernel on the default backend, and
    which path decode takes per form (a process of its own: a load per form)."""
    from engine import ops
    from engine.models.build import load_model
    from engine.ops.coverage import product_coverage
    from engine.storage.modelfile import open_model
    from tests.quantized import tensor_roles

    mf = open_model(path)
    types = tensor_roles(path)
    for role, pat in DENSE_ROLES:
        found = sorted({t.qtype.name for t in mf.tensors.values() if pat.search(t.name)})
        if found:
            types[role] = found
    default = ops.default_backend().name
    paths, products = {}, None
    for form in dict.fromkeys([default, *forms]):
        runner = load_model(open_model(path), n_ctx=16, backend=ops.backend_named(form))
        if form == default:
            products = product_coverage(runner, form).as_dict()
        if hasattr(runner, "step_path"):
            paths[form] = runner.step_path()
        else:
            paths[form] = "fused step" if runner.step is not None else "op by op"
        del runner
    print("RESULT " + json.dumps({"file": Path(path).name, "bytes": Path(path).stat().st_size, "types": types,
                                  "products": products, "step_path": paths}, default=str), flush=True)


def file_facts(path: Path, forms: list[str], timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--facts", str(path), "--forms", ",".join(forms)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"facts of {path.name} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------------------- the sweep
def our_forms() -> tuple[list[str], list[str]]:
    """The ISA forms this CPU runs, and those it lacks."""
    from engine import ops

    have = {b.name for b in ops.available_backends()}
    names = [f"native-{isa}" for isa in ISA_FORMS]
    return [n for n in names if n in have], [n for n in names if n not in have]


def shape_record(name: str) -> dict:
    sh = SWEEP_SHAPES[name]
    if sh.synthetic is None:
        from engine.storage.modelfile import default_model_path, open_model

        hp = open_model(default_model_path()).hparams
        return {"source": sh.source, "arch": hp.arch, "n_layer": hp.n_block - hp.n_mtp, "n_embd": hp.n_embd,
                "n_vocab": hp.n_vocab, "n_expert": hp.n_expert, "float_source": None}
    from bench.synthetic import SHAPES

    return {"source": sh.source, **shape_of(name).__dict__,
            "layers_reduced_from": SHAPES[sh.synthetic].n_layer if sh.n_layer else None,
            "float_source": "F16, random weights (bench/synthetic.write_synthetic(float_source=True))"}


def measure_cell(name: str, quant: str, forms: list[str], args: argparse.Namespace) -> dict:
    from bench.quant_mix import run_mix

    t0 = time.perf_counter()
    path = quantized_file(name, quant, Path(args.dir))
    made_s = time.perf_counter() - t0
    facts = file_facts(path, forms, args.child_timeout)
    load_start = list(os.getloadavg())
    res = run_mix(path, forms, args)
    return {"shape": name, "quant": quant, **facts, "file_ready_s": made_s, "load_avg_at_start": load_start,
            "load_avg_at_end": list(os.getloadavg()), **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"the ~10-minute subset: {', '.join(QUICK['shapes'])} × {', '.join(QUICK['quants'])}, "
                         f"{QUICK['rounds']} rounds, {QUICK['prompt']}-token prompt, {QUICK['decode']} tokens")
    ap.add_argument("--shapes", help="comma-separated, of " + ", ".join(SWEEP_SHAPES))
    ap.add_argument("--quants", help="comma-separated, of " + ", ".join(QUANTS + LOW_BIT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--prompt", type=int, help="prompt tokens (default 128; --quick 64)")
    ap.add_argument("--decode", type=int, help="tokens decoded (default 64; --quick 32)")
    ap.add_argument("--child-timeout", type=float, default=3600.0)
    ap.add_argument("--dir", default=str(ROOT / "build/bench/sweep"), help="where the model files are written")
    ap.add_argument("--prune", action="store_true", help="delete a shape's files once its cells are measured")
    ap.add_argument("--prepare", action="store_true", help="only write the cells' files (sources and quantizations)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/sweep.json"))
    ap.add_argument("--facts", help=argparse.SUPPRESS)  # a child: one file's facts
    ap.add_argument("--forms", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.facts:
        facts_main(args.facts, [f for f in args.forms.split(",") if f])
        return
    full = {"shapes": tuple(SWEEP_SHAPES), "quants": QUANTS, "rounds": 2, "prompt": 128, "decode": 64}
    preset = QUICK if args.quick else full
    shapes = args.shapes.split(",") if args.shapes else list(preset["shapes"])
    quants = args.quants.split(",") if args.quants else list(preset["quants"])
    for k in ("rounds", "prompt", "decode"):
        if getattr(args, k) is None:
            setattr(args, k, preset[k])
    try:
        cells = plan_cells(shapes, quants)
    except ValueError as e:
        ap.error(str(e))

    if args.prepare:
        for name, quant in cells:
            t = time.perf_counter()
            path = quantized_file(name, quant, Path(args.dir))
            print(f"{cell_key(name, quant)}: {path} ({path.stat().st_size / 2**20:.0f} MiB, "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
        return
    import xllamacpp

    from bench.decode import git_info, machine_info
    from engine import ops

    t0 = time.perf_counter()
    forms, missing = our_forms()
    result: dict = {
        "command": " ".join(["python", "bench/sweep.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
        "machine": machine_info(args.threads),
        "llama_cpp": f"xllamacpp {xllamacpp.__version__} ({xllamacpp.get_system_info().strip()})",
        "backend": ops.default_backend().name, "our_forms": forms, "our_forms_unavailable_on_this_cpu": missing,
        "settings": {"threads": args.threads, "rounds": args.rounds, "prompt": args.prompt, "decode": args.decode,
                     "decoding": "greedy, plain (no MTP), EOS ignored, 4 warm-up tokens"},
        "ud_q4_k_xl_overrides": UD_Q4_K_XL,
        "shapes": {s: shape_record(s) for s in dict.fromkeys(s for s, _ in cells)},
        "cells": {}, "pruned": {},
    }
    out = Path(args.out)
    for i, (name, quant) in enumerate(cells):
        key = cell_key(name, quant)
        print(f"== {key} ({i + 1}/{len(cells)})", flush=True)
        try:
            result["cells"][key] = measure_cell(name, quant, forms, args)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:  # one cell's failure does not end the sweep
            result["cells"][key] = {"shape": name, "quant": quant, "error": str(e)[-3000:]}
            print(f"   failed: {str(e)[-500:]}", flush=True)
        if args.prune and (i + 1 == len(cells) or cells[i + 1][0] != name):
            result["pruned"][name] = prune(name, Path(args.dir))
        result["summary"] = summarise_cells(result["cells"])
        result["machine"]["load_avg_at_end"] = list(os.getloadavg())
        result["duration_s"] = time.perf_counter() - t0
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")  # after every cell: a long sweep keeps what it measured
    s = result["summary"]
    for key, v in s["cells"].items():
        f = v["avx2_over_avx512"]
        print(f"{key:<24} decode ×{v['decode']:.2f}  prefill ×{v['prefill']:.2f}"
              + (f"  avx2/avx512 {f:.2f}" if f is not None else ""))
    if s.get("median_cell"):
        print(f"median cell {s['median_cell']}: decode ×{s['median_decode']:.2f}; "
              f"{s['decode_at_least_1']}/{s['measured']} cells ≥ 1.0× in decode, "
              f"{s['prefill_at_least_1']} in prefill")
    print(f"wrote {out} ({result['duration_s']:.0f} s)")


if __name__ == "__main__":
    main()
