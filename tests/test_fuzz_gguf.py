"""Seeded GGUF fuzzing (tests/gguf_mutate.py) over the embedded model and a K-quant fixture: every damaged copy
ends in a typed error or loads as the very same model, each within a time bound, the whole run within a memory
bound. The default run tries 300 cases; `pytest -m slow` (which CI runs: `make test` selects no markers) 1,200."""
from __future__ import annotations

import resource
from pathlib import Path

import pytest

from engine.errors import EngineError
from engine.generate import text_side
from engine.storage.modelfile import default_model_path, open_model
from tests import gguf_mutate as gm
from tests.fixtures import KQUANT_MOE, fixture_path

CASE_LIMIT_S = 10  # generous for a loaded 2-core machine; a valid open takes ~0.1 s
MEMORY_LIMIT = 1 << 30  # growth of the process's peak RSS over the whole run


def _open(path: Path):
    mf = open_model(path)
    tok, chat = text_side(mf)
    return mf, tok, chat


def run_cases(src: Path, n: int, seed: int, tmp: Path) -> dict[str, dict[str, int]]:
    buf = src.read_bytes()
    lay = gm.layout(buf)
    valid = gm.fingerprint(src, _open)
    by_class: dict[str, dict[str, int]] = {}
    findings: list[str] = []
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    path = tmp / "case.gguf"
    for case_seed, cls in gm.cases(n, seed):
        data, what = gm.make_case(buf, lay, case_seed, cls)
        path.write_bytes(data)
        outcome, detail, dt = gm.timed_judge(path, _open, valid, EngineError, CASE_LIMIT_S)
        row = by_class.setdefault(cls, {})
        row[outcome] = row.get(outcome, 0) + 1
        if outcome in ("typed", "same"):
            assert detail.count("\n") == 0
        else:
            findings.append(f"{cls} seed {case_seed} ({what}): {outcome} {detail} [{dt:.2f} s]")
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    assert not findings, "\n".join(findings[:20])
    assert grew < MEMORY_LIMIT, f"peak memory grew by {grew / 2 ** 20:.0f} MiB"
    return by_class


@pytest.mark.parametrize("model,n", [("embedded", 150), ("kquant", 150)])
def test_fuzz_gguf(tmp_path, model, n) -> None:
    src = default_model_path() if model == "embedded" else fixture_path(KQUANT_MOE)
    by_class = run_cases(src, n, seed=29, tmp=tmp_path)
    assert set(by_class) == set(gm.CLASSES)
    assert sum(r.get("typed", 0) for r in by_class.values()) > n * 0.7  # the mutator really damages files


@pytest.mark.slow
@pytest.mark.parametrize("model,n", [("embedded", 800), ("kquant", 400)])
def test_fuzz_gguf_long(tmp_path, model, n) -> None:
    src = default_model_path() if model == "embedded" else fixture_path(KQUANT_MOE)
    run_cases(src, n, seed=2029, tmp=tmp_path)


def test_mutator_is_deterministic() -> None:
    buf = fixture_path(KQUANT_MOE).read_bytes()
    lay = gm.layout(buf)
    for case_seed, cls in gm.cases(30, 7):
        a, _ = gm.make_case(buf, lay, case_seed, cls)
        b, _ = gm.make_case(buf, lay, case_seed, cls)
        assert a == b and a != buf
