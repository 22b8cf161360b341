from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.fixtures import KQUANT_MOE, TINY_DENSE, TINY_MOE, fixture_path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=120)


def test_inspect_json() -> None:
    r = cli("inspect", str(fixture_path(KQUANT_MOE)), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "qwen35moe" and info["mtp"] is True
    assert info["layer_pattern"] == "RRRAM"
    assert set(info["tensor_types"]) >= {"F32", "Q4_K", "Q6_K"}
    p = info["params"]
    assert p["total"] == p["trunk"] + p["mtp"] and 0 < p["active_per_token"] < p["trunk"]
    assert info["hparams"]["experts"] == KQUANT_MOE.n_expert


def test_inspect_text_dense() -> None:
    r = cli("inspect", str(fixture_path(TINY_DENSE)))
    assert r.returncode == 0, r.stderr
    assert "qwen35" in r.stdout and "dense" in r.stdout and "RRRAM" in r.stdout


def test_tokenize_json(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("<|im_start|>user\nHello world<|im_end|>", encoding="utf-8")
    r = cli("tokenize", str(fixture_path(TINY_MOE)), "--text-file", str(f), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n_tokens"] == len(out["ids"]) > 3
    assert out["ids"][0] == TINY_MOE.n_vocab - 2  # <|im_start|> is parsed as its control token


def test_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    for args in (("inspect", str(bad)), ("inspect", str(tmp_path / "missing.gguf")),
                 ("tokenize", str(fixture_path(TINY_MOE)), "--text-file", str(tmp_path / "none.txt"))):
        r = cli(*args)
        assert r.returncode == 1
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
        assert "Traceback" not in r.stderr


def test_logits_matches_engine(tmp_path: Path) -> None:
    import numpy as np

    out = tmp_path / "l.npy"
    r = cli("logits", str(fixture_path(TINY_MOE)), "--tokens", "1,2,3,4,5", "--out", str(out))
    assert r.returncode == 0, r.stderr
    a = np.load(out)
    assert a.shape == (5, TINY_MOE.n_vocab) and a.dtype == np.float32
    from tests.oracle_llama import llama_logits

    ref = llama_logits(fixture_path(TINY_MOE), [1, 2, 3, 4, 5])
    assert np.abs(a - ref).max() / ref.std() < 1e-4
    r = cli("logits", str(fixture_path(TINY_MOE)), "--tokens", "1,99999", "--out", str(out))
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr


def test_generate_json() -> None:
    r = cli("generate", str(fixture_path(TINY_MOE)), "--prompt", "Hi", "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"tokens", "text", "accepted_draft", "stats"}
    assert len(out["accepted_draft"]) == len(out["tokens"]) and out["stats"]["mtp"] is True
    s = out["stats"]
    assert s["generated_tokens"] == len(out["tokens"]) <= 6
    for key in ("prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s"):
        assert key in s
    r2 = cli("generate", str(fixture_path(TINY_MOE)), "--prompt-tokens", "1,2,3", "--max-tokens", "4", "--json")
    assert r2.returncode == 0 and json.loads(r2.stdout)["stats"]["prompt_tokens"] == 3
    r4 = cli("generate", str(fixture_path(TINY_MOE)), "--prompt-tokens", "1,2,3", "--max-tokens", "12",
             "--draft", "3", "--json")
    st = json.loads(r4.stdout)["stats"]
    assert r4.returncode == 0 and st["drafted"] > 0 and len(st["acceptance_by_depth"]) == 8
    assert set(st["time_s"]) == {"draft", "verify", "commit", "plain_decode"}
    r5 = cli("generate", str(fixture_path(TINY_MOE)), "--prompt-tokens", "1,2,3", "--no-mtp", "--json")
    assert r5.returncode == 0 and json.loads(r5.stdout)["stats"]["mtp"] is False
    assert cli("generate", str(fixture_path(TINY_MOE)), "--prompt", "x", "--draft", "9").returncode == 2
    r3 = cli("generate", str(fixture_path(TINY_MOE)), "--prompt-tokens", "1,2,3", "--ctx", "2", "--json")
    assert r3.returncode == 1 and r3.stderr.startswith("error: ")


def test_the_missing_mtp_notice_only_when_mtp_was_asked_for() -> None:
    from dataclasses import replace

    path = str(fixture_path(replace(TINY_MOE, mtp=False)))
    common = ("generate", path, "--prompt", "hi", "--max-tokens", "2", "--json")
    with_mtp, without = cli(*common), cli(*common, "--no-mtp")
    assert with_mtp.returncode == 0 and without.returncode == 0, (with_mtp.stderr, without.stderr)
    assert "note: " in with_mtp.stderr and "has no MTP block" in with_mtp.stderr
    assert "has no MTP block" not in without.stderr
