"""Where a CUDA decode step's time goes: kernels per step, GPU-busy time per step against wall time, top kernels.

    python bench/cuda_profile.py [--model embedded|qwen36-35b|PATH] [--graphs off,auto] [--modes plain,mtp]
                                 [--dir ~/.cache/foretell-bench] [--device cuda] [--out bench/results/cuda_profile.json]

For each step-graph setting (`--graphs`: `off` runs op by op, `auto` replays the captured step), one load of the
model (every layer and expert resident on `--device`), an untimed 8-token warm-up, then two greedy generations from
the same 64-token prompt under torch.profiler (CPU and CUDA activity): 1 token and 17 tokens. Their difference over
16 is one decoded token with the prefill cancelled: wall ms, kernels launched, summed kernel time (GPU busy) and its
share of wall, and the 15 kernels with the most device time over the 17-token run. `--modes`: `plain` (MTP off),
`mtp` (MTP at a fixed draft depth of 2, so drafts, verifies and commits run whatever their acceptance; per token,
not per step), each with the trunk's and the MTP head's step-graph captures and replays over the two runs. A busy share well
under 100 % means launches and host work leave the GPU idle; a kernel's µs per call against its bytes says whether
the kernel itself reads at the memory's speed.

`--model`: `embedded` (resources/models/), a name of bench/synthetic.py's SHAPES (written once into `--dir`), or a
GGUF path. Without CUDA the script says so in one line and exits 2 unless `--device cpu` (then only wall times mean
anything: a check that the script runs).
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.decode import device_or_exit, git_info, machine_info, write_result  # noqa: E402
from engine.events import EngineConfig  # noqa: E402
from engine.generate import load  # noqa: E402
from tests.generation import collect  # noqa: E402

EMBEDDED = ROOT / "resources" / "models" / "foretell-demo.gguf"
PROMPT = list(range(100, 164))
SHORT, LONG = 1, 17
TOP = 15
DRAFT = 2  # the MTP mode's fixed depth


def model_path(name: str, cache_dir: Path) -> Path:
    if name == "embedded":
        return EMBEDDED
    from bench.synthetic import SHAPES, cached
    if name in SHAPES:
        return cached(name, cache_dir)
    return Path(name)


def profiled(eng, n: int, cuda: bool, mtp: bool) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    """Wall seconds and the profile of one greedy generation of n tokens from PROMPT."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    eng.reset()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        collect(eng, PROMPT, max_tokens=n, mtp=mtp, draft=DRAFT if mtp else None)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return wall, prof


def kernels(prof) -> list:  # type: ignore[no-untyped-def]
    from torch.autograd import DeviceType

    return [a for a in prof.key_averages() if a.device_type == DeviceType.CUDA]


def measure(path: Path, graphs: str, device: str, modes: list[str]) -> dict:
    cuda = device.startswith("cuda")
    t = time.perf_counter()
    eng = load(str(path), EngineConfig(n_ctx=512, device=device, step_graphs=graphs))
    load_s = time.perf_counter() - t
    eng.tokenizer.eog_ids = frozenset()  # every run decodes exactly its tokens
    out: dict = {"load_s": load_s, "step_graphs": {"used": eng.runner.graphs is not None,
                                                   "head_used": eng.runner.mtp is not None
                                                   and eng.runner.mtp.graphs is not None}, "modes": {}}
    for mode in modes:
        mtp = mode == "mtp"
        if mtp and eng.drafter is None:
            out["modes"][mode] = {"skipped": "the model has no MTP block"}
            continue
        collect(eng, PROMPT, max_tokens=8, mtp=mtp, draft=DRAFT if mtp else None)  # kernels compiled, graphs captured
        g0 = eng.runner.graph_counts()
        runs = {n: profiled(eng, n, cuda, mtp) for n in (SHORT, LONG)}
        per = {}
        for n, (wall, prof) in runs.items():
            ks = kernels(prof)
            per[n] = {"wall_ms": wall * 1e3, "kernels": sum(a.count for a in ks),
                      "kernel_ms": sum(a.self_device_time_total for a in ks) / 1e3}
        toks = LONG - SHORT
        tok = {k: (per[LONG][k] - per[SHORT][k]) / toks for k in ("wall_ms", "kernels", "kernel_ms")}
        tok["gpu_busy_share"] = tok["kernel_ms"] / tok["wall_ms"] if tok["wall_ms"] > 0 else None
        tok["us_per_kernel"] = tok["kernel_ms"] * 1e3 / tok["kernels"] if tok["kernels"] else None
        top = sorted(kernels(runs[LONG][1]), key=lambda a: -a.self_device_time_total)[:TOP]
        out["modes"][mode] = {
            "runs": {str(n): v for n, v in per.items()}, "per_decoded_token": tok,
            "step_graphs": {k: v - g0[k] for k, v in eng.runner.graph_counts().items()},
            "top_kernels_over_the_long_run": [
                {"name": a.key, "calls": a.count, "total_ms": a.self_device_time_total / 1e3,
                 "us_per_call": a.self_device_time_total / a.count if a.count else None} for a in top]}
    del eng
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--graphs", default="off,auto", help="step-graph settings, comma-separated (off, auto, on)")
    ap.add_argument("--modes", default="plain,mtp", help="plain (MTP off) and/or mtp (fixed depth 2)")
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "foretell-bench"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda_profile.json"))
    args = ap.parse_args()
    gpu = device_or_exit(args.device, "bench/cuda_profile.py")
    t = time.perf_counter()
    path = model_path(args.model, Path(args.dir))
    result: dict = {"command": "python bench/cuda_profile.py " + " ".join(sys.argv[1:]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
                    "machine": machine_info(torch.get_num_threads()), "torch": torch.__version__,
                    "model": {"name": args.model, "file": path.name, "gib": path.stat().st_size / 2**30,
                              "ready_s": time.perf_counter() - t},
                    "method": f"greedy, EOS ignored, {len(PROMPT)}-token prompt; per decoded token = "
                              f"({LONG}-token run − {SHORT}-token run) / {LONG - SHORT}, both under torch.profiler; "
                              f"mtp at draft depth {DRAFT}",
                    "settings": {}}
    if gpu is not None:
        result["gpu"] = gpu
    for graphs in args.graphs.split(","):
        r = measure(path, graphs, args.device, args.modes.split(","))
        result["settings"][graphs] = r
        for mode, m in r["modes"].items():
            if "per_decoded_token" in m:
                s = m["per_decoded_token"]
                print(f"{args.model} step graphs {graphs}, {mode}: {s['wall_ms']:.2f} ms a token, {s['kernels']:.0f} "
                      f"kernels, GPU busy {s['kernel_ms']:.2f} ms; graphs {m['step_graphs']}", flush=True)
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
