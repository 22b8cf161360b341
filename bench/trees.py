"""A benchmark script run in two source trees of the engine, alternating, each run in a process of its own.

For before/after checks of a change that must not move speed (a refactoring): the same script of each tree (its own
copy, against its own engine) on the same machine in the same session, `--rounds` times in turn A, B, A, B, …

    python bench/trees.py --a /tmp/pre --b . --rounds 3 --out bench/results/refactor_mtp.json -- \
        bench/mtp.py --model default --prompts 16 --rounds 1

Each run writes its JSON to a temporary file (the script's `--out`); the result holds every run's JSON per tree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="tree A (before)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (after)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS… (run from each tree's root)")
    args = ap.parse_args()
    script = [s for s in args.script if s != "--"]
    runs: dict[str, list] = {"a": [], "b": []}
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("a", "b"):
                out = Path(tmp) / f"{side}{r}.json"
                env = {**os.environ, "PYTHONPATH": str(trees[side])}
                cmd = [sys.executable, *script, "--out", str(out)]
                p = subprocess.run(cmd, cwd=trees[side], env=env, capture_output=True, text=True)
                if p.returncode:
                    raise SystemExit(f"{side} round {r} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
                print(f"round {r} {side}:\n{p.stdout.strip()}", flush=True)
                runs[side].append(json.loads(out.read_text()))
    commit = {s: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=t, capture_output=True,
                                text=True).stdout.strip() for s, t in trees.items()}
    args.out.write_text(json.dumps({
        "command": " ".join(["python", "bench/trees.py", *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "trees": {s: {"path": str(t), "commit": commit[s]} for s, t in trees.items()},
        "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
