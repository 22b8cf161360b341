"""bench/thread_choice.py: a short run writes each iteration's placement, both steps' times and the chosen count."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_run_writes_the_iterations_and_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench/thread_choice.py"), "--seconds", "1", "--tokens", "12",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["model"] == "foretell-demo.gguf" and d["threads"] == 2 and d["iterations"]
    for it in d["iterations"]:
        one, two = it["read_gb_s_1"], it["read_gb_s_2"]
        assert it["placement"] == ("split" if two > 1.5 * one else "contended" if two < one else "shared")
        assert it["fixed_us"] > 0 and it["chosen_us"] > 0 and it["chosen_count"] in (1, 2)
    assert set(d["summary"]) <= {"shared", "split", "contended"} and sum(s["iterations"] for s in d["summary"].values()) == \
        len(d["iterations"])
