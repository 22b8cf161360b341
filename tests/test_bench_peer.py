"""The benchmarks' llama.cpp runs happen in processes that never loaded torch.

llama.cpp's CPU threads meet at OpenMP barriers; torch loads the same libgomp.so.1, and engine/__init__ loads torch
with OMP_WAIT_POLICY=PASSIVE, which then puts llama.cpp's threads to sleep at every barrier (on a 2-core host its
embedded-model decode fell from ~600 to ~40 tok/s). bench/decode.py's child path once imported engine through an
argument default; these tests hold the yardstick honest.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import decode  # noqa: E402


def test_llama_cpp_is_refused_in_a_process_that_loaded_torch() -> None:
    import torch  # noqa: F401  (this test process has it anyway: the check must see it)

    with pytest.raises(RuntimeError, match="torch"):
        decode.peer_process_check()
    with pytest.raises(RuntimeError, match="torch"):
        decode.run_llama({})


def _spec() -> dict:
    from engine.storage.modelfile import default_model_path

    return {"model": str(default_model_path()), "prompts": [list(range(10, 26))], "warmup_prompt": [5, 6, 7],
            "n": 4, "threads": 1, "warmup": False, "n_ctx": 64, "mtp": False, "draft": None, "backend": None}


def test_llama_cpp_is_refused_under_a_wait_policy_and_its_children_start_without_one(monkeypatch) -> None:
    code = ("import os, sys; os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'; sys.path.insert(0, '.'); "
            "from bench.decode import peer_process_check; peer_process_check()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode != 0 and "OMP_WAIT_POLICY" in out.stderr
    # tests.oracle_llama sets the policy in a benchmark's own process when it quantizes a file: the child drops it
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    res = decode.run_child("llama", _spec(), False, 300.0)
    assert res["prompts"][0]["generated_tokens"] == 4


def test_the_llama_cpp_child_starts_clean_and_decodes() -> None:
    script = "bench/decode.py"
    spec = _spec()
    code = (f"import sys, runpy; sys.argv = [{script!r}, '--child', 'llama']; "
            f"runpy.run_path({script!r}, run_name='__main__'); "
            "print('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env=decode.peer_env())  # as run_child starts it
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    res = json.loads(next(ln for ln in lines if ln.startswith("RESULT "))[len("RESULT "):])
    assert res["prompts"][0]["generated_tokens"] == 4
    assert "TORCH False" in lines  # the whole child ran without torch


def test_the_parallel_benchmark_loads_no_torch_before_its_llama_cpp_child_runs() -> None:
    code = ("import sys; sys.path.insert(0, 'bench'); import server_parallel; "
            "print('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TORCH False" in out.stdout.splitlines()


def test_the_report_flags_llama_cpp_figures_from_the_handicapped_window() -> None:
    from bench import report

    first, fixed = report.PEER_HANDICAP
    history = ["older", first, "between", fixed, "newer"]  # a straight line of commits

    def is_ancestor(a: str, b: str) -> bool:
        return history.index(a) <= history.index(b)

    def flagged(cmd: str, commit: str, case: str = "qwen35-0.8b:Q4_K_M") -> bool:
        d = {"command": f"python {cmd} --x", "git": {"commit": commit}, "cases": {case: {}}}
        return report.peer_handicapped(d, is_ancestor)

    assert flagged("bench/sweep.py", first) and flagged("bench/mtp_speedup.py", "between")
    assert not flagged("bench/sweep.py", fixed) and not flagged("bench/sweep.py", "newer")
    assert not flagged("bench/sweep.py", "older")
    assert not flagged("bench/products.py", "between")  # no llama.cpp child
    assert flagged("bench/server_parallel.py", "between")
    assert not flagged("bench/server_parallel.py", "between", "embedded")
