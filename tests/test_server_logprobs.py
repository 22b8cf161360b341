"""Token log-probabilities (issue 46, item 3): off by default at no cost, and when asked, in OpenAI's shapes for chat
and text completions, streamed and whole; sensible as probabilities (each at most 0, the alternatives sorted and
summing to at most 1, the greedy token the most likely); and the same from MTP's accepted drafts as from plain
decoding, where the verify pass's logit rows gave them."""
from __future__ import annotations

import math

import openai
import pytest

import engine.generate
from engine import validate
from engine.events import GenerationConfig, Token
from engine.server.run import LocalServer

PROMPT = [{"role": "user", "content": "Who made the heaven?"}]  # ~31 greedy tokens, most drafted


@pytest.fixture(scope="module")
def eng():
    return engine.generate.load(None)


@pytest.fixture(scope="module")
def client(eng):
    srv = LocalServer(eng, port=0)
    srv.start()
    yield openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    srv.stop()


def tokens(eng, **kw) -> list[Token]:
    return [ev for ev in eng.generate(PROMPT, GenerationConfig(max_tokens=48, **kw)) if isinstance(ev, Token)]


def test_off_by_default_and_the_same_from_drafts_as_from_plain_steps(eng) -> None:
    assert all(t.logprobs == () for t in tokens(eng, mtp=False))
    plain, spec = tokens(eng, mtp=False, logprobs=4), tokens(eng, mtp=True, draft=3, logprobs=4)
    assert [t.ids for t in plain] == [t.ids for t in spec]  # greedy: MTP changes no token
    assert sum(t.accepted_draft for t in spec) > 10  # most of them came from accepted drafts
    for a, b in zip(plain, spec):
        (pa,), (pb,) = a.logprobs, b.logprobs
        assert pa.token == pb.token == a.ids[0] and math.isclose(pa.logprob, pb.logprob, abs_tol=1e-4)
        assert [i for i, _ in pa.top] == [i for i, _ in pb.top]
        assert all(math.isclose(x, y, abs_tol=1e-4) for (_, x), (_, y) in zip(pa.top, pb.top))


def check_entry(entry, greedy: bool, n_top: int) -> None:
    tops = [t.logprob for t in entry.top_logprobs]
    assert entry.logprob <= 0 and len(tops) == n_top and tops == sorted(tops, reverse=True)
    assert sum(math.exp(x) for x in tops) <= 1 + 1e-5 and entry.logprob <= tops[0] + 1e-6
    assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    if greedy:
        assert entry.token == entry.top_logprobs[0].token and math.isclose(entry.logprob, tops[0], abs_tol=1e-6)


def test_chat_logprobs_whole_and_streamed(client) -> None:
    kw = dict(model="m", messages=PROMPT, max_tokens=24, temperature=0, logprobs=True, top_logprobs=5)
    r = client.chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    shown = r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # an end-of-text token is not shown
    assert len(entries) == shown and "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        check_entry(e, greedy=True, n_top=5)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    sampled = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 3})
    for e in sampled.choices[0].logprobs.content:
        check_entry(e, greedy=False, n_top=5)
    assert client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_mtp_and_plain_give_the_same_logprobs_over_the_server(client) -> None:
    kw = dict(model="m", messages=PROMPT, max_tokens=32, temperature=0, logprobs=True, top_logprobs=3)
    plain = client.chat.completions.create(**kw, extra_body={"mtp": False})
    spec = client.chat.completions.create(**kw, extra_body={"mtp": 3})
    assert spec.model_extra["timings"]["draft_n_accepted"] > 0
    a, b = plain.choices[0].logprobs.content, spec.choices[0].logprobs.content
    assert [e.token for e in a] == [e.token for e in b]
    assert all(math.isclose(x.logprob, y.logprob, abs_tol=1e-4) for x, y in zip(a, b))


def test_text_completion_logprobs(client) -> None:
    r = client.completions.create(model="m", prompt="And God said", max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "length"
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3 and max(top.values()) == chosen and top[tok] == chosen
    parts = list(client.completions.create(model="m", prompt="And God said", max_tokens=8, temperature=0, logprobs=3,
                                           stream=True))
    assert [t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens] == lp.tokens


@pytest.mark.parametrize("kw, param", [({"top_logprobs": 2}, "top_logprobs"),
                                       ({"logprobs": True, "top_logprobs": validate.MAX_TOP_LOGPROBS + 1},
                                        "top_logprobs"),
                                       ({"logprobs": 1}, "logprobs"), ({"n": 2}, "n")])
def test_what_is_not_served_is_400(client, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=PROMPT, max_tokens=2, **kw)
    assert e.value.body["param"] == param
