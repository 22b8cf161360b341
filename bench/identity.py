"""Bit-identity of two source trees of the engine: logits and greedy tokens through the CLI, on the same files.

A refactoring must not change a single bit. This check runs each tree's own `python -m engine` (the CLI is
the contract both sides share) in a process of its own, on the same GGUF files, and compares:
  - `logits` of a 48-token pass (one multi-token pass: every row of the batched products);
  - `generate --json` greedy tokens with MTP off, at a fixed depth of 3, and on auto (verify passes, commits).

    python bench/identity.py fixtures DIR                  # write the test fixtures (this tree's writer) into DIR
    python bench/identity.py run TREE DIR OUT.json          # run TREE's CLI on DIR/*.gguf and the embedded model
    python bench/identity.py compare A.json B.json [--out bench/results/identity.json]

Logits are compared as raw float32 bytes (sha256 of the array); tokens as lists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [(7 * i + 3) % 251 + 5 for i in range(48)]
RUNS = {"no_mtp": ["--no-mtp"], "mtp_draft3": ["--mtp", "--draft", "3"], "mtp_auto": ["--mtp"]}


def write_fixtures(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures import KQUANT_DENSE, KQUANT_MOE, TINY_DENSE, TINY_MOE, write_fixture

    specs = {"moe_f32": TINY_MOE, "dense_f32": TINY_DENSE, "moe_q8_0": replace(TINY_MOE, qtype="Q8_0"),
             "moe_q8_0_wide": replace(TINY_MOE, qtype="Q8_0", n_embd=256, n_ff_exp=64, n_ff_shexp=128),
             "moe_kquant": KQUANT_MOE, "dense_kquant": KQUANT_DENSE,
             "moe_q4_k_tied": replace(KQUANT_MOE, tied=True, output_type=None)}
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in specs.items():
        write_fixture(out / f"{name}.gguf", spec)
        print(name, spec.qtype, file=sys.stderr)


def _cli(tree: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-m", "engine", *args], cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{tree}: engine {' '.join(args)} failed:\n{r.stderr}")
    return r.stdout


def run(tree: Path, models: Path, out: Path) -> None:
    tree = tree.resolve()
    files = sorted(models.glob("*.gguf")) + [None]
    result: dict[str, dict] = {}
    where = subprocess.run([sys.executable, "-c", "import engine; print(engine.__file__)"], cwd=tree,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)}).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            name = f.stem if f else "embedded"
            model = [str(f)] if f else []
            npy = Path(tmp) / f"{name}.npy"
            _cli(tree, "logits", *model, "--tokens", ",".join(map(str, TOKENS)), "--out", str(npy))
            logits = np.load(npy)
            entry = {"logits_shape": list(logits.shape),
                     "logits_sha256": hashlib.sha256(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()}
            for run_name, flags in RUNS.items():
                js = json.loads(_cli(tree, "generate", *model, "--prompt-tokens", ",".join(map(str, TOKENS[:12])),
                                     "--max-tokens", "40", *flags, "--json"))
                entry[run_name] = js["tokens"]
            result[name] = entry
            print(name, entry["logits_sha256"][:16], file=sys.stderr)
    out.write_text(json.dumps({"tree": str(tree), "engine": where, "models": result}, indent=1))


def compare(a: Path, b: Path, out: Path | None) -> int:
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    rows, bad = {}, 0
    for name in sorted(set(ra["models"]) | set(rb["models"])):
        ea, eb = ra["models"].get(name), rb["models"].get(name)
        same = {k: ea is not None and eb is not None and ea.get(k) == eb.get(k)
                for k in ("logits_sha256", *RUNS)}
        bad += not all(same.values())
        rows[name] = same
        print(f"{name:16s} " + " ".join(f"{k}={'same' if v else 'DIFFERENT'}" for k, v in same.items()))
    if out is not None:
        out.write_text(json.dumps({"command": " ".join(sys.argv), "a": ra["engine"], "b": rb["engine"],
                                   "identical": bad == 0, "models": rows}, indent=1) + "\n")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixtures")
    f.add_argument("dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("tree", type=Path)
    r.add_argument("dir", type=Path)
    r.add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.cmd == "fixtures":
        write_fixtures(args.dir)
    elif args.cmd == "run":
        run(args.tree, args.dir, args.out)
    else:
        raise SystemExit(compare(args.a, args.b, args.out))


if __name__ == "__main__":
    main()
