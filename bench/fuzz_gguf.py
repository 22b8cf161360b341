"""GGUF fuzzing, before and after the validation of issue 29: outcomes per mutation class.

The classes are tests/gguf_mutate.py's CLASSES; issue 48 added non-finite block scales and float weights anywhere in
a tensor, float hyperparameters out of range and byte tokens typed as control or unused (the tree before them:
--before-commit 3428880).

The same seeded cases as tests/test_fuzz_gguf.py (tests/gguf_mutate.py), run through a tree's own open path
(ModelFile + tokenizer + chat template: what `inspect` and `load` run before the weights) in a worker process
per tree, each case bounded by an alarm (a hang) and the worker by an address-space limit (runaway memory
becomes MemoryError). "before" is the tree at a given commit, exported with `git archive`; the old reader takes
~1.7 s per file and hangs, so it runs the first --before-cases of each model (the after figures are given for
that same subset too).

    python bench/fuzz_gguf.py [--cases 1200] [--before-cases 300] [--before-commit 1ac8d3f]
writes bench/results/fuzz_gguf.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("typed", "same", "different", "untyped", "hang", "crash")


def _mutator():
    """tests/gguf_mutate.py of this tree, by path (a worker's sys.path puts another tree's `tests` first)."""
    spec = importlib.util.spec_from_file_location("gguf_mutate", ROOT / "tests" / "gguf_mutate.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["gguf_mutate"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def worker(tree: Path, src: Path, seed: int, start: int, n: int, timeout: int, mem_gib: float) -> None:
    """Run cases start..n-1 through `tree`'s open path; one JSON line per case on stdout."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (int(mem_gib * 2 ** 30), int(mem_gib * 2 ** 30)))
    sys.path.insert(0, str(tree))
    import warnings

    warnings.simplefilter("ignore")  # the old reader's numpy overflow warnings
    gm = _mutator()
    from engine.errors import EngineError
    from engine.storage.modelfile import open_model

    try:
        from engine.generate import text_side
    except ImportError:  # the tree before issue 29: what Engine.__init__ ran
        from engine.chat import ChatFormat
        from engine.tokenizer import Tokenizer

        def text_side(mf):  # type: ignore[no-redef]
            tok = Tokenizer.from_metadata(mf.metadata)
            return tok, ChatFormat(mf.get("tokenizer.chat_template"), tok)

    def opener(p: Path):
        mf = open_model(p)
        tok, chat = text_side(mf)
        return mf, tok, chat

    buf = src.read_bytes()
    lay = gm.layout(buf)
    valid = gm.fingerprint(src, opener)
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    path = tmp / "case.gguf"
    try:
        for i, (case_seed, cls) in enumerate(gm.cases(n, seed)):
            if i < start:
                continue
            data, what = gm.make_case(buf, lay, case_seed, cls)
            path.write_bytes(data)
            print(json.dumps({"i": i, "started": True}), flush=True)
            outcome, detail, dt = gm.timed_judge(path, opener, valid, EngineError, timeout)
            print(json.dumps({"i": i, "class": cls, "what": what, "outcome": outcome, "detail": detail[:160],
                              "s": round(dt, 4)}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_tree(tree: Path, src: Path, seed: int, n: int, timeout: int, mem_gib: float) -> list[dict]:
    """All n cases, restarting the worker after a case that kills it (recorded as "crash")."""
    gm = _mutator()
    rows: list[dict] = []
    start = 0
    while start < n:
        p = subprocess.Popen([sys.executable, __file__, "--worker", "--tree", str(tree), "--src", str(src),
                              "--seed", str(seed), "--start", str(start), "--cases", str(n),
                              "--timeout", str(timeout), "--mem-gib", str(mem_gib)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tree)
        current = None
        for line in p.stdout:  # type: ignore[union-attr]
            r = json.loads(line)
            if r.get("started"):
                current = r["i"]
            else:
                rows.append(r)
                current = None
        p.wait()
        if current is None:
            break
        cls = gm.cases(n, seed)[current][1]
        rows.append({"i": current, "class": cls, "outcome": "crash", "detail": f"worker exit {p.returncode}", "s": 0})
        start = current + 1
    return rows


def summarize(rows: list[dict], n: int | None = None) -> dict:
    rows = [r for r in rows if n is None or r["i"] < n]
    by: dict[str, dict] = {}
    for r in rows:
        d = by.setdefault(r["class"], {o: 0 for o in OUTCOMES} | {"cases": 0, "max_s": 0.0})
        d[r["outcome"]] += 1
        d["cases"] += 1
        d["max_s"] = max(d["max_s"], r["s"])
    total = {o: sum(d[o] for d in by.values()) for o in OUTCOMES} | {"cases": len(rows)}
    total["max_s"] = max((r["s"] for r in rows), default=0.0)
    total["mean_s"] = round(sum(r["s"] for r in rows) / max(len(rows), 1), 4)
    return {"total": total, "by_class": by}


def export_tree(commit: str, dest: Path) -> Path:
    tree = dest / f"tree-{commit}"
    tree.mkdir(parents=True)
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "engine", "resources"], check=True,
                          capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=arch, check=True)
    for so in (ROOT / "engine" / "native").glob("_native*.so"):  # the built kernels (not in git)
        shutil.copy(so, tree / "engine" / "native" / so.name)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=1200, help="after: cases in all (2/3 embedded, 1/3 K-quant)")
    ap.add_argument("--before-cases", type=int, default=300, help="before: the first cases of the same runs")
    ap.add_argument("--before-commit", default="1ac8d3f")
    ap.add_argument("--timeout", type=int, default=10)
    ap.add_argument("--mem-gib", type=float, default=6.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz_gguf.json"))
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--tree")
    ap.add_argument("--src")
    ap.add_argument("--seed", type=int, default=2029)
    ap.add_argument("--start", type=int, default=0)
    a = ap.parse_args()
    if a.worker:
        worker(Path(a.tree), Path(a.src), a.seed, a.start, a.cases, a.timeout, a.mem_gib)
        return
    sys.path.insert(0, str(ROOT))
    from engine.storage.modelfile import default_model_path
    from tests.fixtures import KQUANT_MOE, fixture_path

    models = {"embedded": (default_model_path(), a.cases * 2 // 3, a.before_cases * 2 // 3),
              "kquant_fixture": (fixture_path(KQUANT_MOE), a.cases - a.cases * 2 // 3,
                                 a.before_cases - a.before_cases * 2 // 3)}
    out: dict = {"what": __doc__.split("\n\n")[0], "seed": a.seed, "timeout_s": a.timeout, "mem_gib": a.mem_gib,
                 "before_commit": a.before_commit,
                 "after_commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                                capture_output=True, text=True).stdout.strip(),
                 "host": platform.node(), "cpus": os.cpu_count(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = export_tree(a.before_commit, Path(tmp))
        for name, (src, n_after, n_before) in models.items():
            t0 = time.perf_counter()
            after = run_tree(ROOT, Path(src), a.seed, n_after, a.timeout, a.mem_gib)
            t1 = time.perf_counter()
            before = run_tree(before_tree, Path(src), a.seed, n_before, a.timeout, a.mem_gib)
            t2 = time.perf_counter()
            findings = [r for r in before if r["outcome"] not in ("typed", "same")]
            out["models"][name] = {
                "file": Path(src).name, "file_bytes": Path(src).stat().st_size,
                "after": summarize(after) | {"wall_s": round(t1 - t0, 1)},
                "after_on_before_subset": summarize(after, n_before),
                "before": summarize(before) | {"wall_s": round(t2 - t1, 1)},
                "before_examples": [{k: r[k] for k in ("class", "what", "outcome", "detail")} for r in findings[:12]],
                "after_failures": [r for r in after if r["outcome"] not in ("typed", "same")][:20],
            }
            print(name, json.dumps({k: out["models"][name][k]["total"] for k in ("before", "after")}), flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
