"""Parallel requests: aggregate and per-request decode tok/s for 1, 2 and 4 concurrent clients, ours
(`python -m engine serve --parallel 4`) against llama.cpp's server (`xllamacpp.Server`, `n_parallel` 4) on the same
file.

    python bench/server_parallel.py [--models embedded,mid] [--clients 1,2,4] [--rounds 3] [--tokens 64]
                                    [--threads 2] [--mtp] [--out bench/results/server_parallel.json]

Each engine is a process of its own serving HTTP on 127.0.0.1 (ours: the CLI's `serve`; llama.cpp's: this script as a
child, `--llama-child`, holding an `xllamacpp.Server` with hostnames/port set), both started once per model and both
idle while the other is measured. Plain decoding on both sides (ours `--no-mtp`, llama.cpp without a draft), greedy, each client its own prompt of random token ids, streamed
`/v1/completions` with `max_tokens` = `--tokens` (llama.cpp also `ignore_eos`). The prompts are those of a pool whose
greedy reply on our engine runs the full count alone (tried first, which also warms our server), so both engines
decode the same counts; llama.cpp's server then runs them alone once too (a warm-up for it as for ours). Rounds
alternate which engine goes first; per client count the best round of each side
counts, the median of the per-round ratios is given beside.

Per request: decode tok/s = (tokens − 1) / the server's `timings.predicted_ms` (both servers time the reply after its
first token; streamed chunks would not do: llama.cpp sends none for a token without text, which a synthetic file's
tokens often are). Aggregate: all requests' decode tokens / (the last reply's end − the earliest first token, each
first token placed `predicted_ms` before its reply ended on the client's clock).
`--models`: `embedded` (resources/models/), `mid` (bench/synthetic.py's mid-size MoE, made once under build/bench), or
`SHAPE:QUANT`, a cell of bench/sweep.py (its shape written in F16 and quantized by llama.cpp itself, made once under
build/bench/sweep), e.g. `qwen35-0.8b:Q4_K_M`, the Qwen3.5-0.8B dense shape with its 248k vocabulary, or
`agreement-SHAPE:P`, bench/mtp_agreement.py's agreement file of the shape whose MTP head agrees with the trunk at
first position at rate P (e.g. `agreement-mid:0.9`).
`--mtp`: a third side, our server with MTP on (auto depth, its default): each sequence drafts and its drafts are
verified among the other sequences' rows in their shared pass (engine.batch). Greedy replies are the same tokens as
without MTP; the JSON gives its aggregate against ours without MTP (`mtp_gain`, best rounds and the median of the
rounds' ratios).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode import git_info, machine_info, peer_env, peer_process_check  # noqa: E402

PARALLEL = 4
PROMPT_TOKENS = 32
N_CTX = 1024  # per sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    host = urlsplit(url)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
        try:
            conn = http.client.HTTPConnection(host.hostname, host.port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def start_ours(model: Path, threads: int, mtp: bool = False) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", str(model), "--port", str(port), "--parallel",
                             str(PARALLEL), *([] if mtp else ["--no-mtp"]), "--ctx", str(N_CTX), "--threads",
                             str(threads)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def start_llama(model: Path, threads: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--llama-child", str(model), "--threads", str(threads)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=peer_env())
    url = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if not url.startswith("http"):
        raise RuntimeError(f"llama.cpp's server did not start ({proc.wait()})")
    wait_healthy(url, proc)
    return proc, url


def llama_child(model: str, threads: int) -> None:
    """llama.cpp's server on 127.0.0.1 until stdin closes: n_parallel slots of N_CTX each, plain decoding."""
    peer_process_check()
    import xllamacpp as xl

    p = xl.CommonParams()
    p.model.path = model
    p.n_ctx, p.n_parallel = N_CTX * PARALLEL, PARALLEL
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
    p.hostnames, p.port = ["127.0.0.1"], 0
    server = xl.Server(p)
    print(server.listening_address, flush=True)
    sys.stdin.read()
    del server


def one_request(url: str, ids: list[int], n: int, extra: dict) -> dict:
    host = urlsplit(url)
    body = {"prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=600)
    t_req = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: {resp.status} {resp.read()[:300]!r}")
    usage, timings = None, None
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
    t_end = time.perf_counter()
    conn.close()
    if usage is None or timings is None:
        raise RuntimeError(f"{url} sent no usage or no timings")
    tokens, decode_s = int(usage["completion_tokens"]), timings["predicted_ms"] / 1e3
    return {"tokens": tokens, "ttft_s": t_end - decode_s - t_req, "t_first": t_end - decode_s, "t_last": t_end,
            "decode_tok_s": (tokens - 1) / max(decode_s, 1e-9)}


def clients(url: str, prompts: list[list[int]], n: int, extra: dict) -> dict:
    """Every prompt as its own client at once; per-request and aggregate decode tok/s."""
    out: list[dict] = [{}] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        out[i] = one_request(url, prompts[i], n, extra)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = max(r["t_last"] for r in out) - min(r["t_first"] for r in out)
    return {"aggregate_tok_s": sum(r["tokens"] - 1 for r in out) / span,
            "per_request_tok_s": [r["decode_tok_s"] for r in out], "tokens": [r["tokens"] for r in out],
            "ttft_s": [r["ttft_s"] for r in out]}


def full_prompts(url: str, vocab: int, n: int, want: int, seed: int = 0) -> list[list[int]]:
    """Random prompts whose greedy reply on our server runs all n tokens alone (tried in turn; warms the server)."""
    import random

    rng, keep = random.Random(seed), []
    for _ in range(50):
        ids = [rng.randrange(16, vocab - 16) for _ in range(PROMPT_TOKENS)]
        if one_request(url, ids, n, {})["tokens"] == n:
            keep.append(ids)
            if len(keep) == want:
                return keep
    raise RuntimeError(f"only {len(keep)} of 50 prompts ran {n} tokens")


def model_case(name: str, path: Path, counts: list[int], rounds: int, n: int, threads: int, mtp: bool = False) -> dict:
    from engine.storage.modelfile import open_model

    vocab = open_model(path).hparams.n_vocab
    ours, ours_url = start_ours(path, threads)
    llama, llama_url = start_llama(path, threads)
    procs = [ours, llama]
    try:
        prompts = full_prompts(ours_url, vocab, n, max(counts))
        for ids in prompts:  # llama.cpp's warm-up: the same replies alone (the file's pages read in for both)
            one_request(llama_url, ids, n, {"ignore_eos": True})
        sides = {"ours": (ours_url, {}), "llama.cpp": (llama_url, {"ignore_eos": True})}
        if mtp:
            with_mtp, mtp_url = start_ours(path, threads, mtp=True)
            procs.append(with_mtp)
            for ids in prompts:  # its warm-up, and its auto depth's first measurements
                one_request(mtp_url, ids, n, {})
            sides["ours+mtp"] = (mtp_url, {})
        runs: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in counts} for s in sides}
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for c in counts:
                for side in order:
                    url, extra = sides[side]
                    res = {**clients(url, prompts[:c], n, extra), "load_avg_1m": os.getloadavg()[0]}
                    runs[side][c].append(res)
                    print(f"{name} round {r} {side} {c} clients: {res['aggregate_tok_s']:.1f} tok/s aggregate",
                          flush=True)
    finally:
        for proc in procs:
            if proc.stdin:
                proc.stdin.close()
            proc.terminate()
            proc.wait(30)
    summary = {}
    for c in counts:
        best = {s: max(runs[s][c], key=lambda x: x["aggregate_tok_s"]) for s in sides}
        ratios = [a["aggregate_tok_s"] / b["aggregate_tok_s"] for a, b in zip(runs["ours"][c], runs["llama.cpp"][c])]
        summary[str(c)] = {
            s: {"aggregate_tok_s": best[s]["aggregate_tok_s"],
                "per_request_tok_s_mean": statistics.mean(best[s]["per_request_tok_s"])} for s in sides}
        summary[str(c)]["ours_vs_llama_median_ratio"] = statistics.median(ratios)
    one = {s: summary[str(counts[0])][s]["aggregate_tok_s"] for s in sides}
    scaling = {s: {str(c): summary[str(c)][s]["aggregate_tok_s"] / one[s] for c in counts} for s in sides}
    top = str(counts[-1])
    targets = {f"ours {top} clients / 1 client >= 2.5": scaling["ours"][top] >= 2.5,
               f"ours {top} clients >= llama.cpp n_parallel {PARALLEL}":
                   summary[top]["ours"]["aggregate_tok_s"] >= summary[top]["llama.cpp"]["aggregate_tok_s"]}
    gain = {} if not mtp else {str(c): {
            "mtp_gain": summary[str(c)]["ours+mtp"]["aggregate_tok_s"] / summary[str(c)]["ours"]["aggregate_tok_s"],
            "mtp_gain_median_of_rounds": statistics.median(
                a["aggregate_tok_s"] / b["aggregate_tok_s"] for a, b in zip(runs["ours+mtp"][c], runs["ours"][c]))}
        for c in counts}
    return {"model": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path), "tokens": n,
            "prompt_tokens": PROMPT_TOKENS, "summary": summary, "scaling_vs_one_client": scaling, "targets_met": targets,
            **({"mtp_gain": gain} if mtp else {}),
            "rounds": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="embedded")
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--mtp", action="store_true", help="also our server with MTP on (auto depth)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/server_parallel.json")
    ap.add_argument("--llama-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_child:
        llama_child(args.llama_child, args.threads)
        return
    import xllamacpp

    from engine.storage.modelfile import default_model_path

    counts = [int(c) for c in args.clients.split(",")]
    result: dict = {"what": "decode tok/s with 1, 2, 4 concurrent clients: ours serve --parallel 4 vs llama.cpp's "
                            "server n_parallel 4, same file, plain greedy, streamed /v1/completions",
                    "command": " ".join(["python", *sys.argv]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine_info(args.threads), "git": git_info(),
                    "llama_cpp": f"xllamacpp {xllamacpp.__version__}", "parallel": PARALLEL, "cases": {}}
    for name in args.models.split(","):
        if name == "embedded":
            path = default_model_path()
        elif name.startswith("agreement-"):
            from bench.mtp_agreement import agreement_file
            from bench.synthetic import noise_for

            shape, p = name.removeprefix("agreement-").split(":")
            path = agreement_file(shape, 0, noise_for(shape, float(p)), ROOT / "build/bench", fresh=False)
        elif ":" in name:
            from bench.sweep import quantized_file

            shape, quant = name.split(":")
            path = quantized_file(shape, quant, ROOT / "build/bench/sweep")
        else:
            from bench.synthetic import cached

            path = Path(cached(name))
        result["cases"][name] = model_case(name, path, counts, args.rounds, args.tokens, args.threads, args.mtp)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, case in result["cases"].items():
        for c, row in case["summary"].items():
            print(f"{name} {c} clients: ours {row['ours']['aggregate_tok_s']:.1f} tok/s "
                  f"(per request {row['ours']['per_request_tok_s_mean']:.1f}), llama.cpp "
                  f"{row['llama.cpp']['aggregate_tok_s']:.1f} ({row['llama.cpp']['per_request_tok_s_mean']:.1f}), "
                  f"median ratio {row['ours_vs_llama_median_ratio']:.2f}")


if __name__ == "__main__":
    main()
