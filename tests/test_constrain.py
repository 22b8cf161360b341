"""Structured output (issue 46, item 2): response_format json_object and json_schema enforced by constrained decoding
(engine.constrain), through the official openai client; greedy MTP the same tokens as plain under a schema; a draft
the constraint forbids never accepted; a schema the server cannot enforce refused with 400."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest
import torch

import engine.generate
from bench.constrain import SCHEMA  # three people: nested objects, arrays, enums, a pattern
from engine.constrain import Constraint, Matcher
from engine.errors import InvalidParameterError
from engine.events import GenerationConfig
from engine.sampling import Sampler, SamplingConfig
from engine.speculative import Draft, accept_greedy, accept_sampling
from engine.server.run import LocalServer
from tests.generation import collect

FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA, "strict": True}}
PROMPTS = ["Describe three people as JSON.", "Who made the heaven?", "Spell the word banana."]
CHAT = [{"role": "user", "content": PROMPTS[0]}]


@pytest.fixture(scope="module")
def served():
    """The embedded model, and the official client of a server that serves it."""
    model = engine.generate.load(None)
    srv = LocalServer(model, port=0)
    srv.start()
    try:
        yield model, openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    finally:
        srv.stop()


@pytest.fixture
def eng(served):
    return served[0]


@pytest.fixture
def client(served):
    return served[1]


def allowed(c: Constraint, tokenizer, ids: list[int]) -> Matcher:  # type: ignore[no-untyped-def]
    """A fresh matcher moved over `ids`: ConstraintError at the first token the constraint forbids."""
    m = Matcher(c, tokenizer)
    for t in ids:
        m.consume(t)
    return m


def ask(client, prompt: str, **kw):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                          **{"max_tokens": 512, **kw})


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.3])
def test_schema_output_always_parses_and_validates(client, temperature: float) -> None:
    for i, prompt in enumerate(PROMPTS):
        r = ask(client, prompt, temperature=temperature, seed=i, response_format=FORMAT)
        choice = r.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_schema_output_streamed_with_mtp(client) -> None:
    stream = ask(client, PROMPTS[1], temperature=0.7, seed=5, response_format=FORMAT, stream=True,
                 extra_body={"mtp": 3})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), SCHEMA)


def test_json_object_output_is_an_object(client, eng) -> None:
    """The embedded model is too small to close a free key string within max_tokens (the schema tests above show
    replies that end): its output is an object in the making, every token one the constraint allows."""
    for temperature in (0.0, 0.9):
        r = ask(client, PROMPTS[0], temperature=temperature, seed=3, response_format={"type": "json_object"},
                max_tokens=48)
        content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert content.startswith("{")
        allowed(Constraint.json_object(), eng.tokenizer, eng.tokenizer.encode(content, add_bos=False))
        if finish == "stop":
            assert isinstance(json.loads(content), dict)
        else:
            assert finish == "length"


def test_text_response_format_is_free_text(client) -> None:
    r = ask(client, PROMPTS[2], temperature=0, response_format={"type": "text"}, max_tokens=24)
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("fmt, says", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                   "properties": {"a": {"$ref": "#/nowhere"}}}}},
     "nowhere"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}, "name"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "json_object"),
])
def test_a_format_or_schema_that_cannot_be_enforced_is_400(client, fmt, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, PROMPTS[0], response_format=fmt)
    assert e.value.status_code == 400 and says in e.value.body["message"]
    assert e.value.body["param"].startswith("response_format")


def test_json_with_tools_that_may_be_called_is_400(client) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        ask(client, PROMPTS[0], response_format={"type": "json_object"}, tools=[tool])


def test_greedy_mtp_gives_the_same_tokens_as_plain_under_a_schema(eng) -> None:
    c = Constraint.json_schema(SCHEMA)
    plain, _, _, done = collect(eng, CHAT, max_tokens=512, mtp=False, constraint=c)
    spec, from_draft, _, spec_done = collect(eng, CHAT, max_tokens=512, mtp=True, draft=3, constraint=c)
    assert spec == plain and done.reason == spec_done.reason == "eos"
    assert sum(from_draft) > 5  # drafts were in play
    free, _, _, _ = collect(eng, CHAT, max_tokens=len(plain), mtp=False)
    assert free != plain  # the constraint changed the reply


def test_every_emitted_token_was_allowed_with_drafts_sampled(eng) -> None:
    c = Constraint.json_schema(SCHEMA)
    for seed in range(4):
        ids, from_draft, _, done = collect(eng, CHAT, max_tokens=512, mtp=True, draft=4, constraint=c,
                                           sampling=SamplingConfig(temperature=1.0, seed=seed))
        assert done.reason == "eos" and allowed(c, eng.tokenizer, ids).done
        jsonschema.validate(json.loads(eng.tokenizer.decode(ids)), SCHEMA)


def forced_rows(eng, favourite: int, n: int) -> torch.Tensor:
    """`n` logit rows whose clear favourite is one token."""
    rows = torch.zeros(n, eng.tokenizer.n_vocab)
    rows[:, favourite] = 50.0
    return rows


def test_a_draft_the_constraint_forbids_is_never_accepted(eng) -> None:
    tok = eng.tokenizer
    m = Matcher(Constraint.json_object(), tok)
    brace, letter = tok.encode("{", add_bos=False)[0], tok.encode("a", add_bos=False)[0]
    assert m.allows(brace) and not m.allows(letter)
    # the verify rows favour the forbidden draft: the masked choice is an allowed token, and no draft is accepted
    n_acc, nxt = accept_greedy(forced_rows(eng, letter, 2), [letter], Sampler(SamplingConfig()), [], m)
    assert n_acc == 0 and nxt != letter and m.allows(nxt)
    # sampled: a forbidden draft (p gives it nothing) is never accepted, and the token drawn instead is allowed
    hot = Sampler(SamplingConfig(temperature=1.0, seed=1))
    q = torch.softmax(forced_rows(eng, letter, 1)[0], -1)
    for _ in range(50):
        n_acc, nxt = accept_sampling(forced_rows(eng, letter, 2), Draft([letter], [q]), hot, [], m)
        assert n_acc == 0 and m.allows(nxt)
    # an allowed draft is accepted, and the matcher is moved back after it: it holds only what was emitted
    n_acc, nxt = accept_greedy(forced_rows(eng, brace, 2), [brace], Sampler(SamplingConfig()), [], m)
    assert n_acc == 1 and m.allows(brace) and not m.allows(nxt)


def test_the_engine_refuses_a_schema_it_cannot_enforce_before_the_prompt(eng) -> None:
    with pytest.raises(InvalidParameterError, match="cannot be enforced"):
        next(iter(eng.generate(CHAT, GenerationConfig(constraint=Constraint('{"type": "strin"}')))))


def mask_ids(m: Matcher) -> set[int]:
    words = m.bits().numpy().view(np.uint32)
    return {int(w) * 32 + b for w in np.nonzero(words)[0] for b in range(32) if words[w] >> b & 1}


def test_a_forced_run_is_each_step_the_only_token_the_mask_allows(eng) -> None:
    """Matcher.forced takes, and consumes, the tokens a fresh matcher's mask allows alone, one state after another,
    and stops where the mask allows a choice (or at its limit); the mask of the state it stops in is the same."""
    c, tok = Constraint.json_schema(SCHEMA), eng.tokenizer
    prefix = tok.encode('{"people": [{"name": "Adam", "age": 93', add_bos=False)
    assert allowed(c, tok, prefix).forced(0) == []
    m = allowed(c, tok, prefix)
    run = m.forced(15)
    assert len(run) >= 3 and tok.decode(run).startswith(', "colours"')
    ref = allowed(c, tok, prefix)
    for t in run:
        assert mask_ids(ref) == {t}
        ref.consume(t)
    assert len(mask_ids(ref)) > 1 and mask_ids(m) == mask_ids(ref)
    short = allowed(c, tok, prefix)
    assert short.forced(2) == run[:2]


def test_allows_says_what_the_mask_says_along_replies(eng) -> None:
    """Where the grammar forces text llguidance's mask allows only its canonical tokens (a lone space is not allowed
    where ' [' is forced, though the grammar would consume it): `allows` agrees with the mask everywhere, so a greedy
    choice checked with it is the mask's."""
    c, tok = Constraint.json_schema(SCHEMA), eng.tokenizer
    ids, _, _, _ = collect(eng, CHAT, max_tokens=512, mtp=False, constraint=c)
    rng = np.random.default_rng(0)
    m, ref, narrower = Matcher(c, tok), Matcher(c, tok), 0
    for t in ids[:-1]:
        want = mask_ids(ref)
        probe = {t, *rng.integers(0, tok.n_vocab, 24).tolist(), *(w for w in want), 220}
        assert {p for p in probe if m.allows(p)} == want & probe
        narrower += any(ref._m.validate_tokens([p]) == 1 and p not in want for p in probe)
        m.consume(t)
        ref.consume(t)
    assert narrower > 0  # the check met states where the mask is narrower than what the grammar consumes


def test_forced_runs_give_the_reply_a_mask_at_every_step_gives_in_fewer_passes(eng, monkeypatch) -> None:
    """A reply with logprobs samples every token (each token's row is read); without, forced runs go through the
    trunk several in a pass: the same greedy tokens, plain and with MTP, in far fewer passes than tokens."""
    c = Constraint.json_schema(SCHEMA)
    passes = []
    forward = eng.runner.forward

    def counted(tokens, *a, **kw):  # type: ignore[no-untyped-def]
        passes.append(len(tokens))
        return forward(tokens, *a, **kw)
    monkeypatch.setattr(eng.runner, "forward", counted)
    every, _, _, done = collect(eng, CHAT, max_tokens=512, mtp=False, constraint=c, logprobs=0)
    n_every = len(passes)
    passes.clear()
    fast, _, _, fast_done = collect(eng, CHAT, max_tokens=512, mtp=False, constraint=c)
    assert fast == every and done.reason == fast_done.reason == "eos"
    assert max(passes) > 4 and len(passes) < 0.6 * n_every
    spec, _, _, _ = collect(eng, CHAT, max_tokens=512, mtp=True, draft=2, constraint=c)
    assert spec == every
