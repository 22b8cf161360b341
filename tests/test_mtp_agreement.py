"""Agreement files (bench/synthetic.py --mtp-agreement): the agreement measured follows the one asked for, greedy
output with MTP is the output without it, an agreement file stores what a random file stores, eh_proj rewritten in
place is a fresh write, and bench/mtp_speedup.py --quick writes its JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from bench.mtp_agreement import agreement_file, greedy_runs, random_prompts
from bench.synthetic import SHAPES, TINY_MTP, noise_for, set_mtp_noise, write_synthetic
from engine.events import EngineConfig
from engine.generate import load
from engine.sampling import SamplingConfig
from tests.generation import plain_then_mtp

ROOT = Path(__file__).resolve().parent.parent
LOW, HIGH = 0.6, 0.95


def _tensors(path: Path) -> list[tuple[str, int, int]]:
    return [(t.name, int(t.tensor_type), int(t.n_bytes)) for t in GGUFReader(path).tensors]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[float, tuple[Path, dict]]:
    """tiny-mtp at LOW, then rewritten to HIGH: our figures at each (the file is left at HIGH)."""
    directory = tmp_path_factory.mktemp("agreement")
    out = {}
    for p in (LOW, HIGH):
        path = agreement_file("tiny-mtp", 0, noise_for("tiny-mtp", p), directory, fresh=p == LOW)
        out[p] = path, greedy_runs(path, random_prompts(4), 48, 2, with_plain=True)[0]
    return out


def test_agreement_follows_the_one_asked_for(measured: dict[float, tuple[Path, dict]]) -> None:
    low, high = measured[LOW][1], measured[HIGH][1]
    assert low["greedy_identical_with_mtp"] and high["greedy_identical_with_mtp"]
    assert high["agreement"] > low["agreement"], (low, high)
    assert min(low["distinct_tokens"] + high["distinct_tokens"]) > 16  # greedy runs do not circle a few tokens


@pytest.mark.parametrize("draft", [2, 4, 8, None], ids=["k2", "k4", "k8", "auto"])
def test_greedy_output_identical_with_mtp(measured: dict[float, tuple[Path, dict]], draft: int | None) -> None:
    eng = load(measured[HIGH][0], EngineConfig(n_ctx=256, n_threads=2))
    eng.tokenizer.eog_ids = frozenset()
    kw = dict(max_tokens=64, sampling=SamplingConfig(temperature=0.0, top_k=1))
    for prompt in random_prompts(2):
        plain, toks, accepted, final = plain_then_mtp(eng, prompt, draft, **kw)
        assert toks == plain
        if draft is not None:  # the drafts were used, not only tried (auto may decode plainly where drafts cost more)
            assert final.speculative.accepted > 0 and any(accepted)


def test_agreement_file_stores_what_a_random_file_stores(tmp_path: Path) -> None:
    """Same tensors, types and sizes as the random file of the shape: the same bytes per token."""
    random = write_synthetic(tmp_path / "random.gguf", TINY_MTP)
    agree = write_synthetic(tmp_path / "agree.gguf", TINY_MTP, agreement=noise_for("tiny-mtp", HIGH))
    assert _tensors(agree) == _tensors(random)


def test_noise_rewritten_in_place_is_a_fresh_write(tmp_path: Path) -> None:
    fresh = write_synthetic(tmp_path / "fresh.gguf", TINY_MTP, agreement=noise_for("tiny-mtp", HIGH))
    moved = write_synthetic(tmp_path / "moved.gguf", TINY_MTP, agreement=noise_for("tiny-mtp", 0.0))
    set_mtp_noise(moved, SHAPES["tiny-mtp"], noise_for("tiny-mtp", HIGH))
    assert moved.read_bytes() == fresh.read_bytes()


def test_quick_benchmark_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    subprocess.run([sys.executable, str(ROOT / "bench/mtp_speedup.py"), "--quick", "--out", str(out), "--dir",
                    str(tmp_path)], cwd=ROOT, check=True, capture_output=True, timeout=900)
    res = json.loads(out.read_text())["shapes"]["tiny-mtp"]
    at = res["p"]["0.9"]
    assert set(at["ours"]) == {"off", "auto", "k1", "k2"} and set(at["llama_cpp"]) == {"off", "k1"}
    assert all(at[e][s]["decode_tok_s"] > 0 for e in ("ours", "llama_cpp") for s in at[e])
    assert len(at["ours"]["k2"]["acceptance_by_position"]) == 2 and at["ours"]["k2"]["cost_in_decode_steps"]["verify_steps"] > 0
    assert at["llama_cpp"]["k1"]["drafted"] > 0
    assert res["routed_expert_bytes"]["verify_k2"]["bytes"] >= res["routed_expert_bytes"]["decode_step"]["bytes"] > 0
