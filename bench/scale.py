"""Real scale: Qwen3.6-35B-A3B and Qwen3.5-9B shapes on this machine, ours vs llama.cpp on the same file.

    python bench/scale.py [--models qwen36-35b,qwen35-9b] [--dir ~/.cache/foretell-bench] [--threads 2]
                          [--prompt 512] [--decode 48] [--pairs 3] [--steps cold,warm,mtp,auto]
                          [--out bench/results/scale.json]

The models are bench/synthetic.py's `QWEN36_35B` (UD-Q4_K_M mix, ~22 GB) and `QWEN35_9B` (Q4_K_M, ~5.7 GB):
the published shapes with random valid blocks and a BPE vocabulary of 248,320 tokens with a merge per token,
written once into `--dir` (outside the repository). Random weights: a drafted token is rarely accepted, so MTP
shows what drafting costs when it does not pay (auto depth must then not lose to plain decoding).

Each run is a process of its own, through bench/decode.py's child runners (`run_ours`: `engine.load` +
`Engine.generate`; `run_llama`: llama.cpp's server in-process through xllamacpp with its defaults — mmap, no
warm-up here, 2 threads), one `--prompt`-token random prompt and `--decode` greedy tokens with EOS ignored:
* `cold`: the file's pages are dropped from the page cache first (posix_fadvise DONTNEED after an fsync; the share
  still resident is recorded), so opening and the first reply read the file from disk;
* `warm`: right after a short run of the same engine in the same mode, the file in the page cache;
* `mtp`: warm (the MTP block's pages too), ours with MTP at auto depth, llama.cpp with its draft-mtp at n_max 2.
* `auto`: ours only, warm, plain and MTP at auto depth in `--pairs` pairs of runs, the order alternating pair by pair:
  `ours_mtp_auto_over_plain` is the median of the pairs' ratios (two single runs minutes apart differ by more, on a
  shared host, than what drafting costs when nothing is drafted).
`--steps mtp` re-measures only those runs and keeps the others from `--out` (recorded under `earlier_steps`).
Engines alternate within each step. Recorded per run: load time (`engine.load` / `xllamacpp.Server(...)`), time to
first token of the prompt (wall clock from the request), load + TTFT, prefill and decode tok/s, peak RSS
(`ru_maxrss`, which counts the resident pages of the mapped file), the file's bytes in the page cache after the run
(mincore), and the RSS budget `1.1 × (file + KV/GDN state at the context)` it is checked against.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import decode  # noqa: E402
from bench.synthetic import SHAPES, cached  # noqa: E402

N_CTX = 2048
LLAMA_DRAFT = 2


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache now (mincore over a fresh read-only mapping: it reads nothing)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)  # a read-only view: its address, nothing touched
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * page


def drop_from_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def state_bytes(path: Path, n_ctx: int) -> int:
    from engine.placement import ModelSizes
    from engine.storage.modelfile import open_model

    s = ModelSizes.from_model(open_model(path), n_ctx)
    return sum(s.kv) + sum(s.state)


def one_run(engine: str, path: Path, prompt: list[int], n: int, threads: int, mtp: bool, cold: bool,
            timeout: float) -> dict:
    if cold:
        drop_from_page_cache(path)
    before = resident_bytes(path)
    spec = {"model": str(path), "n_ctx": N_CTX, "threads": threads, "mtp": mtp,
            "draft": (LLAMA_DRAFT if engine == "llama" else None) if mtp else None, "warmup": False,
            "warmup_prompt": [], "prompts": [prompt], "n": n}
    t0 = time.perf_counter()
    res = decode.run_child(engine, spec, busy=False, timeout=timeout)
    wall = time.perf_counter() - t0
    p = res["prompts"][0]
    out = {"cached_before_mib": before / 2**20, "cached_after_mib": resident_bytes(path) / 2**20,
           "load_s": res["load_s"], "ttft_s": p["ttft_s"], "load_plus_ttft_s": res["load_s"] + p["ttft_s"],
           "prefill_tok_s": p["prompt_tokens"] / p["prefill_s"],
           "decode_tok_s": p["decode_tokens"] / p["decode_s"] if p["decode_s"] > 0 else None,
           "generated_tokens": p["generated_tokens"], "peak_rss_mib": res["peak_rss_mib"], "process_wall_s": wall,
           "backend": res["backend"]}
    if "drafted" in p:
        out.update({"drafted": p["drafted"], "accepted": p["accepted"]})
    return out


def measure(name: str, directory: Path, args: argparse.Namespace, previous: dict | None) -> dict:
    t = time.perf_counter()
    path = cached(name, directory)
    write_s = time.perf_counter() - t
    shape = SHAPES[name]
    rng = np.random.default_rng(1)
    prompt = rng.integers(256, shape.n_vocab - 3, args.prompt).tolist()
    file_b, state_b = path.stat().st_size, state_bytes(path, N_CTX)
    runs: dict[str, dict] = {"cold": {}, "warm": {}, "mtp": {}, "auto": {}}
    if previous is not None:  # --steps: the other steps' runs are kept from the earlier file
        runs.update({k: v for k, v in previous["runs"].items() if k not in args.steps})
    order = ("ours", "llama")
    for step, mtp, cold in (("cold", False, True), ("warm", False, False), ("mtp", True, False)):
        if step not in args.steps:
            continue
        for eng in (order if step != "warm" else order[::-1]):
            if not cold:  # warm: the same engine, in the same mode, has just read what it reads (the MTP block too)
                one_run(eng, path, prompt, 2, args.threads, mtp, False, args.child_timeout)
            print(f"{name} {step} {eng} …", file=sys.stderr, flush=True)
            runs[step][eng] = one_run(eng, path, prompt, args.decode, args.threads, mtp, cold, args.child_timeout)
            print(f"   {json.dumps(runs[step][eng])}", file=sys.stderr, flush=True)
    if "auto" in args.steps:
        pairs = []
        one_run("ours", path, prompt, 2, args.threads, True, False, args.child_timeout)  # the file (MTP block too) read
        for i in range(args.pairs):
            got = {}
            for mtp in ((False, True) if i % 2 == 0 else (True, False)):
                print(f"{name} auto pair {i} {'auto' if mtp else 'plain'} …", file=sys.stderr, flush=True)
                got["auto" if mtp else "plain"] = one_run("ours", path, prompt, args.decode, args.threads, mtp, False,
                                                          args.child_timeout)["decode_tok_s"]
            pairs.append({**got, "first": "plain" if i % 2 == 0 else "auto", "ratio": got["auto"] / got["plain"]})
            print(f"   {json.dumps(pairs[-1])}", file=sys.stderr, flush=True)
        runs["auto"] = {"pairs": pairs}
    auto_pairs = runs.get("auto", {}).get("pairs")
    budget_mib = 1.1 * (file_b + state_b) / 2**20

    def ratio(step: str, key: str, higher_better: bool = True) -> float | None:
        o, r = runs[step]["ours"].get(key), runs[step]["llama"].get(key)
        if not o or not r:
            return None
        return o / r if higher_better else r / o

    return {
        "file_gib": file_b / 2**30, "state_mib": state_b / 2**20, "write_s": write_s,
        "shape": {k: v for k, v in vars(shape).items()}, "prompt_tokens": args.prompt, "decode_tokens": args.decode,
        "runs": runs,
        "ratios_ours_over_llama": {
            "decode_warm": ratio("warm", "decode_tok_s"), "prefill_warm": ratio("warm", "prefill_tok_s"),
            "decode_mtp": ratio("mtp", "decode_tok_s"),
            "load_plus_ttft_warm_speed": ratio("warm", "load_plus_ttft_s", higher_better=False),
            "load_plus_ttft_cold_speed": ratio("cold", "load_plus_ttft_s", higher_better=False),
        },
        "ours_mtp_auto_over_plain": float(np.median([p["ratio"] for p in auto_pairs])) if auto_pairs else
        (runs["mtp"]["ours"]["decode_tok_s"] or 0) / runs["warm"]["ours"]["decode_tok_s"],
        "rss": {"budget_mib": budget_mib,
                "ours_peak_mib": max(r["ours"]["peak_rss_mib"] for k, r in runs.items() if k != "auto"),
                "llama_peak_mib": max(r["llama"]["peak_rss_mib"] for k, r in runs.items() if k != "auto")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen36-35b,qwen35-9b")
    ap.add_argument("--dir", default=str(Path.home() / ".cache/foretell-bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=48,
                    help="tokens decoded per run: MTP auto against plain is a difference of a few percent, and one "
                         "short run on a shared host varies more than that")
    ap.add_argument("--child-timeout", type=float, default=1800.0)
    ap.add_argument("--pairs", type=int, default=3, help="the auto step's pairs of plain and MTP auto runs")
    ap.add_argument("--steps", default="cold,warm,mtp,auto",
                    help="which runs to make; the others are kept from --out (re-measuring one step)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/scale.json"))
    args = ap.parse_args()
    args.steps = args.steps.split(",")
    old = json.loads(Path(args.out).read_text()) if set(args.steps) != {"cold", "warm", "mtp", "auto"} else None
    import psutil
    import xllamacpp

    out = {"command": "python " + " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "git": decode.git_info(), "machine": {**decode.machine_info(args.threads),
                                                 "ram_gib": psutil.virtual_memory().total / 2**30},
           "llama_cpp": f"xllamacpp {xllamacpp.__version__}", "n_ctx": N_CTX, "llama_draft_n_max": LLAMA_DRAFT,
           "models": {}}
    if old is not None:
        out["models"] = old["models"]
        out["earlier_steps"] = {"command": old["command"], "date": old["date"], "git": old["git"],
                                "kept": [s for s in ("cold", "warm", "mtp", "auto") if s not in args.steps]}
    for name in args.models.split(","):
        out["models"][name] = measure(name, Path(args.dir), args, old["models"].get(name) if old else None)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v["ratios_ours_over_llama"] for k, v in out["models"].items()}, indent=1))


if __name__ == "__main__":
    main()
