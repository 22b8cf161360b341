"""The generation loop: events, greedy self-consistency, stop flag, stop strings, context limits."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engine.chat import Message
from engine.events import Done, EngineConfig, GenerationConfig, Progress, Stats, Token
from engine.generate import load
from engine.sampling import SamplingConfig
from tests.fixtures import KQUANT_MOE, TINY_DENSE, TINY_MOE, fixture_path


def _run(eng, prompt, **kw):
    events = list(eng.generate(prompt, GenerationConfig(**kw)))
    toks = [t for e in events if isinstance(e, Token) for t in e.ids]
    done = events[-1]
    assert isinstance(done, Done)
    return toks, events, done


def _no_eos(eng) -> None:
    # Random fixtures emit end-of-generation ids by chance; tests of long runs drop them.
    eng.tokenizer.eog_ids = frozenset()


@pytest.mark.parametrize("spec", [TINY_MOE, TINY_DENSE, KQUANT_MOE], ids=["moe", "dense", "moe-q4k"])
def test_greedy_tokens_are_argmax_of_full_sequence_logits(spec) -> None:
    # Spec §8(d): every token generated step by step must be the argmax of the engine's own logits
    # over prompt + generated tokens computed in one pass.
    eng = load(fixture_path(spec), EngineConfig(n_ctx=512))
    _no_eos(eng)
    prompt = np.random.default_rng(4).integers(0, spec.n_vocab - 3, 40).tolist()
    toks, _, done = _run(eng, prompt, max_tokens=48)
    assert done.reason == "max_tokens" and len(toks) == 48
    full = prompt + toks
    m = eng.runner
    logits = m.forward(full, m.new_cache(512), logit_rows="all", chunked=False).logits
    pred = logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert pred == toks


def test_events_and_stats() -> None:
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=256))
    _no_eos(eng)
    toks, events, done = _run(eng, [Message("user", "Hello there")], max_tokens=10, stats_interval_s=0.0)
    stats = [e for e in events if isinstance(e, Stats)]
    assert stats and stats[-1].final and not any(s.final for s in stats[:-1])
    f = stats[-1]
    assert f.generated_tokens == 10 and f.prompt_tokens > 5 and f.prefill_tokens == f.prompt_tokens
    assert f.ttft_s > 0 and f.prefill_tok_s > 0 and f.decode_tok_s > 0 and f.cache_bytes > f.state_bytes > 0
    text = "".join(e.text for e in events if isinstance(e, Token))
    assert text == eng.tokenizer.decode(toks, skip_special=True)  # control tokens are never shown


def test_next_turn_reuses_the_cache_and_matches_a_fresh_run() -> None:
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=512))
    _no_eos(eng)
    p1 = np.random.default_rng(1).integers(0, 380, 30).tolist()
    t1, _, _ = _run(eng, p1, max_tokens=8)
    p2 = p1 + t1 + np.random.default_rng(2).integers(0, 380, 12).tolist()
    t2, ev, _ = _run(eng, p2, max_tokens=8)
    final = [e for e in ev if isinstance(e, Stats)][-1]
    assert final.prefill_tokens < final.prompt_tokens  # the first turn was not recomputed
    fresh = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=512))
    _no_eos(fresh)
    t2_fresh, _, _ = _run(fresh, p2, max_tokens=8)
    assert t2 == t2_fresh
    # A prompt that does not extend the cached sequence starts over, correctly.
    t3, _, _ = _run(eng, p1, max_tokens=8)
    assert t3 == t1


def test_stop_flag_is_honoured_within_one_step() -> None:
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=512))
    _no_eos(eng)
    stop = threading.Event()
    n = 0
    for ev in eng.generate([1, 2, 3], GenerationConfig(max_tokens=200), stop):
        if isinstance(ev, Token):
            n += 1
            if n == 5:
                stop.set()
        last = ev
    assert isinstance(last, Done) and last.reason == "stopped" and n == 5
    stop.set()
    evs = list(eng.generate([4, 5, 6], GenerationConfig(max_tokens=5), stop))
    assert isinstance(evs[-1], Done) and evs[-1].reason == "stopped"
    assert not any(isinstance(e, Token) for e in evs)


def test_eos_ends_generation() -> None:
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=256))
    prompt = [1, 2, 3]
    first, _, _ = _run(eng, prompt, max_tokens=1)
    eng.tokenizer.eog_ids = frozenset({first[0]})
    eng.reset()
    toks, events, done = _run(eng, prompt, max_tokens=20)
    assert done.reason == "eos" and toks == []


def test_stop_string_cuts_text_exactly() -> None:
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=256))
    _no_eos(eng)
    toks, events, _ = _run(eng, [7, 8, 9], max_tokens=30)
    text = "".join(e.text for e in events if isinstance(e, Token))
    assert len(text) > 6
    stop = text[4:7]
    eng.reset()
    _, events, done = _run(eng, [7, 8, 9], max_tokens=30, stop_strings=(stop,))
    got = "".join(e.text for e in events if isinstance(e, Token))
    assert done.reason == "stop_string" and got == text[:text.find(stop)]


def test_context_overflow_and_full() -> None:
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=32))
    _no_eos(eng)
    _, _, done = _run(eng, list(range(40)), max_tokens=4)
    assert done.reason == "context_overflow" and "32" in done.message
    toks, _, done = _run(eng, list(range(20)), max_tokens=100)
    assert done.reason == "context_full" and 20 + len(toks) == 33


def test_seeded_sampling_reproducible() -> None:
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=256))
    _no_eos(eng)
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, seed=42)
    a, _, _ = _run(eng, [1, 2], max_tokens=12, sampling=cfg)
    eng.reset()
    b, _, _ = _run(eng, [1, 2], max_tokens=12, sampling=cfg)
    assert a == b


def test_long_prompt_reports_prefill_progress_before_the_first_token() -> None:
    from engine.generate import PREFILL_CHUNK

    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=2048))
    n = PREFILL_CHUNK * 2 + 10
    prompt = np.random.default_rng(1).integers(0, TINY_MOE.n_vocab - 3, n).tolist()
    toks, events, _ = _run(eng, prompt, max_tokens=2)
    first_token = next(i for i, e in enumerate(events) if isinstance(e, Token))
    prog = [(e.done, e.total) for e in events[:first_token] if isinstance(e, Progress)]
    assert prog == [(0, n), (PREFILL_CHUNK, n), (2 * PREFILL_CHUNK, n), (n, n)]
    assert not any(isinstance(e, Progress) for e in events[first_token:])
    # A short follow-up (one chunk to compute) gives no progress events.
    _, events, _ = _run(eng, prompt + toks + [5], max_tokens=1)
    assert not any(isinstance(e, Progress) for e in events)
