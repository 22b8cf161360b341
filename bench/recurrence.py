"""The Gated DeltaNet recurrence (engine/native/gdn.c, through ops.delta_rule) per instruction-set form: microseconds
per call for a pass of n tokens at the Qwen3.5 shape (32 value heads, 16 key heads, d_k = d_v = 128), the forms
alternating round by round.

    python bench/recurrence.py [--forms native-avx512vnni,native-avx2,native-portable] [--n 1,16,64] [--rounds 3]
                               [--calls 100] [--json bench/results/recurrence.json]

Each call includes the β and g element-wise ops the model runs before the recurrence (tests.test_native_float's
_recurrent); the state is updated in place, as a decode step's is.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode import git_info, machine_info  # noqa: E402


def main() -> None:
    import torch

    from engine import ops
    from tests.test_native_float import _inputs, _recurrent, _state

    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", default="native-avx512vnni,native-avx2,native-portable")
    ap.add_argument("--n", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    have = {b.name for b in ops.available_backends()}
    forms = [f for f in args.forms.split(",") if f in have]
    times: dict[str, dict[str, list[float]]] = {f: {} for f in forms}
    for _ in range(args.rounds):
        for form in forms:
            be = ops.backend_named(form)
            for n in (int(x) for x in args.n.split(",")):
                q, k, v, b, a, w, S = _inputs(n, 32, 128, 128, seed=2, hk=16)
                st = _state(S)
                for _ in range(10):
                    _recurrent(q, k, v, b, a, w, st, False, be)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    _recurrent(q, k, v, b, a, w, st, False, be)
                times[form].setdefault(str(n), []).append(1e6 * (time.perf_counter() - t0) / args.calls)
    result = {"command": "python " + " ".join(sys.argv), "git": git_info(), "machine": machine_info(torch.get_num_threads()),
              "forms_not_on_this_cpu": [f for f in args.forms.split(",") if f not in have],
              "us_per_call": {f: {n: {"best": min(v), "rounds": v} for n, v in by.items()} for f, by in times.items()}}
    for f, by in result["us_per_call"].items():
        print(f, {n: round(x["best"], 1) for n, x in by.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
