"""Engine API safety: an abandoned generator leaves the engine consistent; one generation at a time per engine."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.errors import EngineBusyError
from engine.events import Done, EngineConfig, GenerationConfig, Token
from engine.generate import load
from tests.fixtures import TINY_MOE, fixture_path
from tests.generation import collect
from tests.test_speculative import OracleDrafter


def _engine():
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=512))
    eng.tokenizer.eog_ids = frozenset()
    return eng


PROMPT = np.random.default_rng(3).integers(0, 380, 20).tolist()


@pytest.fixture(scope="module")
def truth() -> list[int]:
    toks, _, _, _ = collect(_engine(), PROMPT, max_tokens=80, mtp=False)
    return toks


@pytest.mark.parametrize("after", [1, 2, 3])  # abandoned after the 1st, 2nd, 3rd token of an accepted window
def test_abandoned_generator_inside_an_accepted_window_keeps_the_next_turn_exact(truth, after) -> None:
    eng = _engine()
    eng.drafter = OracleDrafter(eng.drafter, truth, len(PROMPT), wrong_every=1000)  # windows of 4 accepted
    it = eng.generate(PROMPT, GenerationConfig(max_tokens=60, mtp=True, draft=4))
    got: list[int] = []
    seen_draft = 0
    for ev in it:
        if isinstance(ev, Token):
            got += ev.ids
            seen_draft = seen_draft + 1 if ev.accepted_draft else 0
            if seen_draft == after and len(got) > 6:
                break
    it.close()  # the consumer walks away with the window half-delivered
    assert got == truth[:len(got)]
    seq = eng.sequence
    assert eng.consistent() and eng.cache.pos == len(seq) and not eng.busy
    # The engine recorded exactly what the consumer saw; the next turn reuses it and equals a fresh run.
    assert seq == (PROMPT + got)[:len(seq)] and len(seq) >= len(PROMPT) + len(got) - 1
    turn2 = PROMPT + got + [11, 12, 13]
    t2, _, final, _ = collect(eng, turn2, max_tokens=12, mtp=True, draft=2)
    assert final.prefill_tokens < final.prompt_tokens
    fresh = _engine()
    t2_plain, _, _, _ = collect(fresh, turn2, max_tokens=12, mtp=False)
    assert t2 == t2_plain


def test_abandoned_by_garbage_collection_releases_the_engine(truth) -> None:
    eng = _engine()
    it = eng.generate(PROMPT, GenerationConfig(max_tokens=40, mtp=True, draft=3))
    next(it)
    assert eng.busy
    del it  # CPython closes a dropped generator at once
    assert not eng.busy and eng.consistent()
    toks, _, _, _ = collect(eng, PROMPT, max_tokens=20, mtp=False)
    assert toks == truth[:20]


def test_second_generator_in_the_same_thread_gets_busy_at_once() -> None:
    eng = _engine()
    a = eng.generate(PROMPT, GenerationConfig(max_tokens=20))
    next(a)
    b = eng.generate(PROMPT, GenerationConfig(max_tokens=20))
    t0 = time.perf_counter()
    with pytest.raises(EngineBusyError):
        next(b)
    # Even with a wait: the holder is this very thread, so waiting could never end.
    c = eng.generate(PROMPT, GenerationConfig(max_tokens=20), wait_s=30)
    with pytest.raises(EngineBusyError):
        next(c)
    assert time.perf_counter() - t0 < 5
    with pytest.raises(EngineBusyError):
        eng.reset()
    rest = [e for e in a]  # the first one is unharmed
    assert isinstance(rest[-1], Done) and rest[-1].reason == "max_tokens"
    assert not eng.busy


def test_two_threads_one_engine_each_reply_is_exact(truth) -> None:
    eng = _engine()
    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def worker(name: str, wait_s: float | None) -> None:
        start.wait()
        try:
            toks, _, _, done = _gen_wait(eng, wait_s)
            results[name] = toks
        except EngineBusyError as e:
            results[name] = e

    # Both wait: they run one after the other and both replies equal the single-caller truth.
    ts = [threading.Thread(target=worker, args=(n, None)) for n in ("a", "b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert results["a"] == truth[:40] and results["b"] == truth[:40]
    # Without waiting, the loser gets EngineBusyError and the winner's reply is exact.
    results.clear()
    it = eng.generate(PROMPT, GenerationConfig(max_tokens=40, mtp=False))
    first = next(it)
    th = threading.Thread(target=lambda: results.setdefault("late", _try(eng, 0.0)))
    th.start()
    th.join(60)
    assert isinstance(results["late"], EngineBusyError)
    toks = list(first.ids) + [t for e in it if isinstance(e, Token) for t in e.ids]
    assert toks == truth[:40]


def test_waiting_caller_times_out_with_busy() -> None:
    eng = _engine()
    it = eng.generate(PROMPT, GenerationConfig(max_tokens=20))
    next(it)
    out: list[object] = []
    th = threading.Thread(target=lambda: out.append(_try(eng, 0.3)))
    t0 = time.perf_counter()
    th.start()
    th.join(30)
    assert isinstance(out[0], EngineBusyError) and 0.25 < time.perf_counter() - t0 < 10
    it.close()
    assert _try(eng, 0.0) == "ok"


def _gen_wait(eng, wait_s):
    toks = []
    for ev in eng.generate(PROMPT, GenerationConfig(max_tokens=40, mtp=True, draft=2), wait_s=wait_s):
        if isinstance(ev, Token):
            toks += ev.ids
    return toks, None, None, None


def _try(eng, wait_s: float):
    try:
        for _ in eng.generate(PROMPT, GenerationConfig(max_tokens=3), wait_s=wait_s):
            pass
        return "ok"
    except EngineBusyError as e:
        return e
