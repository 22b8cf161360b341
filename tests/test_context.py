"""What of a conversation is sent when it does not all fit the context: the oldest exchanges left out (the system
prompt and the newest message kept), a message that cannot fit refused, and the meter's warning."""
from __future__ import annotations

import pytest

from app.context import (MIN_REPLY_TOKENS, DoesNotFit, TokenCounter, estimate, fit, measure, meter, refusal)
from engine.chat import Message

SYSTEM = [Message("system", "Be brief.")]  # 2 words + 2 = 4 tokens


def words(msgs: list[Message]) -> int:
    """A counter: each word a token, and 2 tokens of template per message."""
    return sum(len(m.content.split()) + 2 for m in msgs)


def turns(*sizes: int) -> list[Message]:
    """user, assistant, user, … with these many words each."""
    return [Message("user" if i % 2 == 0 else "assistant", " ".join(["w"] * n)) for i, n in enumerate(sizes)]


def test_a_conversation_that_fits_is_sent_whole() -> None:
    c = TokenCounter(words, 1000)
    t = turns(10, 10, 10)
    out = fit(SYSTEM, t, c, max_tokens=200)
    assert out.messages == SYSTEM + t and out.left_out == 0 and out.tokens == 4 + 36


def test_the_oldest_exchanges_are_left_out_whole() -> None:
    c = TokenCounter(words, 1000)
    t = turns(300, 300, 100, 100, 50)  # 4 + 852 tokens: over 1000 - 200 (the reply's room)
    out = fit(SYSTEM, t, c, max_tokens=200)
    assert out.messages == SYSTEM + t[2:] and out.left_out == 2 and out.tokens == 4 + 256 <= 800
    assert out.messages[1].role == "user"  # what is sent starts with a question, not a reply
    # The reply's room is max_tokens, or a quarter of the context where that is less.
    assert fit(SYSTEM, t, c, max_tokens=5000).left_out == 2
    assert fit(SYSTEM, t, c, max_tokens=100).left_out == 0  # 856 <= 900


def test_the_newest_message_alone_is_sent_where_it_leaves_a_minimal_reply() -> None:
    c = TokenCounter(words, 1000)
    t = turns(100, 100, 900)
    out = fit(SYSTEM, t, c, max_tokens=500)
    assert out.messages == SYSTEM + t[2:] and out.left_out == 2 and out.tokens == 906


def test_a_message_that_cannot_fit_is_refused_with_the_reason() -> None:
    c = TokenCounter(words, 1000)
    big = 1000 - MIN_REPLY_TOKENS - 4 - 2 + 1  # one token too many with the system prompt
    with pytest.raises(DoesNotFit, match=r"takes 937 tokens .* holds 1,000 tokens"):
        fit(SYSTEM, turns(10, 10, big), c, max_tokens=100)
    assert refusal(SYSTEM, " ".join(["w"] * big), c) is not None
    assert refusal(SYSTEM, " ".join(["w"] * (big - 1)), c) is None
    assert refusal(SYSTEM, " ".join(["w"] * 5000), None) is None  # not measured: the engine decides
    estimated = TokenCounter(estimate, 100, estimated=True)
    assert "about " in (refusal([], "x" * 600, estimated) or "")


def test_measure_and_the_meter() -> None:
    c = TokenCounter(words, 1000)
    m = measure(SYSTEM, turns(300, 300, 100, 100), c, max_tokens=100)
    assert (m.tokens, m.left_out) == (4 + 808, 0)
    assert meter(m.tokens, 1000, 100, 0) == ("context 812 of 1,000 tokens — nearly full: the oldest messages will "
                                              "be left out", True)
    assert meter(500, 1000, 100, 0) == ("context 500 of 1,000 tokens", False)
    assert meter(650, 1000, 500, 0)[1]  # past 80 % of what is sent with room for a long reply (750)
    # The meter counts as the next reply sends: what it would leave out, it says.
    assert measure(SYSTEM, turns(300, 300, 100, 100), c, max_tokens=200).left_out == 2
    over = measure(SYSTEM, turns(600, 600, 100, 100), c, max_tokens=100)
    assert over.left_out == 2 and meter(over.tokens, 1000, 100, over.left_out) == (
        "context full: 2 earlier messages left out", True)


def test_the_remote_estimate_errs_long() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20  # ~200 tokens for most tokenizers
    assert estimate([Message("user", text)]) > 250
