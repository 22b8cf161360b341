"""The MTP head as a drafter: its KV cache kept in step with the trunk, and chained drafts."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.cache import Cache
from engine.models.runner import HeadRunner
from engine.constrain import ReplyMatcher
from engine import ops
from engine.sampling import Sampler
from engine.events import MAX_DRAFT

CATCH_UP_CHUNK = 256
ROW_TIMING_MIN = 8  # catch-ups of at least this many rows time the head's pass per row


@dataclass
class Draft:
    tokens: list[int]
    probs: list[torch.Tensor | None]  # the draft distribution q_i each token was drawn from (None: greedy)
    catch_up_s: float = 0.0  # spent running the head over a long backlog (the prompt) before drafting
    confidence: list[float] = field(default_factory=list)  # each draft's top probability (where asked for)


class MTPDrafter:
    """Owns the MTP head's KV cache and keeps it in step with the trunk.

    Head position p holds the row (x_p, h_{p−1}). Rows for positions the trunk has processed are queued
    (`pending`) and run in one batch at the next draft, together with the first draft row; a prompt's rows
    are run with prefill (`catch_up`).
    """

    def __init__(self, head: HeadRunner, n_ctx: int):
        self.head = head
        self.cache: Cache = head.new_cache(n_ctx)
        d = head.hp.n_embd
        self.last_hidden = torch.zeros(d, device=head.trunk_device)  # h_{-1} = 0
        self.pending_tokens: list[int] = []
        self.pending_hidden: list[torch.Tensor] = []
        self._committed = 0  # head positions computed from true trunk hiddens
        self.row_s: float | None = None  # the head's pass over a backlog row, batched (seconds; learnt)
        self.restarts = 0  # catch-ups cut short by their budget (the head restarted on the latest rows)

    def reset(self) -> None:
        self.cache.reset()
        self.last_hidden.zero_()
        self.pending_tokens.clear()
        self.pending_hidden.clear()
        self._committed = 0

    def push(self, tokens: Sequence[int], hidden: torch.Tensor) -> None:
        """The trunk processed `tokens` and produced post-norm hidden rows `hidden` for them."""
        for i, t in enumerate(tokens):  # rows by index: iterating the tensor would unbind all its rows first
            self.pending_tokens.append(int(t))
            self.pending_hidden.append(self.last_hidden)
            self.last_hidden = hidden[i]

    def catch_up(self) -> None:
        """Run the head over the queued rows now, in chunks and without logits: the MTP head's share of processing
        a prompt (the engine calls it with prefill), or a backlog of steps decoded without drafting."""
        if not self.pending_tokens:
            return
        t0 = time.perf_counter()
        toks, hid = self.pending_tokens, torch.stack(self.pending_hidden)
        for s in range(0, len(toks), CATCH_UP_CHUNK):
            self.head.forward(toks[s:s + CATCH_UP_CHUNK], hid[s:s + CATCH_UP_CHUNK], self.cache, logit_rows="none")
        if len(toks) >= ROW_TIMING_MIN:
            per_row = (time.perf_counter() - t0) / len(toks)
            self.row_s = per_row if self.row_s is None else 0.8 * self.row_s + 0.2 * per_row
        self.pending_tokens, self.pending_hidden = [], []
        self._committed = self.cache.pos

    def _restart_within(self, budget_s: float) -> None:
        """Where catching up on the backlog would take longer than `budget_s`, start the head afresh on the latest
        rows it can afford (at least a draft's worth): its attention then sees those rows, not the whole context, and
        its drafts stay proposals the verify decides on. (A stretch of plain decoding leaves one row a step; on the
        embedded model the head's pass over them costs ~6 % of the steps, whatever the stretch.)"""
        if self.row_s is None or len(self.pending_tokens) * self.row_s <= budget_s:
            return
        keep = max(MAX_DRAFT + 1, int(budget_s / self.row_s))
        self.cache.reset()
        self.pending_tokens = self.pending_tokens[-keep:]
        self.pending_hidden = self.pending_hidden[-keep:]
        self.restarts += 1

    def draft(self, x: int, depth: int, sampler: Sampler, history: list[int], p_min: float = 0.0,
              matcher: ReplyMatcher | None = None, confidence: bool = False, budget_s: float | None = None) -> Draft:
        """Up to `depth` chained drafts following token x (emitted, not yet processed by the trunk);
        `history` is every token so far, ending with x (for the repetition penalty). A draft past the first whose top
        probability is below `p_min` ends the chain; `confidence` keeps every draft's top probability. Under a constraint (`matcher`,
        moved ahead over the chain and back) each draft is chosen from the head's masked row, so every draft is one
        the constraint allows: a JSON key or bracket it forces is drafted, and the verify can accept it. A backlog
        the head would take longer than `budget_s` to catch up on is cut to its latest rows (_restart_within)."""
        out = Draft([], [])
        if len(self.pending_tokens) > MAX_DRAFT + 1:  # a backlog (steps decoded without drafting): caught up on
            t0 = time.perf_counter()  # its own and timed apart, so auto's draft cost stays a step's drafts
            if budget_s is not None:
                self._restart_within(budget_s)
            self.catch_up()
            out.catch_up_s = time.perf_counter() - t0
        toks = self.pending_tokens + [x]
        hid = torch.stack(self.pending_hidden + [self.last_hidden])
        self.pending_tokens, self.pending_hidden = [], []
        # the rows the last verify kept, and the first draft row; draft logits: exact on the head's likely tokens
        res = self.head.forward(toks, hid, self.cache, logit_rows="draft")
        self._committed = self.cache.pos
        hist = list(history)
        try:
            for i in range(depth):
                logits = res.logits[-1]
                if sampler.cfg.greedy:
                    q = None
                    tok = _first_max(sampler.penalized(logits, hist)) if matcher is None else \
                        sampler.pick(logits, hist, matcher)
                else:
                    q = sampler.distribution(logits, hist, matcher)
                    tok = sampler.draw(q)
                if i > 0 and (p_min > 0 or confidence):  # an unconfident draft is more likely to cost than to pay
                    row = logits if matcher is None or matcher.free else ops.mask_logits(logits, matcher.bits())
                    conf = float(q.max()) if q is not None else float(torch.softmax(row.float(), -1).max())
                    if conf < p_min:
                        break
                    out.confidence.append(conf)
                elif confidence:
                    out.confidence.append(1.0)  # the first draft is never cut
                out.tokens.append(tok)
                out.probs.append(q)
                hist.append(tok)
                if matcher is not None:
                    matcher.ahead(tok)
                if i + 1 < depth and self.cache.pos < self.cache.n_ctx and not (matcher is not None and matcher.done):
                    res = self.head.forward([tok], res.hidden[-1:], self.cache, logit_rows="draft")
                else:
                    break
        finally:
            if matcher is not None:
                matcher.back()
        return out

    def commit(self, kept: int, tokens: Sequence[int], verify_hidden: torch.Tensor) -> None:
        """After a verify of [x, d1..dK]: the trunk kept x, d1..d_kept. Drop the chained rows and queue the
        true rows (d_j, h_{n+j−1}) for j = 1..kept; the next token pairs with h_{n+kept}."""
        self.cache.truncate(self._committed)
        self.last_hidden = verify_hidden[0]
        self.push(tokens[1:kept + 1], verify_hidden[1:kept + 1])


def _first_max(row: torch.Tensor) -> int:
    """torch.argmax's index of a logit row (a NaN counts as a maximum: a draft from such a row is simply rejected),
    through numpy where the row is a CPU float32 vector (a draft's ops run with the interpreter's caches cold)."""
    if row.is_cpu and row.dtype == torch.float32 and row.dim() == 1 and not row.requires_grad:
        return int(row.numpy().argmax())
    return int(torch.argmax(row))
