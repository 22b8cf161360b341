from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cli import main as engine_main
from engine.tokenizer import Tokenizer

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
    assert r3.returncode == 1 and r3.stderr.startswith("error: the prompt has 3 tokens but the context holds 2;")


def test_the_missing_mtp_notice_only_when_mtp_was_asked_for() -> None:
    from dataclasses import replace

    path = str(fixture_path(replace(TINY_MOE, mtp=False)))
    common = ("generate", path, "--prompt", "hi", "--max-tokens", "2", "--json")
    with_mtp, without = cli(*common), cli(*common, "--no-mtp")
    assert with_mtp.returncode == 0 and without.returncode == 0, (with_mtp.stderr, without.stderr)
    assert "note: " in with_mtp.stderr and "has no MTP block" in with_mtp.stderr
    assert "has no MTP block" not in without.stderr


def test_tokenize_keeps_the_file_exactly(tmp_path: Path, capsys) -> None:
    """Bytes decoded as UTF-8, line ends as written: a Windows file's "\\r\\n" stays (it was read as "\\n")."""
    from engine.storage.modelfile import default_model_path, open_model

    text = "\r\nwindows line\r\n\ufeffbom and \r lone cr\n"
    f = tmp_path / "win.txt"
    f.write_bytes(text.encode("utf-8"))
    assert engine_main(["tokenize", "--text-file", str(f), "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)["ids"]
    tok = Tokenizer.from_metadata(open_model(default_model_path()).metadata)
    assert ids == tok.encode(text, special=True, add_bos=False)
    assert ids != tok.encode(text.replace("\r\n", "\n"), special=True, add_bos=False)
    assert tok.decode(ids) == text


def _one_line(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in err, err
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["serve", "--queue", "-1"], "queue -1 is out of range"),
    (["serve", "--api-key", ""], "API key must be"),
    (["serve", "--port", "70000"], "port 70000 is out of range"),
    (["serve", "--port", "-1"], "port -1 is out of range"),
    (["serve", "--cors", "*"], "is not an origin"),
    (["serve", "--max-tokens", "0"], "max_tokens 0 is out of range"),
    (["generate", "--prompt", "hi", "--expert-cache", "lots"], "expert cache 'lots'"),
    (["generate", "--prompt", "hi", "--stop", ""], "a stop string must have 1…256 characters"),
    (["generate", "--prompt", "hi", "--stop", "x" * 257], "a stop string must have 1…256 characters"),
    (["generate", "--prompt", "hi", "--gpu-layers", "3"], "need a GPU device"),
    (["logits", "--tokens", "1,2", "--out", "/nonexistent/dir/o.npy"], "the folder /nonexistent/dir does not exist"),
    (["tokenize", "--text-file", "/dev/zero"], "/dev/zero is over 16 MiB"),
])
def test_issue_48_arguments_are_one_line_and_exit_2(capsys, args: list[str], needle: str) -> None:
    t0 = time.perf_counter()
    try:
        rc = engine_main(args)
    except SystemExit as e:  # argparse's complaint
        rc = e.code
    assert rc == 2 and needle in _one_line(rc, capsys.readouterr().err)
    assert time.perf_counter() - t0 < 5  # before the model is loaded, before /dev/zero is read to the end


def test_write_errors_exit_1(tmp_path: Path) -> None:
    model = str(fixture_path(TINY_MOE))
    r = cli("logits", model, "--tokens", "1,2", "--out", "/dev/full")
    assert r.returncode == 1 and "cannot write /dev/full: No space left on device" in _one_line(r.returncode, r.stderr)
    out = tmp_path / "named"  # the path as given: np.save would have written named.npy
    assert cli("logits", model, "--tokens", "1,2", "--out", str(out)).returncode == 0 and out.exists()
    for json_flag in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            r = subprocess.run([sys.executable, "-m", "engine", "generate", model, "--prompt", "hi", "--max-tokens",
                                "3", *json_flag], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert r.returncode == 1, r.stderr
        assert "cannot write the output: No space left on device" in _one_line(r.returncode, r.stderr)
    r = subprocess.run(["bash", "-c", 'exec "$0" -m engine generate "$1" --prompt hi --max-tokens 3 >&-',
                        sys.executable, model], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "standard output is closed" in _one_line(r.returncode, r.stderr)


def test_collect_reports_a_prompt_over_the_context() -> None:
    """The engine ends an overflow with Done alone (no final Stats): that is its message, not 'no result'."""
    from engine.consume import collect
    from engine.errors import ContextOverflowError
    from engine.events import Done

    with pytest.raises(ContextOverflowError, match="the prompt has 9 tokens"):
        collect([Done("context_overflow", "the prompt has 9 tokens but the context holds 4")])


def test_generate_holds_a_reply_to_a_schema_file_or_says_why_not(tmp_path: Path, capsys) -> None:
    """generate --schema FILE: the reply is JSON valid for the schema (constrained decoding), greedy and sampled; a
    missing file, one that is not JSON, not a schema or not one llguidance enforces, or --remote: one line, exit 2."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    path = tmp_path / "person.json"
    path.write_text(json.dumps(schema))
    for extra in ([], ["--temp", "1.0", "--seed", "3"]):
        assert engine_main(["generate", "--prompt", "A person as JSON.", "--schema", str(path), "--json",
                            "--max-tokens", "120", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        jsonschema.validate(json.loads(out["text"]), schema)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "typo.json").write_text('{"type": "strin"}')
    for name, needle in (("nope.json", "cannot read"), ("broken.json", "is not JSON"), ("list.json", "schema object"),
                         ("typo.json", "not a JSON schema")):
        rc = engine_main(["generate", "--prompt", "x", "--schema", str(tmp_path / name)])
        assert rc == 2 and needle in _one_line(rc, capsys.readouterr().err)
    rc = engine_main(["generate", "--prompt", "x", "--schema", str(path), "--remote", "http://127.0.0.1:9"])
    assert rc == 2 and "--schema holds a local model's reply" in _one_line(rc, capsys.readouterr().err)
