"""bench/hybrid.py, the CUDA hybrid benchmark, exercised without a GPU: its sweep on CPU stand-ins of the CUDA plans
(the embedded model's real routing, so real expert-cache hit rates), its JSON, and its one-line refusal without
CUDA. The measurements themselves need a GPU (see the script's docstring)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import hybrid
from bench.hybrid import UsageError, default_configs, llama_setting, parse_config
from engine.placement import MiB, ModelSizes, PlacementConfig, plan_placement

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench/hybrid.py"


def test_configuration_names() -> None:
    c = parse_config("moe-c64-cpu", 40)
    assert (c.gpu_layers, c.cpu_moe, c.expert_cache, c.miss_policy) == (40, True, "64", "cpu")
    c = parse_config("ngl20-moe-c2048MiB", 40)
    assert (c.gpu_layers, c.cpu_moe, c.expert_cache, c.miss_policy) == (20, True, "2048 MiB", "load")
    assert parse_config("resident", 40).placement() == {"gpu_layers": 40, "cpu_moe": False, "expert_cache": None,
                                                        "miss_policy": "load"}
    assert parse_config("auto", 40).gpu_layers is None
    assert parse_config("moe", 40).expert_cache == "0"
    assert parse_config("resident", 40).step_graphs == "auto" and parse_config("resident-nograph", 40).step_graphs == "off"
    for bad in ("c64-load", "ngl41", "ngl0", "resident-ngl4", "moe-fast"):
        with pytest.raises(UsageError):
            parse_config(bad, 40)
    names = default_configs(40, 256, 2 * MiB, 21 << 30)  # the 35B: the lean sweep, most wanted first
    assert names[:4] == ["resident", "resident-nograph", "moe-c64-load", "moe-c64-cpu"]
    assert {"moe-c16-load", "moe-c16-cpu", "moe-c0", "ngl20"} <= set(names) and not any("MiB" in n for n in names)
    assert any("MiB" in n for n in default_configs(8, 16, 100_000, 24 << 20))


def test_llama_gets_the_same_vram_budget() -> None:
    """cpu-moe with a cache of C bytes ↔ llama.cpp with ⌊C / one layer's experts⌋ layers' experts on the GPU."""
    L = 8
    sizes = ModelSizes(L, [100 * MiB] * L, [1000 * MiB] * L, [10 * MiB] * L, 100, [0] * L, [0] * L, 300 * MiB,
                       300 * MiB, 150 * MiB)

    def plan(**kw):  # type: ignore[no-untyped-def]
        return plan_placement(sizes, PlacementConfig(device="cuda", **kw), None).as_dict()

    assert llama_setting(plan(gpu_layers=L), sizes, L)["n_gpu_layers"] == 999
    s = llama_setting(plan(gpu_layers=L, cpu_moe=True, expert_cache="30"), sizes, L)  # 8 × 30 × 10 MiB = 2.4 layers
    assert (s["n_gpu_layers"], s["n_cpu_moe"], s["experts_on_gpu_layers"]) == (999, 6, 2)
    s = llama_setting(plan(gpu_layers=L, cpu_moe=True, expert_cache="0"), sizes, L)
    assert s["n_cpu_moe"] == L
    s = llama_setting(plan(gpu_layers=4), sizes, L)
    assert (s["n_gpu_layers"], s["n_cpu_moe"]) == (4, 0)


def test_standin_sweep_writes_hit_rates(tmp_path: Path) -> None:
    out = tmp_path / "hybrid.json"
    cmd = [sys.executable, str(SCRIPT), "--cpu-standin", "--model", "embedded",
           "--configs", "resident,moe-c4-load,moe-c4-cpu", "--decode", "6", "--chat-prompts", "1",
           "--threads", "1", "--out", str(out)]
    cmd += ["--llama-cpu"]  # llama.cpp's CPU build beside it (a test dependency): its side and --n-cpu-moe overrides
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["standin"] is True and "stand-in" in d["standin_note"]
    assert d["command"].startswith("python bench/hybrid.py --cpu-standin")
    assert {"commit", "dirty"} <= set(d["git"]) and {"torch", "triton", "cores"} <= set(d["machine"])
    assert d["llama_cpp"]["why"].startswith("llama.cpp CUDA unavailable") or d["llama_cpp"]["ran"]
    m = d["models"]["embedded"]
    assert m["n_layer"] == 8 and m["n_expert"] == 16 and set(m["configs"]) == {"resident", "moe-c4-load",
                                                                              "moe-c4-cpu"}
    for name, c in m["configs"].items():
        assert c["plan_summary"].startswith(f"{m['n_layer']}/{m['n_layer']} layers on GPU")  # the CUDA plan
        none = {"captures": 0, "replays": 0, "head_captures": 0, "head_replays": 0}  # CPU: no graphs
        assert c["ours"]["step_graphs"] == {"setting": "auto", "used": False, "head_used": False, **none}
        for mode in ("plain", "mtp"):
            s = c["ours"][mode]
            assert s["decode_tok_s"] > 0 and s["prefill_tok_s"] > 0 and s["ttft_ms"] > 0
            assert s["generated_per_prompt"] == [6] and s["step_graphs"] == none
            ec = s.get("expert_cache")
            if name == "resident":
                assert ec is None
                continue
            assert set(ec["per_layer"]) == {str(i) for i in range(8)}  # every GPU layer's cache, per layer
            for v in ec["per_layer"].values():
                assert v["capacity"] == 4 and v["hits"] + v["misses"] > 0 and 0.0 <= v["hit_rate"] <= 1.0
            assert 0.0 <= ec["total"]["hit_rate"] <= 1.0 and ec["hit_rate_min"] <= ec["hit_rate_max"]
            assert all(0.0 <= x <= 1.0 for x in ec["static_top_capacity_share"].values())
        assert "drafted" in c["ours"]["mtp"]
        assert c["ours_rounds"] and "decode_tok_s" in c["ours_rounds"][0]["plain"]
    shares = m["configs"]["resident"]["ours"]["plain"]["routing_top_share"]
    assert all(0.0 < x <= 1.0 for per in shares.values() for x in per.values())
    assert m["configs"]["moe-c4-cpu"]["llama_equivalent"]["n_cpu_moe"] == 6  # 8 × 4 experts = 2 layers' worth
    lc = m["configs"]["moe-c4-cpu"]["llama_cpp"]["plain"]
    assert lc["decode_tok_s"] > 0 and lc["params"]["tensor_buft_overrides"].count("=CPU") == 6
    assert m["configs"]["moe-c4-cpu"]["ratios_ours_over_llama"]["decode_plain_vs_llama_plain"] > 0


@pytest.mark.skipif(torch.version.cuda is not None and torch.cuda.is_available(), reason="CUDA is here")
def test_refuses_without_cuda_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "hybrid.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", "embedded", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and not out.exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA device") and "--cpu-standin" in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_bad_configuration_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--cpu-standin", "--model", "embedded", "--configs", "c4-load",
                        "--out", str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "needs 'moe'" in r.stderr
    assert hybrid.MODES == ("plain", "mtp")


def test_llama_gpu_devices_are_told_from_cpu_ones() -> None:
    import xllamacpp as xl

    kinds = {m.name.rsplit("_", 1)[-1]: m for m in xl.ggml_backend_dev_type}
    assert hybrid._is_gpu({"type": kinds["GPU"]}) and not hybrid._is_gpu({"type": kinds["CPU"]})
    assert not hybrid._is_gpu({"type": kinds["ACCEL"]})
    assert not any(hybrid._is_gpu(d) for d in xl.get_device_info() if hybrid._dev_type(d) == "CPU")
    assert hybrid._is_gpu({"type": "GGML_BACKEND_DEVICE_TYPE_GPU"})
    assert not hybrid._is_gpu({"type": "GGML_BACKEND_DEVICE_TYPE_CPU"})


def test_time_budget_skips_runs_but_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "hybrid.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--cpu-standin", "--model", "embedded", "--configs",
                        "resident,moe-c2-cpu", "--budget-s", "0.001", "--no-llama", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["llama_cpp"]["ran"] is False and d["llama_cpp"]["why"] == "--no-llama"
    cs = d["models"]["embedded"]["configs"]
    assert set(cs) == {"resident", "moe-c2-cpu"} and all("time budget" in c["skipped"] for c in cs.values())
    assert all("ours" not in c for c in cs.values())
    assert cs["moe-c2-cpu"]["plan_summary"].startswith("8/8 layers on GPU, experts on CPU, cache 2 experts/layer")


def test_llama_bench_binary_is_driven_and_read(tmp_path: Path) -> None:
    """--llama-bench: a stand-in binary that prints what llama-bench's `-o json` prints (pp row, tg row)."""
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(tmp_path / 'argv')!r}, 'a').write("
                    "' '.join(sys.argv[1:]) + '\\n')\nprint('loading...', file=sys.stderr)\n"
                    "print(json.dumps([{'n_prompt': 128, 'n_gen': 0, 'avg_ts': 900.0, 'stddev_ts': 1.0, "
                    "'backends': 'CUDA', 'gpu_info': 'fake'}, {'n_prompt': 0, 'n_gen': 6, 'avg_ts': 40.0, "
                    "'stddev_ts': 0.5, 'build_commit': 'abc'}], indent=2))\n")
    fake.chmod(0o755)
    out = tmp_path / "hybrid.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--cpu-standin", "--model", "embedded", "--configs",
                        "moe-c4-cpu", "--modes", "plain", "--decode", "4", "--chat-prompts", "1", "--threads", "1",
                        "--llama-bench", str(fake), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    argv = (tmp_path / "argv").read_text().split()
    assert argv[argv.index("-ncmoe") + 1] == "6" and argv[argv.index("-ngl") + 1] == "999"
    assert argv[argv.index("-n") + 1] == "4" and argv[argv.index("-o") + 1] == "json"
    c = json.loads(out.read_text())["models"]["embedded"]["configs"]["moe-c4-cpu"]
    assert c["llama_cpp"]["plain"]["decode_tok_s"] == 40.0 and c["llama_cpp"]["plain"]["prefill_tok_s"] == 900.0
    assert c["ratios_ours_over_llama"]["decode_plain_vs_llama_plain"] == c["ours"]["plain"]["decode_tok_s"] / 40.0
