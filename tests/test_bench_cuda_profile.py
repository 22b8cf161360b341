"""bench/cuda_profile.py without a GPU: its refusal without CUDA, and its measurement and JSON on the CPU (wall
times only: no kernels are launched there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.fixtures import fixture_path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench/cuda_profile.py"


def test_refuses_in_one_line_without_cuda(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on any machine
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "p.json")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stdout.strip().startswith("bench/cuda_profile.py: no CUDA device here")
    assert not (tmp_path / "p.json").exists()


def test_a_cpu_run_writes_the_per_step_figures(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(fixture_path()), "--device", "cpu",
                        "--graphs", "off", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert list(d["settings"]) == ["off"] and d["model"]["file"] == fixture_path().name
    s = d["settings"]["off"]
    assert s["step_graphs"] == {"used": False, "head_used": False} and list(s["modes"]) == ["plain", "mtp"]
    for m in s["modes"].values():
        assert m["per_decoded_token"]["wall_ms"] > 0 and m["runs"]["17"]["wall_ms"] > m["runs"]["1"]["wall_ms"]
        assert m["per_decoded_token"]["kernels"] == 0 and m["top_kernels_over_the_long_run"] == []  # none on a CPU
        assert m["step_graphs"] == {"captures": 0, "replays": 0, "head_captures": 0, "head_replays": 0}


def test_mtp_rounds_on_the_cpu_writes_every_mode_of_every_round(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench/mtp_rounds.py"), "--device", "cpu", "--rounds", "2",
                        "--tokens", "8", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [(x["round"], x["mode"]) for x in d["rounds"]] == [(i, m) for i in range(2)
                                                             for m in ("plain", "auto", "k1", "k2")]
    for x in d["rounds"]:
        assert x["tok_s"] > 0 and x["decode_tokens"] == 3 * 7
        assert (x["drafted"] == 0) == (x["mode"] == "plain") or x["mode"] == "auto"
        assert x["accepted"] <= x["drafted"]
