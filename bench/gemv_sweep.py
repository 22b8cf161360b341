"""Which `GemvShape` (outputs per program, units in flight, warps) makes engine.ops.triton_q's GEMV fastest, per type.

    python bench/gemv_sweep.py [--model qwen36-35b] [--out bench/results/gemv_sweep.json] [--quick]

The cases are the products of one decode step of a model shape (bench/synthetic.py's SHAPES, its mix's types),
each with how often a step calls it: the GDN and attention projections, the shared expert, 8 routed experts of a
256-expert stack as (token, expert) pairs, the output head; plus the verify forms (3 rows: draft depth 2). Weights
are random blocks with modest finite scales, made on the device, in enough copies that a timed loop does not read
them from L2 (rotated call by call). Each shape's result is checked against the current one's (the same sums in
another grouping: rtol 1e-4) and every output is poisoned first. Times are CUDA-graph replays of a loop of calls
(no launch gaps from the host): µs a call and GB/s of weight bytes. Per type, the shape with the least time over
the step's calls is printed with the step's GEMV time under the current shapes and under the best ones.
`--quick` runs two shapes on small cases (the interpreter on CPU: a check that the script runs).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.decode import device_or_exit, git_info, machine_info, write_result  # noqa: E402

L2_ROTATION_BYTES = 256 << 20  # weights of one case, all copies: several times an H200's 50 MB L2
LOOP = 32  # calls per captured loop
REPLAYS = 20

SHAPES = [(16, 1, 4), (16, 2, 4), (16, 4, 4), (8, 1, 4), (8, 2, 4), (8, 4, 4), (8, 4, 8), (4, 2, 2), (4, 4, 2),
          (4, 4, 4), (2, 4, 2), (32, 2, 8)]


@dataclass(frozen=True)
class Case:
    name: str
    qtype: str
    n_out: int
    n_cols: int
    calls: int  # a decode step's calls
    stack: int = 1  # matrices in the stack (routed experts)
    pairs: int = 1


def cases(model: str) -> list[Case]:
    from bench.synthetic import SHAPES as MODELS, matrix_type
    s = MODELS[model]
    d, layers = s.n_embd, s.n_layer
    gdn = layers - layers // 4  # three recurrent layers in four
    attn = layers - gdn
    vd = s.ssm_dt_rank * s.ssm_d_state  # GDN value width
    qk = s.ssm_n_group * s.ssm_d_state
    t = lambda n: matrix_type(n, s.mix).name  # noqa: E731
    out = [Case("gdn_qkv", t("blk.0.attn_qkv.weight"), 2 * qk + vd, d, gdn),
           Case("gdn_gate", t("blk.0.attn_gate.weight"), vd, d, gdn),
           Case("gdn_beta_alpha", t("blk.0.ssm_beta.weight"), s.ssm_dt_rank, d, 2 * gdn),
           Case("gdn_out", t("blk.0.ssm_out.weight"), d, vd, gdn),
           Case("attn_q", t("blk.3.attn_q.weight"), 2 * s.n_head * s.head_dim, d, attn),
           Case("attn_kv", t("blk.3.attn_k.weight"), s.n_head_kv * s.head_dim, d, 2 * attn),
           Case("attn_out", t("blk.3.attn_output.weight"), d, s.n_head * s.head_dim, attn),
           Case("head", t("output.weight"), s.n_vocab, d, 1)]
    if s.n_expert:
        e = s.n_expert_used
        out += [Case("exps_gate_up", t("blk.0.ffn_gate_exps.weight"), s.n_ff_exp, d, 2 * layers, s.n_expert, e),
                Case("exps_down", t("blk.0.ffn_down_exps.weight"), d, s.n_ff_exp, layers, s.n_expert, e),
                Case("shexp_gate_up", t("blk.0.ffn_gate_shexp.weight"), s.n_ff_shexp, d, 2 * layers),
                Case("shexp_down", t("blk.0.ffn_down_shexp.weight"), d, s.n_ff_shexp, layers)]
    else:
        out += [Case("ffn_gate_up", t("blk.0.ffn_gate.weight"), s.n_ff, d, 2 * layers),
                Case("ffn_down", t("blk.0.ffn_down.weight"), d, s.n_ff, layers)]
    verify = [Case(c.name + "@verify3", c.qtype, c.n_out, c.n_cols, 0, c.stack, 3 * c.pairs)
              for c in out if c.name in ("gdn_qkv", "exps_gate_up", "ffn_gate_up")]
    return out + verify


def random_stack(qt, n_mats: int, n_out: int, n_cols: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """n_mats matrices of random blocks whose float16 fields are modest finite scales, uint8 [n_mats, bytes]."""
    from engine.storage.qtensor import block_size, type_size
    from engine.storage.quantize import F16_FIELDS
    nb = n_mats * n_out * n_cols // block_size(qt)
    raw = torch.randint(0, 256, (nb, type_size(qt)), dtype=torch.uint8, device=device, generator=gen)
    for off in F16_FIELDS[qt]:
        raw[:, off:off + 2] = (torch.rand(nb, 1, device=device, generator=gen) * 0.01).half().view(torch.uint8)
    return raw.reshape(n_mats, -1)


def run_case(c: Case, shapes: list, device: str, quick: bool) -> dict:
    from gguf import GGMLQuantizationType as QT

    from engine.ops import triton_q
    qt = QT[c.qtype]
    gen = torch.Generator(device=device).manual_seed(hash(c.name) % 2**31)
    one = c.stack * c.n_out * c.n_cols * triton_q.UNIT_BYTES[qt] // 256
    copies = 1 if quick else max(1, min(16, -(-L2_ROTATION_BYTES // one)))
    stacks = [random_stack(qt, c.stack, c.n_out, c.n_cols, device, gen) for _ in range(copies)]
    rows = c.pairs if c.stack > 1 else c.pairs  # routed pairs: each its own activation row
    x = torch.randn(rows, c.n_cols, device=device, generator=gen)
    sels = [torch.randperm(c.stack, device=device, generator=gen)[:c.pairs] if c.stack > 1
            else torch.zeros(c.pairs, dtype=torch.long, device=device) for _ in range(copies)]
    if c.stack > 1 and c.pairs > c.stack:
        raise ValueError(c)
    xrow = torch.arange(c.pairs, device=device)
    read = c.pairs * one // c.stack if c.stack > 1 else one  # weight bytes a call reads (verify rows: L2 re-reads)
    current = triton_q.GEMV[qt]
    ref = triton_q.gemv_pairs(stacks[0], qt, c.n_out, c.n_cols, x, sels[0], xrow)
    res = {"case": asdict(c), "weight_bytes_a_call": read, "copies": copies, "shapes": []}
    for rows_, units, warps in dict.fromkeys([*shapes, (current.rows, current.units, current.warps)]):
        g = triton_q.GemvShape(rows_, units, warps)
        entry: dict = {"shape": [rows_, units, warps], "current": g == current}
        try:
            t0 = time.perf_counter()
            y = triton_q.gemv_pairs(stacks[0], qt, c.n_out, c.n_cols, x, sels[0], xrow, shape=g)
            entry["first_call_s"] = time.perf_counter() - t0
            scale = float(ref.abs().max()) or 1.0
            entry["max_rel_diff"] = float((y - ref).abs().max()) / scale
            entry["ok"] = bool(torch.isfinite(y).all()) and entry["max_rel_diff"] < 1e-4
            if device.startswith("cuda") and entry["ok"]:
                entry["us"] = graph_time(lambda i: triton_q.gemv_pairs(stacks[i % copies], qt, c.n_out, c.n_cols, x,
                                                                       sels[i % copies], xrow, shape=g))
                entry["gb_s"] = read / entry["us"] / 1e3
        except Exception as e:  # noqa: BLE001 - a shape that does not build is a result, not an end
            entry["ok"], entry["error"] = False, f"{type(e).__name__}: {e}"[:300]
        res["shapes"].append(entry)
    return res


def graph_time(call) -> float:  # type: ignore[no-untyped-def]
    """µs a call: LOOP calls captured in one CUDA graph, replayed REPLAYS times between events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LOOP):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / LOOP)
    return sorted(times)[len(times) // 2]


def summarize(results: list[dict]) -> dict:
    """Per type: each shape's µs over a step's calls; the best shape; the step's GEMV µs now and with the best."""
    by_type: dict[str, dict] = {}
    for r in results:
        c = r["case"]
        if not c["calls"]:
            continue
        t = by_type.setdefault(c["qtype"], {})
        for e in r["shapes"]:
            key = ",".join(map(str, e["shape"]))
            t[key] = t.get(key, 0.0) + (c["calls"] * e["us"] if e.get("ok") and "us" in e else float("inf"))
    out = {}
    for qt, per in by_type.items():
        cur = next(",".join(map(str, e["shape"])) for r in results if r["case"]["qtype"] == qt for e in r["shapes"]
                   if e["current"])
        best = min(per, key=per.get)  # type: ignore[arg-type]
        out[qt] = {"step_us_by_shape": per, "best": best, "step_us_best": per[best], "current": cur,
                   "step_us_current": per.get(cur)}
    return out


def sweep_case(c: Case, shapes: list, device: str, quick: bool) -> dict:
    """One case's sweep, with a line of what it found."""
    r = run_case(c, shapes, device, quick)
    ok = [e for e in r["shapes"] if e.get("ok")]
    fast = min(ok, key=lambda e: e.get("us", 0.0)) if ok else None
    cur = next(e for e in r["shapes"] if e["current"])
    print(f"{c.name:22s} {c.qtype:6s} {c.n_out}x{c.n_cols} pairs {c.pairs}: current {cur.get('us', 0):.2f} us, "
          f"best {fast['shape'] if fast else None} {fast.get('us', 0) if fast else 0:.2f} us "
          f"({fast.get('gb_s', 0) if fast else 0:.0f} GB/s); failed {len(r['shapes']) - len(ok)}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen36-35b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gemv_sweep.json"))
    args = ap.parse_args()
    gpu = device_or_exit(args.device, "bench/gemv_sweep.py")
    shapes = SHAPES
    result: dict = {"command": "python bench/gemv_sweep.py " + " ".join(sys.argv[1:]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
                    "machine": machine_info(torch.get_num_threads()), "torch": torch.__version__,
                    "method": f"CUDA-graph replays of {LOOP} calls, median of {REPLAYS}; weights rotated over copies "
                              f"totalling >= {L2_ROTATION_BYTES >> 20} MiB; checked against the current shape",
                    "models": {}}
    if gpu is not None:
        result["gpu"] = gpu
    for model in args.model.split(","):
        todo = cases(model)
        if args.quick:
            todo = [Case(c.name, c.qtype, min(c.n_out, 40), 512, c.calls, min(c.stack, 4), min(c.pairs, 2))
                    for c in todo[:3] + todo[-5:-4]]
            shapes = [(16, 1, 4), (4, 2, 2)]
        runs = [sweep_case(c, shapes, args.device, args.quick) for c in todo]
        result["models"][model] = {"cases": runs, "by_type": summarize(runs)}
        for qt, s in result["models"][model]["by_type"].items():
            print(f"{model} {qt}: current {s['current']} {s['step_us_current']:.0f} us a step, best {s['best']} "
                  f"{s['step_us_best']:.0f} us", flush=True)
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
