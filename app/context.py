"""What of a conversation goes to the engine when it does not all fit the context (no Qt here).

The oldest exchanges are left out first — whole exchanges, so what is sent starts with a user message — until
the prompt leaves room for a reply; the system prompt and the newest message always stay. A message that does
not fit even alone (with the system prompt and a minimal reply) is refused: it is never stored, so it cannot
break every later reply. A local engine counts with its own tokenizer and chat template; a remote one is
estimated from the text's length where its server says its context, and not fitted where it does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from engine.chat import Message

MIN_REPLY_TOKENS = 64  # a message is refused when it leaves less room than this for the reply
REPLY_SHARE = 4  # the fitted prompt leaves room for max_tokens, or a quarter of the context where that is less
CHARS_PER_TOKEN = 3  # a remote engine's estimate: fewer characters a token than most tokenizers, so it errs long
ESTIMATE_OVERHEAD = 8  # tokens of template around each message, in the estimate
WARN_SHARE = 0.8  # the context meter warns past this share of the prompt budget (`budget`)


class DoesNotFit(ValueError):
    """The newest message does not fit the context even alone; the text says so in plain words."""


@dataclass(frozen=True)
class TokenCounter:
    """How many tokens a list of messages takes as a prompt, and the context it must fit."""

    count: Callable[[list[Message]], int]
    context: int
    estimated: bool = False  # counted from the text's length (a remote engine), not the model's tokenizer


def estimate(msgs: list[Message]) -> int:
    """A remote engine's prompt length from its text (its tokenizer is on the server)."""
    return sum(len(m.content) // CHARS_PER_TOKEN + ESTIMATE_OVERHEAD for m in msgs)


@dataclass(frozen=True)
class Fit:
    messages: list[Message]  # what is sent: the system prompt, then the newest turns
    tokens: int  # their prompt length (an estimate where the counter is one)
    left_out: int  # how many of the oldest messages were left out


def _trim(system: list[Message], turns: list[Message], counter: TokenCounter, target: int) -> Fit:
    """The latest start of `turns` at a user message (or the last turn) whose prompt is at most `target` tokens,
    or the last such start where none is."""
    whole = counter.count(system + turns)
    if whole <= target:
        return Fit(system + turns, whole, 0)
    # Candidate starts: each later user message; the count falls as the start moves later (bisect the first fit).
    starts = [i for i, m in enumerate(turns) if m.role == "user" and i > 0] or [len(turns) - 1]
    lo, hi = 0, len(starts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if counter.count(system + turns[starts[mid]:]) <= target:
            hi = mid
        else:
            lo = mid + 1
    kept = system + turns[starts[lo]:]
    return Fit(kept, counter.count(kept), starts[lo])


def budget(context: int, max_tokens: int) -> int:
    """The most prompt tokens sent: the context less room for a reply of max_tokens (a quarter at most)."""
    return context - min(max_tokens, context // REPLY_SHARE)


def fit(system: list[Message], turns: Sequence[Message], counter: TokenCounter, max_tokens: int) -> Fit:
    """The newest turns of `turns` (which ends with the message to answer) that fit `counter.context` with
    room for a reply; DoesNotFit when the last turn alone does not."""
    out = _trim(system, list(turns), counter, budget(counter.context, max_tokens))
    if out.tokens > counter.context - MIN_REPLY_TOKENS:
        raise DoesNotFit(too_long(out.tokens, counter))
    return out


def measure(system: list[Message], turns: Sequence[Message], counter: TokenCounter, max_tokens: int) -> Fit:
    """How much of the prompt budget the conversation `turns` takes, and how many of its oldest messages the next
    reply would be sent without."""
    return _trim(system, list(turns), counter, budget(counter.context, max_tokens))


def refusal(system: list[Message], text: str, counter: TokenCounter | None) -> str | None:
    """Why the message `text` cannot be sent (it does not fit alone), or None when it can."""
    if counter is None:
        return None
    n = counter.count(system + [Message("user", text)])
    return too_long(n, counter) if n > counter.context - MIN_REPLY_TOKENS else None


def too_long(n: int, counter: TokenCounter) -> str:
    about = "about " if counter.estimated else ""
    return (f"This message takes {about}{n:,} tokens with the system prompt, but the model's context holds "
            f"{counter.context:,} tokens, and a reply needs room too. Shorten it, split it over several messages, "
            f"or raise the context length in Settings (it applies when the model is next loaded).")


def meter(tokens: int, context: int, max_tokens: int, left_out: int) -> tuple[str, bool]:
    """The status bar's context text for a conversation of `tokens`, and whether it warns: past WARN_SHARE of the
    prompt budget (the context less the reply's room), and once messages are left out."""
    if left_out:
        return (f"context full: {left_out} earlier message{'s' if left_out > 1 else ''} left out", True)
    warn = tokens >= WARN_SHARE * budget(context, max_tokens)
    note = " — nearly full: the oldest messages will be left out" if warn else ""
    return f"context {tokens:,} of {context:,} tokens{note}", warn
