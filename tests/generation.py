"""Running a generation to its end in tests: no oracle imports here, so the GPU checks (tests/test_triton.py,
tests/test_step_graph.py) run where llama-cpp-python is not installed."""
from __future__ import annotations

from engine.events import Done, GenerationConfig, Stats, Token


def collect(eng, prompt, **kw) -> tuple[list[int], list[bool], Stats, Done]:  # type: ignore[no-untyped-def]
    """Token ids, whether each came from an accepted draft, the final Stats and Done of one `eng.generate`."""
    toks, flags, final, done = [], [], None, None
    for ev in eng.generate(prompt, GenerationConfig(**kw)):
        if isinstance(ev, Token):
            toks += ev.ids
            flags += [ev.accepted_draft] * len(ev.ids)
        elif isinstance(ev, Stats) and ev.final:
            final = ev
        elif isinstance(ev, Done):
            done = ev
    return toks, flags, final, done
