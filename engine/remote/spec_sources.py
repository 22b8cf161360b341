"""Speculative-decoding figures of one remote reply, from whatever the server reports, best source first:

1. per-request `timings` (`draft_n`, `draft_n_accepted`: llama-server, Foretell's own server);
2. vLLM's per-request `metrics.speculative_decoding` (num_draft_tokens, num_accepted_tokens, num_drafts,
   num_accepted_tokens_per_pos), when the server adds it to the final chunk;
3. deltas of the Prometheus counters on `/metrics` around the request (`<prefix>spec_decode_num_*_total` for
   the prefixes vllm:, llamacpp:, foretell:) — server-wide: other clients' requests count too;
4. SGLang's gauges `sglang:spec_accept_rate` / `sglang:spec_accept_length` (server-wide, recent average);
5. SGLang's `/server_info` `avg_spec_accept_length` (server-wide).

Each result carries its `source` so the app and the CLI can say where a figure came from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from engine.events import SpeculativeStats

COUNTER_PREFIXES = ("vllm:", "llamacpp:", "foretell:")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_POSITION = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class Counters:
    """The speculative-decoding counters of one /metrics scrape, summed over label sets (engines, models)."""

    prefix: str
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)


def parse_prometheus(text: str) -> dict[str, list[tuple[str, float]]]:
    """Samples by metric name: (labels, value). Comments and malformed lines skipped."""
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((m.group(2) or "", value))
    return out


def counters(text: str | None) -> Counters | None:
    """The first prefix whose spec-decode counters are present, or None (no /metrics, or no speculation)."""
    if not text:
        return None
    samples = parse_prometheus(text)
    for p in COUNTER_PREFIXES:
        drafted = samples.get(f"{p}spec_decode_num_draft_tokens_total")
        if drafted is None:
            continue
        per_pos: dict[int, float] = {}
        for labels, v in samples.get(f"{p}spec_decode_num_accepted_tokens_per_pos_total", []):
            m = _POSITION.search(labels)
            if m:
                per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + v
        return Counters(p, drafts=_sum(samples, f"{p}spec_decode_num_drafts_total"),
                        draft_tokens=sum(v for _, v in drafted),
                        accepted=_sum(samples, f"{p}spec_decode_num_accepted_tokens_total"), per_pos=per_pos)
    return None


def _sum(samples: dict[str, list[tuple[str, float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, []))


def gauges(text: str | None) -> tuple[float, float] | None:
    """SGLang's (accept rate, accept length) gauges, or None when absent."""
    if not text:
        return None
    samples = parse_prometheus(text)
    rate, length = samples.get("sglang:spec_accept_rate"), samples.get("sglang:spec_accept_length")
    if not rate and not length:
        return None
    return (max(v for _, v in rate) if rate else 0.0, max(v for _, v in length) if length else 0.0)


def from_timings(timings: Any) -> SpeculativeStats | None:
    if not isinstance(timings, dict) or "draft_n" not in timings:
        return None
    drafted, accepted = int(timings.get("draft_n") or 0), int(timings.get("draft_n_accepted") or 0)
    if drafted <= 0:
        return None  # the server drafted nothing for this reply: no speculation to show
    return SpeculativeStats(drafted=drafted, accepted=accepted, acceptance=accepted / drafted, source="timings")


def from_request_metrics(metrics: Any) -> SpeculativeStats | None:
    """vLLM's per-request `metrics.speculative_decoding` (the same quantities as its Prometheus counters)."""
    sd = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(sd, dict):
        return None
    drafted, accepted = int(sd.get("num_draft_tokens") or 0), int(sd.get("num_accepted_tokens") or 0)
    if drafted <= 0:
        return None
    per_pos = [int(x) for x in sd.get("num_accepted_tokens_per_pos") or []]
    return _stats(drafted, accepted, int(sd.get("num_drafts") or 0), per_pos, "request metrics", server_wide=False)


def from_counter_delta(before: Counters | None, after: Counters | None) -> SpeculativeStats | None:
    if before is None or after is None or before.prefix != after.prefix:
        return None
    drafted = round(after.draft_tokens - before.draft_tokens)
    if drafted <= 0:
        return None
    accepted = round(after.accepted - before.accepted)
    n_pos = max(after.per_pos, default=-1) + 1
    per_pos = [round(after.per_pos.get(i, 0.0) - before.per_pos.get(i, 0.0)) for i in range(n_pos)]
    return _stats(drafted, accepted, round(after.drafts - before.drafts), per_pos, "/metrics", server_wide=True)


def with_depths(per_request: SpeculativeStats, delta: SpeculativeStats | None) -> SpeculativeStats:
    """Per-request totals, with acceptance by draft position from the /metrics delta when that delta is this
    request alone (its drafted and accepted counts equal the request's: no other client drafted meanwhile)."""
    if (delta is None or per_request.acceptance_by_depth or delta.drafted != per_request.drafted
            or delta.accepted != per_request.accepted):
        return per_request
    return replace(delta, source=f"{per_request.source} + /metrics", server_wide=False)


def from_gauges(g: tuple[float, float] | None) -> SpeculativeStats | None:
    if g is None or (g[0] <= 0 and g[1] <= 0):
        return None
    rate, length = g
    return SpeculativeStats(acceptance=rate, mean_accepted_length=length, source="sglang gauges", server_wide=True)


def from_server_info(info: Any) -> SpeculativeStats | None:
    """SGLang's /server_info: `avg_spec_accept_length` at the top or in its first `internal_states` entry."""
    if not isinstance(info, dict):
        return None
    length = info.get("avg_spec_accept_length")
    states = info.get("internal_states")
    if length is None and isinstance(states, list) and states and isinstance(states[0], dict):
        length = states[0].get("avg_spec_accept_length")
    if not isinstance(length, (int, float)) or isinstance(length, bool) or length <= 0:
        return None
    return SpeculativeStats(mean_accepted_length=float(length), source="/server_info", server_wide=True)


def _stats(drafted: int, accepted: int, drafts: int, per_pos: list[int], source: str, *,
           server_wide: bool) -> SpeculativeStats:
    """Counts in vLLM's sense: each draft proposes up to k tokens, so position i was tried `drafts` times."""
    by_depth = [n / drafts for n in per_pos] if drafts > 0 else []
    return SpeculativeStats(
        drafted=drafted, accepted=accepted, acceptance=accepted / drafted, acceptance_by_depth=by_depth,
        tried_by_depth=[drafts] * len(per_pos) if drafts > 0 else [], accepted_by_depth=per_pos,
        mean_accepted_length=1 + accepted / drafts if drafts > 0 else 0.0, verify_steps=drafts,
        source=source, server_wide=server_wide)
