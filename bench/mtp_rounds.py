"""Plain decoding against MTP (auto, fixed depth 1 and 2) over several rounds in one process: is a mode's cost a
one-time one (the first passes of each new kind warm up and are captured as CUDA graphs) or a steady one?

    python bench/mtp_rounds.py [--device cuda] [--rounds 3] [--tokens 64] [--out bench/results/mtp_rounds.json]

The embedded model, the first 3 held-out evaluation chat prompts through the chat template, greedy, EOS ignored
(each reply decodes exactly --tokens). One untimed 16-token plain warm-up, then per round the four modes in turn,
each over the 3 prompts: decode tok/s (decode seconds from the final Stats, TTFT excluded), drafted and accepted
drafts, and the step graphs' captures and replays in that mode (the trunk's and the MTP head's).
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import decode  # noqa: E402
from bench.decode import device_or_exit, git_info, machine_info, write_result  # noqa: E402
from bench.hybrid import prompts_for  # noqa: E402
from engine.events import EngineConfig, GenerationConfig  # noqa: E402
from engine.generate import load  # noqa: E402
from engine.sampling import SamplingConfig  # noqa: E402

EMBEDDED = ROOT / "resources" / "models" / "foretell-demo.gguf"
MODES = (("plain", False, None), ("auto", True, None), ("k1", True, 1), ("k2", True, 2))
GREEDY = SamplingConfig(temperature=0.0, top_k=1)


def one_mode(eng, prompts: list[list[int]], tokens: int, mtp: bool, draft: int | None) -> dict:  # type: ignore[no-untyped-def]
    g0 = eng.runner.graph_counts()
    n = secs = drafted = accepted = 0
    for ids in prompts:
        eng.reset()
        final = decode.final_stats(eng, ids, GenerationConfig(max_tokens=tokens, sampling=GREEDY, mtp=mtp,
                                                              draft=draft, stats_interval_s=3600.0))
        r = decode.run_record(final)
        n, secs = n + r["decode_tokens"], secs + r["decode_s"]
        drafted, accepted = drafted + r.get("drafted", 0), accepted + r.get("accepted", 0)
    graphs = {k: v - g0[k] for k, v in eng.runner.graph_counts().items()}
    return {"tok_s": round(n / secs, 1), "decode_tokens": n, "drafted": drafted, "accepted": accepted,
            "graphs": graphs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mtp_rounds.json"))
    args = ap.parse_args()
    gpu = device_or_exit(args.device, "bench/mtp_rounds.py")
    prompts, warm, what = prompts_for("embedded", EMBEDDED, 0, SimpleNamespace(chat_prompts=3, decode=args.tokens))
    eng = load(str(EMBEDDED), EngineConfig(n_ctx=512, device=args.device))
    eng.tokenizer.eog_ids = frozenset()  # every reply decodes exactly its tokens
    decode.final_stats(eng, warm, GenerationConfig(max_tokens=16, sampling=GREEDY, stats_interval_s=3600.0))
    result: dict = {"command": "python bench/mtp_rounds.py " + " ".join(sys.argv[1:]),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_info(),
                    "machine": machine_info(torch.get_num_threads()), "torch": torch.__version__,
                    "workload": what, "rounds": []}
    if gpu is not None:
        result["gpu"] = gpu
    for rnd in range(args.rounds):
        for name, mtp, draft in MODES:
            r = {"round": rnd, "mode": name, **one_mode(eng, prompts, args.tokens, mtp, draft)}
            result["rounds"].append(r)
            print(json.dumps(r), flush=True)
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
