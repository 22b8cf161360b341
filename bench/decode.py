"""Prefill / decode / time to first token, ours vs llama.cpp's own server, plain and with MTP drafting.

    python bench/decode.py [--cases embedded,mid,load] [--threads 2] [--rounds 3] [--depths 1,2,3,4,auto]
                           [--chat-prompts 6] [--chat-decode 64] [--prompt 512] [--decode 128]
                           [--load-decode 32] [--no-warmup] [--out bench/results/decode.json]

The peer is llama.cpp's server (`llama-server`'s code, run in-process by the `xllamacpp` wheel: `xllamacpp.Server`
with its default settings — batch 2048 / ubatch 512, warm-up at load, OpenMP — one slot, prompt cache off per
request), asked through its OpenAI completions handler with the same prompt token ids we decode from, streaming.
MTP on its side is llama.cpp's `draft-mtp` speculative type with `speculative.draft.n_max` = K (n_min, p_min at
their defaults, recorded in the JSON). Our engine runs on its default backend (`engine.ops.default_backend()`)
through `Engine.generate` (`GenerationConfig(mtp=…, draft=K | None for auto)`).

Cases (`--cases`):
* `embedded`: the embedded default model (`resources/models/`, what the app runs out of the box) answering the
  first `--chat-prompts` held-out evaluation prompts (`engine.training.data.eval_prompts`: short user turns, the
  chat it was trained for) through its chat template with the generation prompt; `--chat-decode` tokens each.
  Settings: plain (MTP off), MTP at fixed depths K (`--depths`) on both sides, and our auto depth.
* `mid`: the mid-size synthetic MoE (`bench/synthetic.py`, 24 layers, 64 experts top-8, Q4_K/Q6_K, random
  weights: draft acceptance ≈ 0, so MTP shows the cost of drafting), one fixed random `--prompt`-token prompt,
  `--decode` tokens; the same settings.
* `load` (= `load-mid` and `load-embedded`): plain decode on those models while one other process spins
  (`python -c "while True: pass"`, started before the engine's process and killed after it), `--load-decode`
  tokens: how each engine copes with a core taken away.

Greedy on both sides (temperature 0, top-k 1) and EOS ignored on both, so both decode exactly the asked count.
Every (engine, setting) run is a process of its own (a subprocess of this script) from a fresh load, with
`--threads` threads; with warm-up on (the default) it first decodes 4 untimed tokens from another prompt, as
llama.cpp's server warms up at load (our first pass packs weights on first use on the VNNI backend). Within a
round the runs go setting by setting, the two engines alternating, and which engine goes first alternates round by
round, so a host whose speed drifts affects both alike. Each side's best round counts (per setting: highest decode
and prefill tok/s, lowest TTFT); the median over rounds of the paired per-round ratios is given beside.

Measured per run, summed over its prompts: decode tok/s = (tokens − 1) / (time of the last token − time of the
first), as llama.cpp's server counts it; TTFT = wall time from the request to the first token, on the caller's
side (ours: `Stats.ttft_s`; llama.cpp: arrival of the first streamed chunk); prefill tok/s as each engine reports
it (ours: `Stats.prefill_tok_s`, which with MTP includes the head's pass over the prompt; llama.cpp: `timings`
prompt_per_second); draft acceptance = accepted / drafted (ours: `Stats.speculative`; llama.cpp: `timings`
draft_n_accepted / draft_n). llama.cpp's own `timings` decode figure is kept beside, as is each run's peak RSS.
Token-level agreement with llama.cpp is the oracle tests' business (the server's streamed OpenAI text is not
comparable token for token with ours: it carries no token ids and withholds partial UTF-8 and stop-word prefixes).

Also the peak RSS of loading the mid model in our engine (in a fresh process), which must stay ≤ 1.3 × the file
size: weights stay quantized and memory-mapped.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINES = ("ours", "llama_cpp")
WARMUP_TOKENS = 4
SPINNER = "while True: pass"


# ---------------------------------------------------------------------------------------------- child runs
def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def final_stats(eng, ids: list[int], gen):  # type: ignore[no-untyped-def]
    """Run one reply of ours to the end: its final Stats event."""
    from engine.generate import Stats

    final = None
    for ev in eng.generate(ids, gen):
        if isinstance(ev, Stats) and ev.final:
            final = ev
    assert final is not None
    return final


def write_result(result: dict, out: Path) -> None:
    """A benchmark's JSON into `out` (its folder made), and a line saying so."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def run_record(final) -> dict:  # type: ignore[no-untyped-def]
    """One reply's figures from its final Stats (tokens, TTFT, prefill and decode seconds, MTP counters)."""
    sp = final.speculative
    out = {"prompt_tokens": final.prompt_tokens, "generated_tokens": final.generated_tokens,
           "ttft_s": final.ttft_s, "prefill_s": final.prefill_tokens / final.prefill_tok_s,
           "decode_tokens": max(final.generated_tokens - 1, 0), "decode_s": final.elapsed_s - final.ttft_s}
    if sp is not None:
        out.update({"drafted": sp.drafted, "accepted": sp.accepted, "verify_steps": sp.verify_steps,
                    "plain_steps": sp.plain_steps, "mean_accepted_length": sp.mean_accepted_length,
                    "tried_by_depth": sp.tried_by_depth, "accepted_by_depth": sp.accepted_by_depth,
                    "time_s": dataclasses.asdict(sp.time_s)})
    return out


def run_ours(spec: dict) -> dict:
    import engine  # noqa: F401  (first, as the app and the CLI import it: it sets torch's OpenMP wait policy)
    import torch

    from engine import ops
    from engine.generate import EngineConfig, GenerationConfig, load
    from engine.sampling import SamplingConfig

    threads = spec["threads"]
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    backend = ops.backend_named(spec["backend"]) if spec.get("backend") else None  # None: the default
    eng = load(spec["model"], EngineConfig(n_ctx=spec["n_ctx"], n_threads=threads, backend=backend,
                                           auto_memory_dir=spec.get("auto_memory_dir")))
    load_s = time.perf_counter() - t0
    eng.tokenizer.eog_ids = frozenset()  # EOS ignored: every run decodes exactly n tokens
    greedy = SamplingConfig(temperature=0.0, top_k=1)

    def one(ids: list[int], n: int) -> dict:
        eng.reset()  # no reuse of the previous prompt's cache
        gen = GenerationConfig(max_tokens=n, sampling=greedy, mtp=spec["mtp"], draft=spec["draft"],
                               stats_interval_s=3600.0)  # only the final Stats: no periodic UI statistics
        return run_record(final_stats(eng, ids, gen))

    if spec["warmup"]:
        one(spec["warmup_prompt"], WARMUP_TOKENS)
    runs = [one(ids, spec["n"]) for ids in spec["prompts"]]
    return {"load_s": load_s, "backend": (eng.config.backend or ops.default_backend()).name, "prompts": runs,
            "peak_rss_mib": _peak_rss_mib()}


def peer_env() -> dict[str, str]:
    """The environment a llama.cpp process starts with: this one's without an OpenMP wait policy, so that llama.cpp
    runs under its own default. tests.oracle_llama sets OMP_WAIT_POLICY=PASSIVE for its in-process llama.cpp (the
    benchmarks import it to quantize their files), and engine/__init__ sets it while it loads torch."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def peer_process_check() -> None:
    """Refuse to run llama.cpp where its OpenMP threads would sleep at every barrier: in a process that loaded torch
    (torch loads the same libgomp.so.1, and engine/__init__ loads it under a passive wait policy) or one started with
    a wait policy set. On a 2-core AVX2 host its embedded-model decode went from 565-730 tok/s in a clean process to
    40 in one that had imported engine first; the benchmarks' llama.cpp children did so from 4ac649c on (through an
    argument default), and bench/sweep.py's from the first file it quantized (through the environment)."""
    if "torch" in sys.modules:
        raise RuntimeError("llama.cpp must run in a process that has not imported torch (engine imports it): their "
                           "shared libgomp would run llama.cpp's threads under engine's passive OpenMP wait policy")
    if "OMP_WAIT_POLICY" in os.environ:
        raise RuntimeError("llama.cpp must run under its own OpenMP wait policy: start it with bench.decode.peer_env() "
                           f"(OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} is set)")


def run_llama(spec: dict) -> dict:
    peer_process_check()
    import xllamacpp as xl

    threads = spec["threads"]
    p = xl.CommonParams()
    p.model.path = spec["model"]
    p.n_ctx = spec["n_ctx"]
    p.n_parallel = 1
    p.n_predict = spec["n"]
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.warmup = spec["warmup"]
    p.sampling.temp = 0.0
    p.sampling.top_k = 1
    if spec["mtp"]:
        p.speculative.types = [xl.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_MTP]
        p.speculative.draft.n_max = spec["draft"]
        p.speculative.draft.cpuparams.n_threads = threads
        p.speculative.draft.cpuparams_batch.n_threads = threads
    t0 = time.perf_counter()
    server = xl.Server(p)
    load_s = time.perf_counter() - t0

    def one(ids: list[int], n: int) -> dict:
        req = {"prompt": ids, "max_tokens": n, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
               "cache_prompt": False, "stream": True}
        chunks: list[tuple[float, dict]] = []
        t_req = time.perf_counter()
        server.handle_completions(req, lambda c: chunks.append((time.perf_counter(), c)))
        # the first chunk carries the first token; the last carries finish_reason, usage and timings
        tok_chunks = [(t, c) for t, c in chunks if isinstance(c, dict) and c.get("choices")]
        if not tok_chunks or "timings" not in tok_chunks[-1][1]:
            raise RuntimeError(f"llama.cpp answered no tokens / no timings: {str(chunks[-3:])[:800]}")
        t_first, t_last = tok_chunks[0][0], tok_chunks[-1][0]
        last = tok_chunks[-1][1]
        tm, usage = last["timings"], last.get("usage", {})
        gen = int(usage.get("completion_tokens", tm["predicted_n"]))
        out = {"prompt_tokens": int(usage.get("prompt_tokens", tm["prompt_n"])), "generated_tokens": gen,
               "ttft_s": t_first - t_req, "prefill_s": tm["prompt_ms"] / 1e3,
               "decode_tokens": max(gen - 1, 0), "decode_s": t_last - t_first,
               "server_decode_s": tm["predicted_ms"] / 1e3, "server_prompt_n": tm["prompt_n"]}
        if "draft_n" in tm:
            out.update({"drafted": int(tm["draft_n"]), "accepted": int(tm["draft_n_accepted"])})
        return out

    if spec["warmup"]:
        one(spec["warmup_prompt"], WARMUP_TOKENS)
    runs = [one(ids, spec["n"]) for ids in spec["prompts"]]
    for r, ids in zip(runs, spec["prompts"]):
        if r["server_prompt_n"] != len(ids):
            raise RuntimeError(f"llama.cpp processed {r['server_prompt_n']} of {len(ids)} prompt tokens")
    return {"load_s": load_s, "backend": "llama.cpp " + xl.get_system_info().strip(), "prompts": runs,
            "peak_rss_mib": _peak_rss_mib()}


def summarise(res: dict) -> dict:
    """One run's figures over all its prompts."""
    ps = res["prompts"]
    dec_n, dec_s = sum(p["decode_tokens"] for p in ps), sum(p["decode_s"] for p in ps)
    pre_n, pre_s = sum(p["prompt_tokens"] for p in ps), sum(p["prefill_s"] for p in ps)
    out = {"decode_tok_s": dec_n / dec_s, "prefill_tok_s": pre_n / pre_s,
           "ttft_ms": 1e3 * statistics.fmean(p["ttft_s"] for p in ps),
           "decode_tokens": dec_n, "decode_s": dec_s, "prompt_tokens": pre_n, "prefill_s": pre_s,
           "generated_per_prompt": sorted({p["generated_tokens"] for p in ps}),
           "load_s": res["load_s"], "peak_rss_mib": res["peak_rss_mib"]}
    if "wall_s" in res:
        out["process_wall_s"] = res["wall_s"]
    if "load_avg_1m_at_start" in res:
        out["load_avg_1m_at_start"] = res["load_avg_1m_at_start"]
    if "server_decode_s" in ps[0]:  # llama.cpp's own count: (n − 1) over its generation time
        out["server_decode_tok_s"] = dec_n / sum(p["server_decode_s"] for p in ps)
    if any("drafted" in p for p in ps):
        drafted, accepted = sum(p.get("drafted", 0) for p in ps), sum(p.get("accepted", 0) for p in ps)
        out.update({"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0})
    return out


def child_main(engine: str) -> None:
    spec = json.loads(sys.stdin.read())
    res = (run_ours if engine == "ours" else run_llama)(spec)
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------------- parent
def load_rss(path: Path) -> dict:
    """Load in a child process and report its peak RSS (MiB) right after loading."""
    code = (
        "import resource, sys, torch; torch.set_num_threads(1); "
        "from engine.generate import EngineConfig, load; "
        f"e = load({str(path)!r}, EngineConfig(n_ctx=1024)); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    peak_kib = int(out.stdout.strip().splitlines()[-1])
    return {"peak_rss_mib": peak_kib / 1024, "file_mib": path.stat().st_size / 2**20,
            "ratio": peak_kib * 1024 / path.stat().st_size}


def run_child(engine: str, spec: dict, busy: bool, timeout: float) -> dict:
    load_avg = os.getloadavg()[0]  # the host's state as the run starts (the spinner not yet counted)
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER]) if busy else None
    try:
        if spinner is not None:
            time.sleep(0.5)  # spinning before the engine starts
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine]
        out = subprocess.run(cmd, input=json.dumps(spec), capture_output=True, text=True, cwd=ROOT,
                             timeout=timeout, env=peer_env() if engine == "llama" else None)
        if spinner is not None and spinner.poll() is not None:
            raise RuntimeError("the background spinner died during the run")
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} child failed (rc {out.returncode}):\n{out.stderr[-3000:]}\n{out.stdout[-1000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "load_avg_1m_at_start": load_avg}


def machine_info(threads: int) -> dict:
    info: dict = {"cpu": platform.machine(), "cores": os.cpu_count(), "threads": threads,
                  "load_avg_at_start": list(os.getloadavg())}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() == "model name" and "cpu_model" not in info:
            info["cpu_model"] = val.strip()
        elif key.strip() == "flags" and "flags" not in info:
            flags = set(val.split())
            info["flags"] = sorted(f for f in flags if f in {"avx", "avx2", "fma", "f16c", "avx_vnni", "amx_int8"}
                                   or f.startswith("avx512"))
            info["avx2"] = "avx2" in flags
            info["avx512"] = "avx512f" in flags
            info["avx512_vnni"] = "avx512_vnni" in flags
    return info


def device_or_exit(device: str, script: str) -> dict | None:
    """A CUDA device's name, memory, multiprocessors and Triton version (None for the CPU); a script asked for CUDA
    where there is none says so in one line and exits 2."""
    import torch

    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA device here (torch {torch.__version__})")
        sys.exit(2)
    import triton
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "vram_mib": p.total_memory >> 20, "sms": p.multi_processor_count,
            "triton": triton.__version__}


def git_info() -> dict:
    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT)
        return r.stdout.strip() if r.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def settings_for(depths: list, engine: str, plain_only: bool) -> list[tuple[str, bool, int | None]]:
    out: list[tuple[str, bool, int | None]] = [("off", False, None)]
    if plain_only:
        return out
    out += [(f"k{k}", True, k) for k in depths if k != "auto"]
    if "auto" in depths and engine == "ours":  # llama.cpp has no automatic depth
        out.append(("auto", True, None))
    return out


def best_of(runs: list[dict]) -> dict:
    """A side's best round for one setting: highest decode and prefill tok/s, lowest TTFT (each its own round)."""
    d = max(runs, key=lambda r: r["decode_tok_s"])
    out = dict(d)
    out["prefill_tok_s"] = max(r["prefill_tok_s"] for r in runs)
    out["ttft_ms"] = min(r["ttft_ms"] for r in runs)
    out["decode_tok_s_by_round"] = [r["decode_tok_s"] for r in runs]
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    return out


def mtp_names(side: dict) -> list[str]:
    return [k for k in side if k != "off"]


def case_summary(rounds: list[dict], ours: dict, ref: dict) -> dict:
    """Headline ratios ours / llama.cpp from the best rounds, and the medians of the rounds' paired ratios."""
    def ratios(o: dict, r: dict) -> dict:
        return {"decode": o["decode_tok_s"] / r["decode_tok_s"], "prefill": o["prefill_tok_s"] / r["prefill_tok_s"],
                "ttft": o["ttft_ms"] / r["ttft_ms"]}

    def pairs(side_o: dict, side_r: dict) -> dict:
        out = {"plain": ("off", "off")}
        om, rm = mtp_names(side_o), mtp_names(side_r)
        if om and rm:
            ob = max(om, key=lambda k: side_o[k]["decode_tok_s"])
            rb = max(rm, key=lambda k: side_r[k]["decode_tok_s"])
            out["mtp_best_vs_llama_mtp_best"] = (ob, rb)
            if "auto" in side_o:
                out["mtp_auto_vs_llama_mtp_best"] = ("auto", rb)
        if om:
            ob = max(om, key=lambda k: side_o[k]["decode_tok_s"])
            out["mtp_best_vs_llama_plain"] = (ob, "off")
            if "auto" in side_o:
                out["mtp_auto_vs_llama_plain"] = ("auto", "off")
        return out

    best = {name: {"ours": a, "llama_cpp": b, **ratios(ours[a], ref[b])} for name, (a, b) in pairs(ours, ref).items()}
    per_round: dict[str, list[dict]] = {}
    for rd in rounds:
        for name, (a, b) in pairs(rd["ours"], rd["llama_cpp"]).items():
            per_round.setdefault(name, []).append(ratios(rd["ours"][a], rd["llama_cpp"][b]))
    median = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in per_round.items()}
    out: dict = {"ratios": best, "ratios_median_of_rounds": median}
    if mtp_names(ours):
        out["ours_mtp_best"] = max(mtp_names(ours), key=lambda k: ours[k]["decode_tok_s"])
    if mtp_names(ref):
        out["llama_cpp_mtp_best"] = max(mtp_names(ref), key=lambda k: ref[k]["decode_tok_s"])
    return out


def run_case(name: str, model: Path, prompts: list[list[int]], warm: list[int], n: int, busy: bool,
             args: argparse.Namespace) -> dict:
    plain_only = busy
    settings = {e: settings_for(args.depths, e, plain_only) for e in ENGINES}
    base = {"model": str(model), "prompts": prompts, "warmup_prompt": warm, "n": n, "threads": args.threads,
            "warmup": not args.no_warmup,
            "n_ctx": max(len(p) for p in prompts + [warm]) + n + 64}
    names = [s[0] for s in settings["ours"]]  # ours ⊇ llama.cpp's settings
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = ["llama_cpp", "ours"] if r % 2 == 0 else ["ours", "llama_cpp"]
        raw: dict[str, dict[str, dict]] = {e: {} for e in ENGINES}
        for setting in names:
            for eng in order:
                match = [s for s in settings[eng] if s[0] == setting]
                if not match:
                    continue
                _, mtp, draft = match[0]
                spec = {**base, "mtp": mtp, "draft": draft}
                t0 = time.perf_counter()
                res = run_child("ours" if eng == "ours" else "llama", spec, busy, args.child_timeout)
                res["wall_s"] = time.perf_counter() - t0  # the whole child: start, load, warm-up, prompts
                raw[eng][setting] = res
                s = summarise(res)
                acc = f", acceptance {s['acceptance']:.3f}" if "acceptance" in s else ""
                print(f"[{name}] round {r} {eng:<9} {setting:<4}: decode {s['decode_tok_s']:8.2f} tok/s, prefill "
                      f"{s['prefill_tok_s']:8.1f} tok/s, TTFT {s['ttft_ms']:8.1f} ms{acc}", flush=True)
        rounds.append({"order": order, "raw": raw,
                       **{e: {k: summarise(v) for k, v in raw[e].items()} for e in ENGINES}})
    sides = {e: {k: best_of([rd[e][k] for rd in rounds]) for k in rounds[0][e]} for e in ENGINES}
    out = {"model": {"file": model.name, "bytes": model.stat().st_size}, "busy_background_process": busy,
           "prompt_tokens": [len(p) for p in prompts], "decode_tokens_per_prompt": n,
           "ours": sides["ours"], "llama_cpp": sides["llama_cpp"],
           **case_summary(rounds, sides["ours"], sides["llama_cpp"]),
           "rounds": [{"order": rd["order"], "ours": rd["ours"], "llama_cpp": rd["llama_cpp"]} for rd in rounds]}
    return out


def parse_depths(text: str) -> list:
    from engine.validate import draft_arg

    out: list = []
    for x in filter(None, (t.strip() for t in text.split(","))):
        if x == "auto":
            out.append("auto")
        elif x not in ("none", "off"):
            out.append(draft_arg(x))
    return out


CASES = ("embedded", "mid", "load-mid", "load-embedded")


def parse_cases(text: str) -> list[str]:
    out: list[str] = []
    for c in filter(None, (t.strip() for t in text.split(","))):
        for x in (["load-mid", "load-embedded"] if c == "load" else [c]):
            if x not in CASES:
                raise argparse.ArgumentTypeError(f"unknown case {x!r} (one of {', '.join(CASES)}, load)")
            if x not in out:
                out.append(x)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=parse_cases, default=parse_cases("embedded,mid,load"),
                    help="comma-separated: embedded, mid, load (= load-mid,load-embedded), load-mid, load-embedded")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    # parsed after the --child dispatch: parse_depths imports engine, which a llama.cpp child must not
    ap.add_argument("--depths", default="1,2,3,4,auto",
                    help="MTP draft depths K (both engines) and 'auto' (ours); 'none': plain decode only")
    ap.add_argument("--chat-prompts", type=int, default=6, help="embedded model: held-out chat prompts per run")
    ap.add_argument("--chat-decode", type=int, default=64, help="embedded model: tokens decoded per prompt")
    ap.add_argument("--prompt", type=int, default=512, help="mid model: prompt tokens")
    ap.add_argument("--decode", type=int, default=128, help="mid model: tokens decoded")
    ap.add_argument("--load-decode", type=int, default=32, help="under load: tokens decoded per prompt")
    ap.add_argument("--no-warmup", action="store_true", help="time the first request after loading (no warm-up)")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS-after-load measurement")
    ap.add_argument("--child-timeout", type=float, default=1800.0, help="seconds one engine run may take")
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode.json"))
    ap.add_argument("--child", choices=["ours", "llama"], help=argparse.SUPPRESS)  # one run, in its own process
    args = ap.parse_args()
    if args.child:
        child_main(args.child)
        return
    try:
        args.depths = parse_depths(args.depths)
    except argparse.ArgumentTypeError as e:
        ap.error(f"argument --depths: {e}")

    import xllamacpp

    from engine import ops
    from engine.chat import ChatFormat, Message
    from engine.storage.modelfile import default_model_path, open_model
    from engine.tokenizer import Tokenizer

    t_start = time.perf_counter()
    machine = machine_info(args.threads)
    xl_defaults = xllamacpp.CommonParams()
    result: dict = {
        "command": " ".join(["python", "bench/decode.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_info(),
        "machine": machine,
        "backend": ops.default_backend().name,
        "llama_cpp": {"package": f"xllamacpp {xllamacpp.__version__}",
                      "system_info": xllamacpp.get_system_info().strip(),
                      "draft_n_min": xl_defaults.speculative.draft.n_min,
                      "draft_p_min": xl_defaults.speculative.draft.p_min,
                      "n_batch": xl_defaults.n_batch, "n_ubatch": xl_defaults.n_ubatch,
                      "poll": xl_defaults.cpuparams.poll},
        "settings": {"threads": args.threads, "rounds": args.rounds, "depths": args.depths,
                     "warmup": not args.no_warmup, "decoding": "greedy (temperature 0, top-k 1), EOS ignored",
                     "chat_prompts": args.chat_prompts, "chat_decode": args.chat_decode, "prompt": args.prompt,
                     "decode": args.decode, "load_decode": args.load_decode, "cases": args.cases},
        "cases": {},
    }

    def embedded_prompts() -> tuple[Path, list[list[int]], list[int]]:
        from engine.training.data import eval_prompts

        path = default_model_path()
        mf = open_model(path)
        chat = ChatFormat(mf.get("tokenizer.chat_template"), Tokenizer.from_metadata(mf.metadata))
        items = eval_prompts(240)[:args.chat_prompts + 1]
        ids = [chat.encode([Message(m.role, m.content) for m in it.messages], add_generation_prompt=True)
               for it in items]
        return path, ids[:args.chat_prompts], ids[-1]  # the one after them warms up

    def mid_prompts() -> tuple[Path, list[list[int]], list[int]]:
        from bench.synthetic import cached

        path = cached("mid", ROOT / "build/bench")
        prompt = np.random.default_rng(0).integers(0, 32000, args.prompt).tolist()
        warm = np.random.default_rng(1).integers(0, 32000, 16).tolist()
        return path, [prompt], warm

    for case in args.cases:
        path, prompts, warm = embedded_prompts() if case.endswith("embedded") else mid_prompts()
        busy = case.startswith("load-")
        n = args.load_decode if busy else (args.chat_decode if case == "embedded" else args.decode)
        if case == "embedded":
            workload = (f"first {len(prompts)} held-out evaluation chat prompts through the chat template, "
                        f"{n} tokens each, EOS ignored")
        elif case == "mid":
            workload = f"one random {len(prompts[0])}-token prompt, {n} tokens, EOS ignored"
        else:
            what = ("embedded model, " + f"{len(prompts)} chat prompts" if case == "load-embedded"
                    else f"mid model, one random {len(prompts[0])}-token prompt")
            workload = f"{what}, {n} tokens each, plain decode, one busy background process"
        print(f"== {case}: {path.name}: {workload}", flush=True)
        res = run_case(case, path, prompts, warm, n, busy, args)
        res["workload"] = workload
        if case == "mid":
            from bench.synthetic import MID

            res["model"]["shape"] = MID.__dict__
        result["cases"][case] = res
    for case in ("mid", "embedded"):  # how much the busy process slows each engine's plain decode
        if case in result["cases"] and f"load-{case}" in result["cases"]:
            loaded, free = result["cases"][f"load-{case}"], result["cases"][case]
            loaded["slowdown_vs_unloaded"] = {e: loaded[e]["off"]["decode_tok_s"] / free[e]["off"]["decode_tok_s"]
                                              for e in ENGINES}
    if not args.no_rss and any(c.endswith("mid") for c in args.cases):
        from bench.synthetic import cached

        result["load_memory"] = load_rss(cached("mid", ROOT / "build/bench"))
    machine["load_avg_at_end"] = list(os.getloadavg())
    result["duration_s"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {args.out} ({result['duration_s']:.0f} s)")


def print_summary(result: dict) -> None:
    for case, c in result["cases"].items():
        print(f"== {case} ({c['model']['file']}): best rounds")
        for name in c["ours"]:
            o, r = c["ours"][name], c["llama_cpp"].get(name)
            line = f"  {name:<4} ours {o['decode_tok_s']:8.2f} tok/s"
            if r is not None:
                line += (f"  llama.cpp {r['decode_tok_s']:8.2f} tok/s"
                         f"  ratio {o['decode_tok_s'] / r['decode_tok_s']:.3f}")
            print(line)
        for name, q in c["ratios"].items():
            m = c["ratios_median_of_rounds"][name]
            print(f"  {name} ({q['ours']} vs {q['llama_cpp']}): decode ×{q['decode']:.3f} (median of rounds "
                  f"×{m['decode']:.3f}), prefill ×{q['prefill']:.3f}, TTFT ×{q['ttft']:.3f}")


if __name__ == "__main__":
    main()
