"""Reading one reply's events into its result: what the command lines (a local and a remote engine's), the tests
and the benchmarks take from `generate(...)`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

from engine.errors import ContextOverflowError, EngineError
from engine.events import Done, Event, Stats, Token
from engine.output import emit


@dataclass(frozen=True)
class Collected:
    """One whole reply: token ids, whether each came from an accepted draft, the text, its final Stats and Done."""

    tokens: list[int]
    accepted_draft: list[bool]
    text: str
    final: Stats
    done: Done


def collect(events: Iterable[Event], echo: bool = False) -> Collected:
    """The reply `events` stream; its text is echoed to stdout as it comes when `echo`. A prompt over the context
    is a ContextOverflowError with the engine's message."""
    tokens: list[int] = []
    flags: list[bool] = []
    pieces: list[str] = []
    final: Stats | None = None
    done: Done | None = None
    for ev in events:
        if isinstance(ev, Token):
            tokens += ev.ids
            flags += [ev.accepted_draft] * len(ev.ids)
            pieces.append(ev.text)
            if echo:
                emit(ev.text, end="", flush=True)
        elif isinstance(ev, Stats) and ev.final:
            final = ev
        elif isinstance(ev, Done):
            done = ev
    if done is not None and done.reason == "context_overflow":  # the prompt did not fit: no Stats come with it
        raise ContextOverflowError(done.message)
    if done is None or final is None:
        raise EngineError("generation ended without a result")
    return Collected(tokens, flags, "".join(pieces), final, done)


def reply_stats(final: Stats, done: Done) -> dict[str, Any]:
    """The `stats` object of `generate --json` (the contract in docs/DESIGN.md)."""
    stats: dict[str, Any] = {
        "prompt_tokens": final.prompt_tokens, "generated_tokens": final.generated_tokens,
        "ttft_s": final.ttft_s, "prefill_tok_s": final.prefill_tok_s, "decode_tok_s": final.decode_tok_s,
        "elapsed_s": final.elapsed_s, "cache_bytes": final.cache_bytes, "state_bytes": final.state_bytes,
        "stop_reason": done.reason, "mtp": final.mtp,
    }
    if final.speculative:
        stats.update(dataclasses.asdict(final.speculative))
    return stats
