"""Running a generation to its end in tests: no oracle imports here, so the GPU checks (tests/test_triton.py,
tests/test_step_graph.py) run where llama-cpp-python is not installed."""
from __future__ import annotations

from engine import consume
from engine.events import Done, GenerationConfig, Stats


def collect(eng, prompt, **kw) -> tuple[list[int], list[bool], Stats, Done]:  # type: ignore[no-untyped-def]
    """Token ids, whether each came from an accepted draft, the final Stats and Done of one `eng.generate`."""
    reply = consume.collect(eng.generate(prompt, GenerationConfig(**kw)))
    return reply.tokens, reply.accepted_draft, reply.final, reply.done


def plain_then_mtp(eng, prompt, draft, **kw) -> tuple[list[int], list[int], list[bool], Stats]:  # type: ignore[no-untyped-def]
    """One prompt decoded from a fresh cache without MTP, then with MTP at `draft` (None: auto): the plain tokens, the
    tokens with MTP, which of those came from accepted drafts, and the run with MTP's final Stats."""
    eng.reset()
    plain = collect(eng, prompt, mtp=False, **kw)[0]
    eng.reset()
    toks, accepted, final, _ = collect(eng, prompt, mtp=True, draft=draft, **kw)
    return plain, toks, accepted, final
