"""Server counters in Prometheus' text format, named like vLLM's (`vllm:` → `foretell:`) so dashboards built
for vLLM's speculative-decoding metrics read these too. Updated from the generation thread, read from the
event loop: one lock around both."""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from engine.events import Stats

PREFIX = "foretell:"


@dataclass
class ServerMetrics:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_drafts: int = 0  # verify passes that checked a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # index 0 = the first drafted position
    finished: Counter = field(default_factory=Counter)  # by finish reason: stop, length, abort, error
    rejected: int = 0  # refused at once: the queue was full
    running: int = 0
    waiting: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_generation(self, st: Stats, finish: str) -> None:
        """One generation ended (its final stats): its tokens and speculation join the totals."""
        with self._lock:
            self.prompt_tokens += st.prompt_tokens
            self.generation_tokens += st.generated_tokens
            self.finished[finish] += 1
            spec = st.speculative
            if spec is None:
                return
            self.num_drafts += spec.verify_steps
            self.num_draft_tokens += spec.drafted
            self.num_accepted_tokens += spec.accepted
            per_pos = spec.accepted_by_depth
            if len(self.accepted_per_pos) < len(per_pos):
                self.accepted_per_pos += [0] * (len(per_pos) - len(self.accepted_per_pos))
            for i, n in enumerate(per_pos):
                self.accepted_per_pos[i] += n

    def add_failure(self, finish: str) -> None:
        with self._lock:
            self.finished[finish] += 1

    def adjust(self, *, running: int = 0, waiting: int = 0, rejected: int = 0) -> None:
        with self._lock:
            self.running += running
            self.waiting += waiting
            self.rejected += rejected

    @property
    def requests_finished(self) -> int:
        with self._lock:
            return sum(self.finished.values())

    def render(self) -> str:
        with self._lock:
            rows: list[tuple[str, str, str, list[tuple[str, int]]]] = [
                ("num_requests_running", "gauge", "Requests generating now.", [("", self.running)]),
                ("num_requests_waiting", "gauge", "Requests waiting in the queue.", [("", self.waiting)]),
                ("num_requests_rejected_total", "counter", "Requests refused with 429: the queue was full.",
                 [("", self.rejected)]),
                ("request_success_total", "counter", "Finished requests by finish reason.",
                 [(f'{{finished_reason="{k}"}}', v) for k, v in sorted(self.finished.items())]),
                ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)]),
                ("generation_tokens_total", "counter", "Generated tokens.", [("", self.generation_tokens)]),
                ("spec_decode_num_drafts_total", "counter", "MTP verify passes that checked a draft.",
                 [("", self.num_drafts)]),
                ("spec_decode_num_draft_tokens_total", "counter", "MTP draft tokens proposed.",
                 [("", self.num_draft_tokens)]),
                ("spec_decode_num_accepted_tokens_total", "counter", "MTP draft tokens accepted.",
                 [("", self.num_accepted_tokens)]),
                ("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                 "MTP draft tokens accepted, by draft position (0 = the first).",
                 [(f'{{position="{i}"}}', n) for i, n in enumerate(self.accepted_per_pos)]),
            ]
        lines = []
        for name, kind, help_text, samples in rows:
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
            lines += [f"{PREFIX}{name}{labels} {value}" for labels, value in samples]
        return "\n".join(lines) + "\n"
