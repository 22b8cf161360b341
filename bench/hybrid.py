"""CPU/GPU hybrid decoding on CUDA, ours (placements, plain and MTP, expert-cache hit rates) against llama.cpp.

Ours across placements (gpu_layers, cpu_moe, expert-cache sizes, both miss policies), plain and MTP, with
per-layer expert-cache hit rates; llama.cpp's CUDA build on the same file where one is here.

    python bench/hybrid.py [--model qwen36-35b|embedded|PATH[,...]] [--configs auto|NAME,...] [--modes plain,mtp]
                           [--decode 64] [--prompt 128] [--chat-prompts 3] [--threads N] [--rounds 1]
                           [--llama | --no-llama] [--llama-cpu] [--llama-bench PATH] [--budget-s S]
                           [--dir ~/.cache/foretell-bench] [--out bench/results/hybrid.json] [--cpu-standin]

Models (`--model`, comma-separated, measured in that order): `embedded` (the default model in resources/models/,
answering held-out chat prompts through its chat template: real text, so its real routing); a name of
bench/synthetic.py's SHAPES (`qwen36-35b`: Qwen3.6-35B-A3B's shape in unsloth's UD-Q4_K_M mix, ~21 GB, written once
into `--dir` as bench/scale.py does; random weights, so near-uniform routing and draft acceptance ≈ 0); or a GGUF
path. Synthetic and path models decode from one random `--prompt`-token prompt.

Configurations (`--configs`, comma-separated; each name is '-'-joined tokens):
  `resident` every trunk layer and all its routed experts on the GPU (gpu_layers = all);
  `nglN`     the last N trunk layers on the GPU (their experts with them unless `moe`), the rest on the CPU;
  `auto`     the engine's own choice for the free VRAM (gpu_layers auto);
  `moe`      routed experts stay on the CPU (cpu_moe), with `cN` (N experts per layer) or `cNMiB`/`cNGiB` (a
             total) cached on the GPU; `load` / `cpu`: the miss policy (load the expert to the GPU, or compute it
             on the CPU; default load). `c0` is no cache at all (every expert on the CPU, either policy).
  `nograph`  decode steps op by op (EngineConfig.step_graphs="off"); otherwise they are replayed from CUDA graphs
             where the placement allows it (resident; recorded as `step_graphs`: whether the trunk and the MTP head
             have them, and captures and replays of each, in all and per mode).
  e.g. `resident,moe-c0,moe-c64-load,moe-c64-cpu,moe-c2048MiB-cpu,ngl20,ngl20-moe-c16-cpu`.
`auto` (the default) sweeps, for a model with L layers and E experts per layer: resident, resident-nograph,
moe-c{E/4}-load, moe-c{E/4}-cpu, moe-c{E/16}-load, moe-c{E/16}-cpu, moe-c0, ngl{L/2}; for files under 2 GiB also a
MiB-sized cache (E/8 experts' worth per layer) and ngl{L/2} with cpu-moe. Configurations are run in that order, most wanted first,
so that `--budget-s` (no new run is started after that many seconds; what ran is written) cuts the least wanted.

Every configuration is one child process (a fresh load with that placement, `--threads` threads) that warms up
(4 untimed tokens from another prompt: Triton's kernels compiled, the expert cache primed) and then decodes each
prompt in each mode of `--modes`: `plain` (MTP off) and `mtp` (MTP on, auto depth). Greedy, EOS ignored, so every
run decodes exactly `--decode` tokens. Recorded per mode: decode tok/s = (tokens − 1) / (time of the last token −
time of the first), prefill tok/s, TTFT (`Stats`), drafted / accepted, peak RSS, on CUDA the peak of
torch.cuda.max_memory_allocated over the mode and the allocation right after loading; the plan (`Plan.as_dict()`:
its one-line summary, the estimated VRAM by part); and, from the final `Stats` events, the expert cache per layer
over that mode alone (hits, misses, evictions, bytes moved, hit rate, capacity, occupancy) with totals, plus the
share of the mode's routings that went to each cached layer's `capacity` most-used experts (what a static cache of
the hottest experts, chosen in hindsight, would have hit). Plain runs before MTP in the same process: the MTP
mode's cache starts warm from the plain one.

llama.cpp: through the `xllamacpp` wheel in-process (bench/decode.py's `run_llama`: its server's completions
handler, streamed) when its build lists a GPU device (`xllamacpp.get_device_info()`, read in a child process so
this one never holds a CUDA context); else, with `--llama-bench PATH`, a llama-bench binary built with CUDA
(`-p/-n/-ngl/-ncmoe/-t/-r/-o json`: pp and tg at depth 0, its own averages); else "llama.cpp CUDA unavailable:
why" is recorded. Each of our configurations is paired with llama.cpp at the same VRAM budget: `resident` with
`-ngl 999`; `nglN` with `-ngl N`; cpu-moe with `-ngl 999 --n-cpu-moe K` (the experts of the first K layers on the
CPU; set through `tensor_buft_overrides`, the pattern llama.cpp's own `--n-cpu-moe` adds), K = L − ⌊our cache
bytes / one layer's experts⌋, so llama.cpp's GPU-resident experts take the bytes our cache takes. Engines
alternate within a round and the first engine alternates round by round (as bench/decode.py); with `--rounds` > 1
each side's best round counts. Ratios ours / llama.cpp (decode tok/s) are written where both ran.

Without CUDA, `--cpu-standin` runs the same sweep with the CUDA plans executed on CPU stand-ins (the plan made for a
CUDA device with `--standin-vram` MiB free, then its device set to "cpu", as tests/test_placement.py does): the
expert cache's slots, copies and bookkeeping run on CPU tensors, so hit rates are those of the real routing (on
the embedded model, its real routing); timings there are CPU timings and are labelled as stand-ins. llama.cpp's
CPU build runs beside it only with `--llama-cpu` (it exercises the llama.cpp side; its numbers compare CPU with CPU).
Without CUDA and without `--cpu-standin` the script says so in one line and exits 2.

The JSON (`--out`, rewritten after every run, so a run cut short leaves what it measured): the command, the machine
(CPU, GPU name and VRAM, torch / triton versions, whether the engine's Triton kernels pass their check on this GPU),
git commit and dirty flag, llama.cpp's availability (or why not), and per model, per configuration: the placement
asked for, our plan and its summary, llama.cpp's equivalent setting, `ours` per mode (the best round, everything
above), `llama_cpp` per mode, `ratios_ours_over_llama`, and each round's headline figures.

On a lent GPU machine, whose python3 has CUDA torch and Triton but not gguf: carry gguf's wheel (`.whl/`, git
ignores it) and the native library built here (engine/native/_native*.so: plain C loaded with ctypes, so the
Python version does not matter), install the wheel into a folder on PYTHONPATH, then e.g.
`python3 bench/hybrid.py --model embedded,qwen36-35b --budget-s 360 --out $OUT/hybrid.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import decode  # noqa: E402

MiB = 1 << 20
WARMUP_TOKENS = 4
LLAMA_DRAFT = 2  # llama.cpp's draft-mtp n_max in its MTP mode (bench/scale.py's choice)
SMALL_FILE = 2 << 30  # under this the default sweep is the full one
MODES = ("plain", "mtp")


class UsageError(Exception):
    """A one-line error for the user (no traceback)."""


# ---------------------------------------------------------------------------------------------- configurations
@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    gpu_layers: int | None  # None: auto
    cpu_moe: bool
    expert_cache: str | None  # "N" or "N MiB"; None when not cpu_moe
    miss_policy: str
    step_graphs: str = "auto"  # "off" with the `nograph` part: every step op by op

    def placement(self) -> dict:
        return {"gpu_layers": self.gpu_layers, "cpu_moe": self.cpu_moe, "expert_cache": self.expert_cache,
                "miss_policy": self.miss_policy}


def parse_config(name: str, n_layer: int) -> Config:
    gpu_layers: int | None = n_layer
    cpu_moe, cache, miss, where, graphs = False, None, None, None, "auto"
    for tok in name.split("-"):
        if tok in ("resident", "all", "auto") or re.fullmatch(r"ngl\d+", tok):
            if where is not None:
                raise UsageError(f"configuration {name!r}: give one of resident / auto / nglN")
            where = tok
            gpu_layers = None if tok == "auto" else n_layer if tok in ("resident", "all") else int(tok[3:])
            if gpu_layers is not None and not 0 < gpu_layers <= n_layer:
                raise UsageError(f"configuration {name!r}: ngl must be 1…{n_layer} for this model")
        elif tok == "moe":
            cpu_moe = True
        elif m := re.fullmatch(r"c(\d+)(MiB|GiB)?", tok, flags=re.IGNORECASE):
            cache = m.group(1) + (" " + m.group(2) if m.group(2) else "")
        elif tok in ("load", "cpu"):
            miss = tok
        elif tok == "nograph":
            graphs = "off"
        else:
            raise UsageError(f"configuration {name!r}: unknown part {tok!r} (resident, auto, nglN, moe, cN, cNMiB, "
                             "load, cpu, nograph)")
    if (cache is not None or miss is not None) and not cpu_moe:
        raise UsageError(f"configuration {name!r}: a cache size or miss policy needs 'moe' (experts on the CPU)")
    if cpu_moe and cache is None:
        cache = "0"
    return Config(name, gpu_layers, cpu_moe, cache, miss or "load", graphs)


def default_configs(n_layer: int, n_expert: int, expert_one: int, file_bytes: int) -> list[str]:
    out = ["resident", "resident-nograph"]
    if n_expert:
        q4, q16 = max(1, n_expert // 4), max(1, n_expert // 16)
        out += [f"moe-c{q4}-load", f"moe-c{q4}-cpu"]
        if q16 != q4:
            out += [f"moe-c{q16}-load", f"moe-c{q16}-cpu"]
        out.append("moe-c0")
    half = max(1, n_layer // 2)
    if half < n_layer:
        out.append(f"ngl{half}")
    if file_bytes < SMALL_FILE and n_expert:
        mib = max(1, round(n_layer * max(1, n_expert // 8) * expert_one / MiB))
        out.append(f"moe-c{mib}MiB-cpu")
        if half < n_layer:
            out.append(f"ngl{half}-moe-c{max(1, n_expert // 4)}-cpu")
    return out


# ---------------------------------------------------------------------------------------------- child processes
def _cache_delta(after: dict | None, before: dict | None) -> dict | None:
    """Per-layer expert-cache figures over one mode (cumulative Stats.expert_cache after − before), with totals."""
    if not after:
        return None
    per_layer: dict[str, dict] = {}
    tot = {"hits": 0, "misses": 0, "evictions": 0, "bytes_moved": 0}
    for il, a in sorted(after.items(), key=lambda kv: int(kv[0])):
        b = (before or {}).get(il, {})
        d = {k: int(a[k]) - int(b.get(k, 0)) for k in tot}
        n = d["hits"] + d["misses"]
        d["hit_rate"] = d["hits"] / n if n else 0.0
        d["capacity"], d["occupancy"] = int(a.get("capacity", 0)), int(a.get("occupancy", 0))
        per_layer[str(il)] = d
        for k in tot:
            tot[k] += d[k]
    n = tot["hits"] + tot["misses"]
    rates = [v["hit_rate"] for v in per_layer.values()]
    return {"per_layer": per_layer,
            "total": {**tot, "hit_rate": tot["hits"] / n if n else 0.0, "bytes_moved_mib": tot["bytes_moved"] / MiB},
            "hit_rate_min": min(rates), "hit_rate_max": max(rates), "hit_rate_mean": sum(rates) / len(rates)}


def _usage_delta(after: dict | None, before: dict | None) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for il, counts in (after or {}).items():
        c = np.asarray(counts, dtype=np.int64)
        b = (before or {}).get(il)
        out[str(il)] = c - np.asarray(b, dtype=np.int64) if b is not None else c
    return out


def _top_share(counts: np.ndarray, k: int) -> float:
    total = int(counts.sum())
    return float(np.sort(counts)[::-1][:k].sum() / total) if total and k > 0 else 0.0


def run_ours(spec: dict) -> dict:
    import engine  # noqa: F401  (first, as the app and the CLI import it: it sets torch's OpenMP wait policy)
    import torch

    from engine import ops
    from engine.generate import EngineConfig, GenerationConfig, load
    from engine.placement import ModelSizes, PlacementConfig, plan_placement
    from engine.sampling import SamplingConfig
    from engine.storage.modelfile import open_model

    threads = spec["threads"]
    torch.set_num_threads(threads)
    pl = spec["placement"]
    cuda = spec["device"].startswith("cuda")
    cuda_plan = None
    if cuda:
        cfg = EngineConfig(n_ctx=spec["n_ctx"], device=spec["device"], n_threads=threads,
                           step_graphs=spec.get("step_graphs", "auto"), **pl)
    else:  # a plan for a CUDA device, run with the CPU standing in for it (tests/test_placement.py's twin)
        mf = open_model(spec["model"])
        sizes = ModelSizes.from_model(mf, min(spec["n_ctx"], mf.hparams.n_ctx_train))
        free = spec["standin_vram_mib"] * MiB if pl["gpu_layers"] is None else None
        cuda_plan = plan_placement(sizes, PlacementConfig(device="cuda", **pl), free)
        cfg = EngineConfig(n_ctx=spec["n_ctx"], n_threads=threads, plan=dataclasses.replace(cuda_plan, device="cpu"),
                           step_graphs=spec.get("step_graphs", "auto"))
    t0 = time.perf_counter()
    eng = load(spec["model"], cfg)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    plan = (cuda_plan or eng.plan).as_dict()
    out: dict = {"load_s": load_s, "plan": plan, "backend": (eng.config.backend or ops.default_backend()).name,
                 "has_mtp": eng.drafter is not None, "modes": {}}
    if cuda:
        out["vram_after_load_mib"] = torch.cuda.memory_allocated() / MiB
        free_b, total_b = torch.cuda.mem_get_info()
        out["device_used_after_load_mib"] = (total_b - free_b) / MiB  # the whole device: context and allocator too
    eng.tokenizer.eog_ids = frozenset()  # EOS ignored: every run decodes exactly n tokens
    greedy = SamplingConfig(temperature=0.0, top_k=1)
    last: dict = {"cache": None, "usage": None}

    def one(ids: list[int], n: int, mtp: bool) -> dict:
        eng.reset()  # no reuse of the previous prompt's cache
        gen = GenerationConfig(max_tokens=n, sampling=greedy, mtp=mtp, draft=None, stats_interval_s=3600.0)
        final = decode.final_stats(eng, ids, gen)
        last["cache"], last["usage"] = final.expert_cache, final.expert_usage
        return decode.run_record(final)

    if spec["warmup"]:
        one(spec["warmup_prompt"], WARMUP_TOKENS, False)
    for mode in spec["modes"]:
        if mode == "mtp" and eng.drafter is None:
            out["modes"][mode] = {"skipped": "the model has no MTP block"}
            continue
        cache0, usage0, graphs0 = last["cache"], last["usage"], eng.runner.graph_counts()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        runs = [one(ids, spec["n"], mode == "mtp") for ids in spec["prompts"]]
        res = {"prompts": runs}
        if cuda:
            res["vram_peak_mib"] = torch.cuda.max_memory_allocated() / MiB
        # this mode's captures and replays
        res["step_graphs"] = {k: v - graphs0[k] for k, v in eng.runner.graph_counts().items()}
        res["expert_cache"] = _cache_delta(last["cache"], cache0)
        usage = _usage_delta(last["usage"], usage0)
        if res["expert_cache"] is not None:  # what a static cache of each layer's hottest experts would have hit
            res["expert_cache"]["static_top_capacity_share"] = {
                il: round(_top_share(usage[il], v["capacity"]), 4)
                for il, v in res["expert_cache"]["per_layer"].items() if il in usage}
        if usage and mode == spec["modes"][0]:
            res["routing_top_share"] = {str(k): {il: round(_top_share(c, k), 4) for il, c in usage.items()}
                                        for k in spec["share_capacities"]}
        out["modes"][mode] = res
    out["peak_rss_mib"] = decode._peak_rss_mib()
    graphs = eng.runner.graphs
    out["step_graphs"] = {"setting": spec.get("step_graphs", "auto"), "used": graphs is not None,
                          "head_used": eng.runner.mtp is not None and eng.runner.mtp.graphs is not None,
                          **eng.runner.graph_counts()}
    return out


def _dev_type(dev: dict) -> str:
    """A ggml device entry's type (xllamacpp.get_device_info: an IntEnum, whose str() is its number): "CPU", "GPU",
    "IGPU", "ACCEL", …"""
    t = dev["type"]
    return str(getattr(t, "name", t)).rsplit("_", 1)[-1]


def _is_gpu(dev: dict) -> bool:
    return _dev_type(dev) in ("GPU", "IGPU")


def run_llama(spec: dict) -> dict:
    """bench/decode.py's llama.cpp runner with the placement set on its params (n_gpu_layers, the tensor overrides
    of --n-cpu-moe), and the device memory llama.cpp took when it loaded."""
    import xllamacpp as xl

    def gpu_free() -> int:
        return sum(int(d["memory_free"]) for d in xl.get_device_info() if _is_gpu(d))

    before = gpu_free()
    seen: dict = {}
    server_cls = xl.Server

    def server(p):  # type: ignore[no-untyped-def]
        p.n_gpu_layers = spec["n_gpu_layers"]
        if hasattr(p, "fit_params"):  # no automatic refitting of the placement asked for
            p.fit_params = False
        if spec["n_cpu_moe"]:
            p.tensor_buft_overrides = ",".join(
                rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU" for i in range(spec["n_cpu_moe"]))
        seen.update(n_gpu_layers=p.n_gpu_layers, tensor_buft_overrides=p.tensor_buft_overrides,
                    fit_params=getattr(p, "fit_params", None))
        s = server_cls(p)
        seen["vram_used_mib"] = (before - gpu_free()) / MiB
        return s

    xl.Server = server  # decode.run_llama builds its params and calls xl.Server(p): the placement goes on here
    try:
        res = decode.run_llama(spec)
    finally:
        xl.Server = server_cls
    res["params"] = {k: v for k, v in seen.items() if k != "vram_used_mib"}
    res["vram_used_mib"] = seen.get("vram_used_mib")
    return res


def probe(spec: dict) -> dict:
    """What this machine has: torch / triton / CUDA, and whether llama.cpp (xllamacpp) has a GPU device."""
    import importlib.metadata as md

    import torch

    out: dict = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        out["triton"] = md.version("triton")
    except md.PackageNotFoundError:
        out["triton"] = None
    out["cuda_available"] = bool(torch.version.cuda) and torch.cuda.is_available()
    if out["cuda_available"] and spec.get("gpu", True):
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": p.name, "vram_mib": p.total_memory / MiB, "multiprocessors": p.multi_processor_count,
                      "capability": f"{p.major}.{p.minor}", "count": torch.cuda.device_count()}
        try:
            from engine.metrics import cuda_status

            ok, why = cuda_status()
            out["engine_cuda_status"] = {"usable": ok, "note": why}
        except Exception as e:  # noqa: BLE001  (recorded, not fatal: the runs say what fails)
            out["engine_cuda_status"] = {"usable": False, "note": f"{type(e).__name__}: {e}"}
    llama: dict = {}
    try:
        import xllamacpp as xl
    except Exception as e:  # noqa: BLE001
        llama.update(available=False, why=f"the xllamacpp package is not importable here ({type(e).__name__}: {e})")
    else:
        devs = xl.get_device_info()
        gpus = [d for d in devs if _is_gpu(d)]
        llama.update(package=f"xllamacpp {xl.__version__}", system_info=xl.get_system_info().strip(),
                     devices=[{"name": d["name"], "description": d["description"], "type": _dev_type(d),
                               "memory_total_mib": int(d["memory_total"]) / MiB} for d in devs],
                     has_moe_cache_size=hasattr(xl.CommonParams(), "moe_cache_size"))
        if gpus:
            llama.update(available=True, why="")
        else:
            llama.update(available=False, why=f"xllamacpp {xl.__version__} is a CPU-only build (its devices: "
                                              f"{', '.join(d['name'] for d in devs)})")
    out["llama_cpp"] = llama
    return out


def child_main(kind: str) -> None:
    spec = json.loads(sys.stdin.read())
    res = {"ours": run_ours, "llama": run_llama, "probe": probe}[kind](spec)
    print("RESULT " + json.dumps(res), flush=True)


def run_child(kind: str, spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, input=json.dumps(spec), capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                             env=decode.peer_env() if kind == "llama" else None)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{kind} child ran past its {timeout:.0f} s") from None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} child failed (rc {out.returncode}): {out.stderr[-2500:]}{out.stdout[-500:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "wall_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------- llama-bench
def run_llama_bench(binary: str, model: Path, setting: dict, args: argparse.Namespace) -> dict:
    """One llama-bench run (its JSON output): prompt processing and token generation at depth 0, `--rounds`
    repetitions (at least 2), its averages."""
    cmd = [binary, "-m", str(model), "-p", str(args.prompt), "-n", str(args.decode),
           "-ngl", str(setting["n_gpu_layers"]), "-t", str(args.threads), "-r", str(max(2, args.rounds)),
           "-o", "json"]
    if setting["n_cpu_moe"]:
        cmd += ["-ncmoe", str(setting["n_cpu_moe"])]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed (rc {out.returncode}): {out.stderr[-2000:]}")
    rows = json.loads(out.stdout[out.stdout.index("["):])
    res: dict = {"command": " ".join(cmd), "wall_s": time.perf_counter() - t0, "source": "llama-bench"}
    for r in rows:
        if int(r.get("n_gen", 0)) > 0:
            res["decode_tok_s"] = float(r["avg_ts"])
            res["decode_tok_s_stddev"] = float(r.get("stddev_ts", 0.0))
        elif int(r.get("n_prompt", 0)) > 0:
            res["prefill_tok_s"] = float(r["avg_ts"])
        for k in ("build_commit", "gpu_info", "backends"):
            if k in r:
                res[k] = r[k]
    if "decode_tok_s" not in res:
        raise RuntimeError(f"llama-bench printed no token-generation row: {out.stdout[-1000:]}")
    return res


# ---------------------------------------------------------------------------------------------- parent
def resolve_model(name: str, args: argparse.Namespace) -> tuple[str, Path, float | None, dict | None]:
    """(label, path, seconds spent writing it, its synthetic shape)."""
    from bench.synthetic import SHAPES, cached
    from engine.storage.modelfile import default_model_path

    if name == "embedded":
        return name, default_model_path(), None, None
    if name in SHAPES:
        t0 = time.perf_counter()
        existed = (Path(args.dir) / f"synthetic-{name}.gguf").exists()
        print(f"== {name}: {'found' if existed else 'writing'} the synthetic model in {args.dir}", flush=True)
        path = cached(name, Path(args.dir))
        return name, path, None if existed else time.perf_counter() - t0, dict(vars(SHAPES[name]))
    p = Path(name).expanduser()
    if not p.is_file():
        raise UsageError(f"model {name!r}: not 'embedded', a synthetic shape ({', '.join(SHAPES)}) or a GGUF file")
    return p.name, p, None, None


def prompts_for(label: str, path: Path, n_vocab: int,
                args: argparse.Namespace) -> tuple[list[list[int]], list[int], str]:
    """The prompts, the warm-up prompt and a line saying what they are."""
    if label == "embedded":
        from engine.chat import ChatFormat, Message
        from engine.storage.modelfile import open_model
        from engine.tokenizer import Tokenizer
        from engine.training.data import eval_prompts

        mf = open_model(path)
        chat = ChatFormat(mf.get("tokenizer.chat_template"), Tokenizer.from_metadata(mf.metadata))
        items = eval_prompts(240)[:args.chat_prompts + 1]
        ids = [chat.encode([Message(m.role, m.content) for m in it.messages], add_generation_prompt=True)
               for it in items]
        return ids[:args.chat_prompts], ids[-1], (f"first {args.chat_prompts} held-out evaluation chat prompts "
                                                  f"through the chat template, {args.decode} tokens each")
    hi = max(n_vocab - 3, 257)
    prompt = np.random.default_rng(1).integers(256, hi, args.prompt).tolist()
    warm = np.random.default_rng(2).integers(256, hi, 16).tolist()
    return [prompt], warm, f"one random {args.prompt}-token prompt, {args.decode} tokens"


def llama_setting(plan: dict, sizes, n_layer: int) -> dict:  # type: ignore[no-untyped-def]
    """llama.cpp's placement with the VRAM budget of ours: layers as ours; with cpu-moe, the experts of as many
    (last) layers on the GPU as our cache's bytes would hold."""
    g = plan["gpu_layers"]
    ngl = 999 if g == n_layer else g
    cache_b = plan["gpu_bytes"].get("expert_cache", 0)
    if not any(plan["layer_on_gpu"][i] and not plan["experts_on_gpu"][i] and sizes.experts[i] for i in range(n_layer)):
        return {"n_gpu_layers": ngl, "n_cpu_moe": 0, "experts_on_gpu_layers": g, "gpu_expert_mib": None}
    per_layer = max(sizes.experts)
    on = min(g, int(cache_b // per_layer)) if per_layer else 0
    return {"n_gpu_layers": ngl, "n_cpu_moe": n_layer - on, "experts_on_gpu_layers": on,
            "gpu_expert_mib": on * per_layer / MiB, "ours_expert_cache_mib": cache_b / MiB}


def setting_key(s: dict) -> str:
    return f"ngl{s['n_gpu_layers']}-ncmoe{s['n_cpu_moe']}"


def summarise_mode(res: dict, mode: str) -> dict:
    m = res["modes"][mode]
    if "skipped" in m:
        return dict(m)
    s = decode.summarise({"prompts": m["prompts"], "load_s": res["load_s"], "peak_rss_mib": res["peak_rss_mib"],
                          "wall_s": res["wall_s"]})
    for k in ("vram_peak_mib", "step_graphs", "expert_cache", "routing_top_share"):
        if k in m:
            s[k] = m[k]
    return s


def best(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "decode_tok_s" in r]
    if not ok:
        return rounds[-1]
    out = dict(max(ok, key=lambda r: r["decode_tok_s"]))
    if len(ok) > 1:
        out["prefill_tok_s"] = max(r["prefill_tok_s"] for r in ok if "prefill_tok_s" in r)
        if all("ttft_ms" in r for r in ok):
            out["ttft_ms"] = min(r["ttft_ms"] for r in ok)
        out["decode_tok_s_by_round"] = [r["decode_tok_s"] for r in ok]
    return out


def measure_model(name: str, args: argparse.Namespace, env: dict, result: dict,
                  save: Callable[[], None], t_start: float) -> None:
    """Every configuration of one model, each side in its own processes; `save` writes the JSON so far."""
    from engine.placement import ModelSizes, PlacementConfig, plan_placement
    from engine.storage.modelfile import open_model

    label, path, write_s, shape = resolve_model(name, args)
    mf = open_model(path)
    hp = mf.hparams
    L = hp.n_layer
    prompts, warm, workload = prompts_for(label, path, hp.n_vocab, args)
    n_ctx = max(len(p) for p in prompts + [warm]) + args.decode + 64
    sizes = ModelSizes.from_model(mf, min(n_ctx, hp.n_ctx_train))
    n_expert = sizes.n_expert
    expert_one = max(sizes.expert_one) if n_expert else 0
    names = (default_configs(L, n_expert, expert_one, path.stat().st_size) if args.configs == ["auto"]
             else args.configs)
    configs = [parse_config(c, L) for c in names]
    entry: dict = {"file": path.name, "bytes": path.stat().st_size, "write_s": write_s, "shape": shape,
                   "n_layer": L, "n_expert": n_expert, "n_expert_used": hp.n_expert_used if n_expert else 0,
                   "expert_mib": expert_one / MiB, "layer_experts_mib": max(sizes.experts) / MiB,
                   "has_mtp": bool(hp.has_mtp), "workload": workload,
                   "prompt_tokens": [len(p) for p in prompts], "decode_tokens_per_prompt": args.decode,
                   "standin": args.cpu_standin, "configs": {}}
    result["models"][label] = entry
    print(f"== {label}: {path.name} ({path.stat().st_size / 2**30:.2f} GiB, {L} layers, {n_expert} experts): "
          f"{workload}; configs {', '.join(c.name for c in configs)}", flush=True)
    base = {"model": str(path), "n_ctx": n_ctx, "threads": args.threads, "prompts": prompts, "warmup_prompt": warm,
            "n": args.decode, "warmup": True}
    llama_mode = env["llama_mode"]
    llama_done: dict[tuple[int, str], dict] = {}  # (round, setting) → result, shared by configs of one setting
    share_caps = sorted({max(1, n_expert // d) for d in (16, 8, 4, 2)}) if n_expert else []
    for cfg in configs:
        # The plan as the parent can make it (explicit choices need no free-VRAM figure); auto: the child's.
        pc = PlacementConfig(device="cuda", **cfg.placement())
        try:
            plan = plan_placement(sizes, pc, args.standin_vram * MiB if cfg.gpu_layers is None else None).as_dict()
        except Exception as e:  # noqa: BLE001  (a configuration this model cannot take: said, and skipped)
            entry["configs"][cfg.name] = {"placement": cfg.placement(), "error": f"{type(e).__name__}: {e}"}
            print(f"[{label}] {cfg.name}: {e}", flush=True)
            continue
        lset = llama_setting(plan, sizes, L)
        c_entry: dict = {"placement": cfg.placement(), "plan_summary": plan["summary"],
                         "plan_gpu_mib": {k: v / MiB for k, v in plan["gpu_bytes"].items()},
                         "llama_equivalent": lset}
        raw: dict[str, list[dict]] = {"ours": [], "llama": []}  # every round in full; the entry keeps the best
        if cfg.gpu_layers is None and not args.cpu_standin:
            c_entry["plan_summary"] = "auto: chosen by the engine for the free VRAM (see ours.plan)"
        entry["configs"][cfg.name] = c_entry
        lkey = setting_key(lset)
        for r in range(args.rounds):
            # auto: ours first, since llama.cpp's budget follows the plan the engine chose
            order = ["llama", "ours"] if r % 2 == 0 and cfg.gpu_layers is not None else ["ours", "llama"]
            for eng in order:
                if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                    c_entry.setdefault("skipped", f"the time budget of {args.budget_s:.0f} s was spent")
                    continue
                if eng == "ours":
                    spec = {**base, "device": "cpu" if args.cpu_standin else args.device, "placement": cfg.placement(),
                            "step_graphs": cfg.step_graphs,
                            "standin_vram_mib": args.standin_vram, "modes": args.modes,
                            "share_capacities": share_caps}
                    try:
                        res = run_child("ours", spec, args.child_timeout)
                    except RuntimeError as e:
                        res = None
                        raw["ours"].append({"error": str(e)[-3000:]})
                        print(f"[{label}] round {r} ours {cfg.name}: FAILED {str(e)[-600:]}", flush=True)
                if eng == "ours" and res is not None:
                    c_entry["plan"] = res["plan"]
                    c_entry["plan_summary"] = res["plan"]["summary"]
                    c_entry["plan_gpu_mib"] = {k: v / MiB for k, v in res["plan"]["gpu_bytes"].items()}
                    if cfg.gpu_layers is None:  # the engine's own choice: llama.cpp gets its budget
                        lset = c_entry["llama_equivalent"] = llama_setting(res["plan"], sizes, L)
                        lkey = setting_key(lset)
                    rd = {"load_s": res["load_s"], "wall_s": res["wall_s"], "backend": res["backend"],
                          "modes": {m: summarise_mode(res, m) for m in res["modes"]}}
                    for k in ("vram_after_load_mib", "device_used_after_load_mib", "step_graphs"):
                        if k in res:
                            rd[k] = res[k]
                    raw["ours"].append(rd)
                    for m, s in rd["modes"].items():
                        if "decode_tok_s" in s:
                            ec = s.get("expert_cache")
                            hr = f", cache hit rate {ec['total']['hit_rate']:.3f}" if ec else ""
                            acc = f", acceptance {s['acceptance']:.3f}" if "acceptance" in s else ""
                            print(f"[{label}] round {r} ours  {cfg.name:<22} {m:<5}: decode {s['decode_tok_s']:8.2f} "
                                  f"tok/s, prefill {s['prefill_tok_s']:8.1f} tok/s, TTFT {s['ttft_ms']:8.1f} ms"
                                  f"{hr}{acc}", flush=True)
                elif eng == "llama" and llama_mode is not None:
                    if (r, lkey) not in llama_done:
                        llama_done[(r, lkey)] = run_llama_side(llama_mode, path, base, lset, args)
                        ls = llama_done[(r, lkey)]
                        for m, s in ls.get("modes", {}).items():
                            if "decode_tok_s" in s:
                                print(f"[{label}] round {r} llama {lkey:<22} {m:<5}: decode {s['decode_tok_s']:8.2f} "
                                      f"tok/s, prefill {s.get('prefill_tok_s', float('nan')):8.1f} tok/s", flush=True)
                        if "error" in ls:
                            print(f"[{label}] round {r} llama {lkey}: FAILED {ls['error'][-600:]}", flush=True)
                    raw["llama"].append({"setting": lkey, **llama_done[(r, lkey)]})
                finish_config(c_entry, raw)
                save()  # after every run: a run cut short still leaves what was measured


def run_llama_side(mode: str, path: Path, base: dict, lset: dict, args: argparse.Namespace) -> dict:
    if mode == "bench":
        try:
            return {"modes": {"plain": run_llama_bench(args.llama_bench, path, lset, args)}}
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            return {"error": str(e)[-3000:]}
    out: dict = {"modes": {}}
    for m in args.llama_modes:
        spec = {**base, "mtp": m == "mtp", "draft": LLAMA_DRAFT if m == "mtp" else None,
                "n_gpu_layers": lset["n_gpu_layers"], "n_cpu_moe": lset["n_cpu_moe"]}
        try:
            res = run_child("llama", spec, args.child_timeout)
        except RuntimeError as e:
            out["modes"][m] = {"error": str(e)[-3000:]}
            continue
        s = decode.summarise(res)
        s.update(backend=res["backend"], params=res["params"], vram_used_mib=res["vram_used_mib"])
        if m == "mtp":
            s["draft_n_max"] = LLAMA_DRAFT
        out["modes"][m] = s
    return out


ROUND_KEYS = ("decode_tok_s", "prefill_tok_s", "ttft_ms", "acceptance", "vram_peak_mib", "error", "skipped")


def _compact(rd: dict) -> dict:
    """A round as kept beside the best: its headline figures (the best round keeps everything)."""
    out = {k: v for k, v in rd.items() if k != "modes"}
    for m, s in rd.get("modes", {}).items():
        out[m] = {k: s[k] for k in ROUND_KEYS if k in s}
        ec = s.get("expert_cache")
        if ec:
            out[m]["cache_hit_rate"] = ec["total"]["hit_rate"]
    return out


def finish_config(c: dict, raw: dict[str, list[dict]]) -> None:
    """Each side's best round per mode, the ratios ours / llama.cpp, and the rounds cut to their headlines."""
    ours_ok = [r for r in raw["ours"] if "modes" in r]
    if ours_ok:
        c["ours"] = {m: best([r["modes"][m] for r in ours_ok if m in r["modes"]]) for m in ours_ok[0]["modes"]}
        for k in ("vram_after_load_mib", "device_used_after_load_mib", "load_s", "backend", "step_graphs"):
            if k in ours_ok[-1]:
                c["ours"][k] = ours_ok[-1][k]
    elif raw["ours"]:
        c["ours"] = {"error": raw["ours"][-1]["error"]}
    llama_ok = [r for r in raw["llama"] if "modes" in r]
    if llama_ok:
        c["llama_cpp"] = {m: best([r["modes"][m] for r in llama_ok if m in r["modes"]])
                          for m in llama_ok[0]["modes"]}
    elif raw["llama"]:
        c["llama_cpp"] = {"error": raw["llama"][-1].get("error", "failed")}
    o, l = c.get("ours", {}), c.get("llama_cpp", {})
    ratios = {}
    lp = l.get("plain", {}).get("decode_tok_s")
    if lp:
        for m in MODES:
            if o.get(m, {}).get("decode_tok_s"):
                ratios[f"decode_{m}_vs_llama_plain"] = o[m]["decode_tok_s"] / lp
        if o.get("plain", {}).get("prefill_tok_s") and l["plain"].get("prefill_tok_s"):
            ratios["prefill_plain"] = o["plain"]["prefill_tok_s"] / l["plain"]["prefill_tok_s"]
    lm = l.get("mtp", {}).get("decode_tok_s")
    if lm and o.get("mtp", {}).get("decode_tok_s"):
        ratios["decode_mtp_vs_llama_mtp"] = o["mtp"]["decode_tok_s"] / lm
    ob = [o[m]["decode_tok_s"] for m in MODES if o.get(m, {}).get("decode_tok_s")]
    lb = [l[m]["decode_tok_s"] for m in MODES if l.get(m, {}).get("decode_tok_s")]
    if ob and lb:
        ratios["decode_best_vs_llama_best"] = max(ob) / max(lb)
    if ratios:
        c["ratios_ours_over_llama"] = ratios
    c["ours_rounds"] = [_compact(r) for r in raw["ours"]]
    c["llama_rounds"] = [_compact(r) for r in raw["llama"]]


def llama_plan(env: dict, args: argparse.Namespace) -> tuple[str | None, dict]:
    """Which llama.cpp runs, if any: "xllamacpp" (a GPU build in-process, or its CPU build with --llama-cpu),
    "bench" (--llama-bench), or None with the reason."""
    info = dict(env.get("llama_cpp", {}))
    if not args.llama:
        info.update(ran=False, why="--no-llama")
        return None, info
    if args.llama_bench:
        if not Path(args.llama_bench).is_file():
            raise UsageError(f"--llama-bench {args.llama_bench}: no such file")
        info.update(ran=True, mode="llama-bench", binary=args.llama_bench)
        return "bench", info
    if info.get("available") and not args.cpu_standin:
        info.update(ran=True, mode="xllamacpp (CUDA build, in-process server)")
        return "xllamacpp", info
    if args.llama_cpu and "package" in info:
        info.update(ran=True, mode="xllamacpp CPU build (--llama-cpu: exercises the path; CPU against CPU)")
        return "xllamacpp", info
    why = info.get("why") or "no GPU here"
    info.update(ran=False, why=f"llama.cpp CUDA unavailable: {why}")
    return None, info


def git_info() -> dict:
    try:
        g = decode.git_info()
    except OSError:  # no git program here
        g = {"commit": ""}
    if not g["commit"]:  # a copy of the tree without its repository (a device machine's): the caller's commit
        return {"commit": None, "dirty": None,
                "note": "no git repository where this ran: the commit is the one the tree was copied from"}
    return g


def parse_list(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        for t in out:
            if t not in allowed:
                raise argparse.ArgumentTypeError(f"{t!r} is not one of {', '.join(allowed)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=parse_list, default=parse_list("qwen36-35b"),
                    help="comma-separated: embedded, a synthetic shape (qwen36-35b, mid, ...) or a GGUF path")
    ap.add_argument("--configs", type=parse_list, default=["auto"], help="comma-separated configurations, or auto")
    ap.add_argument("--modes", type=lambda s: parse_list(s, MODES), default=list(MODES))
    ap.add_argument("--decode", type=int, default=64, help="tokens decoded per prompt")
    ap.add_argument("--prompt", type=int, default=128, help="synthetic / path models: prompt tokens")
    ap.add_argument("--chat-prompts", type=int, default=3, help="embedded model: held-out chat prompts per run")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--llama", action=argparse.BooleanOptionalAction, default=True,
                    help="llama.cpp beside ours, where a CUDA build is here (default on)")
    ap.add_argument("--llama-cpu", action="store_true", help="run xllamacpp's CPU build when it has no GPU device")
    ap.add_argument("--llama-bench", default=None, help="a llama-bench binary built with CUDA, instead of xllamacpp")
    ap.add_argument("--llama-modes", type=lambda s: parse_list(s, MODES), default=["plain"],
                    help=f"xllamacpp: plain and/or mtp (draft-mtp, n_max {LLAMA_DRAFT})")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds (0: no limit)")
    ap.add_argument("--child-timeout", type=float, default=900.0)
    ap.add_argument("--dir", default=str(Path.home() / ".cache/foretell-bench"), help="where synthetic models live")
    ap.add_argument("--cpu-standin", action="store_true",
                    help="no CUDA: run the CUDA plans on CPU stand-ins (hit rates real, timings CPU)")
    ap.add_argument("--standin-vram", type=float, default=80 * 1024, help="MiB of free VRAM assumed for `auto` "
                    "plans on stand-ins (and for the parent's auto plan)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/hybrid.json"))
    ap.add_argument("--child", choices=["ours", "llama", "probe"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args.child)
        return
    try:
        run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    if args.decode < 2 or args.rounds < 1:
        raise UsageError("--decode must be at least 2 and --rounds at least 1")
    env = run_child("probe", {"gpu": not args.cpu_standin}, 300.0)
    if not args.cpu_standin:
        if not env["cuda_available"]:
            why = (f"this torch ({env['torch']}) has no CUDA support" if not env["torch_cuda"]
                   else "torch sees no usable NVIDIA GPU")
            raise UsageError(f"no CUDA device: {why}; pass --cpu-standin to run the sweep on CPU stand-ins")
        if not args.device.startswith("cuda"):
            raise UsageError(f"--device {args.device}: the benchmark is for CUDA devices (or --cpu-standin)")
    llama_mode, llama_info = llama_plan(env, args)
    env["llama_mode"] = llama_mode
    machine = decode.machine_info(args.threads)
    machine.update({k: env.get(k) for k in ("python", "torch", "torch_cuda", "triton", "gpu", "engine_cuda_status")
                    if k in env})
    try:
        import psutil

        machine["ram_gib"] = psutil.virtual_memory().total / 2**30
    except ImportError:
        pass
    result: dict = {
        "command": " ".join(["python", "bench/hybrid.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_info(),
        "machine": machine,
        "standin": bool(args.cpu_standin),
        "standin_note": ("CUDA plans run on CPU stand-ins: hit rates are real (the real routing), timings are CPU "
                         "timings, not GPU ones") if args.cpu_standin else None,
        "llama_cpp": llama_info,
        "settings": {"models": args.model, "configs": args.configs, "modes": args.modes, "decode": args.decode,
                     "prompt": args.prompt, "chat_prompts": args.chat_prompts, "threads": args.threads,
                     "rounds": args.rounds, "device": "cpu (stand-in)" if args.cpu_standin else args.device,
                     "llama_modes": args.llama_modes, "budget_s": args.budget_s,
                     "decoding": "greedy (temperature 0, top-k 1), EOS ignored; MTP at auto depth",
                     "warmup_tokens": WARMUP_TOKENS},
        "models": {},
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["duration_s"] = time.perf_counter() - t_start
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out_path)

    if "gpu" in env:
        st = env.get("engine_cuda_status", {})
        print(f"GPU: {env['gpu']['name']} ({env['gpu']['vram_mib'] / 1024:.0f} GiB), torch {env['torch']}, triton "
              f"{env['triton']}; engine CUDA {'usable' if st.get('usable') else 'NOT usable'}"
              f"{': ' + st['note'] if st.get('note') else ''}", flush=True)
    if llama_mode is None:
        print(f"llama.cpp: not run ({llama_info['why']})", flush=True)
    for name in args.model:
        measure_model(name, args, env, result, save, t_start)
    machine["load_avg_at_end"] = list(os.getloadavg())
    save()
    print_summary(result)
    print(f"wrote {out_path} ({result['duration_s']:.0f} s)")


def _num(d: object, k: str = "decode_tok_s") -> str:
    v = d.get(k) if isinstance(d, dict) else None
    return f"{v:8.2f}" if isinstance(v, (int, float)) else "       -"


def print_summary(result: dict) -> None:
    tag = " (CPU stand-ins)" if result["standin"] else ""
    for label, m in result["models"].items():
        print(f"== {label}{tag}: decode tok/s, ours plain / mtp, llama.cpp plain, ratio; cache hit rate")
        for name, c in m["configs"].items():
            o, lc = c.get("ours", {}), c.get("llama_cpp", {})
            ec = o.get("plain", {}).get("expert_cache") if isinstance(o.get("plain"), dict) else None
            hr = f"{ec['total']['hit_rate']:.3f}" if ec else "-"
            ratio = c.get("ratios_ours_over_llama", {}).get("decode_plain_vs_llama_plain")
            print(f"  {name:<24} {_num(o.get('plain'))} {_num(o.get('mtp'))}  {_num(lc.get('plain'))}  "
                  f"{('x%.3f' % ratio) if ratio else '     -'}  {hr}  {c.get('error') or c.get('skipped') or ''}")


if __name__ == "__main__":
    main()
