"""Acceptance of drafts (greedy and rejection sampling) and the speculative decoder (engine.decoding's step shape).

A step either decodes one token plainly, optionally drafting one token beside it as a shadow probe (the head's
guess compared with the trunk's own next token: acceptance learnt without a verify pass), or drafts K tokens,
verifies [x, d1..dK] in one trunk pass, emits the accepted prefix and the trunk's own token, and commits the kept
prefix (GDN state at the last kept position, attention KV and the head's KV truncated by length). Under a
constraint (engine.constrain) the drafts are drawn from the head's masked rows, so none is one the constraint forbids,
and acceptance reads every verify row masked, the matcher moved ahead over the drafts and back.
"""
from __future__ import annotations

import math
import time
from typing import Generator, Sequence

import torch

try:
    import resource
except ImportError:  # not on Windows: no fault counts there
    resource = None  # type: ignore[assignment]

from engine.constrain import ReplyMatcher
from engine.decoding import PlainDecoder, Reply, StepRows
from engine.events import Event
from engine.models.qwen35 import ForwardResult
from engine.sampling import Sampler
from engine.speculative.depth import DepthController, SpecStats
from engine.speculative.drafter import Draft, MTPDrafter


class SpeculativeDecoder:
    """One reply's speculative decoding over the plain decoder's seam (the runner, the cache, the advance callback):
    the depth controller picks each step's depth (0: a plain step)."""

    def __init__(self, plain: PlainDecoder, drafter: MTPDrafter, depth: DepthController, stats: SpecStats):
        self.plain, self.drafter, self.depth, self.stats = plain, drafter, depth, stats
        self.runner, self.cache, self.sampler = plain.runner, plain.cache, plain.sampler

    def step(self, x: int, run: Reply, room: int) -> Generator[Event, None, int]:
        """Decode after x (emitted, not yet processed by the trunk); returns the new last token, emitted."""
        if run.matcher is not None and (forced := self.plain.forced(x, run, room)) is not None:
            return (yield from self.plain.run(forced))
        k = self.depth.choose(room)
        if k == 0 and self.depth.quiet:  # the hot path of a plain stretch: no plan object
            t = time.perf_counter()
            res = self.runner.forward([x], self.cache, logit_rows="last")
            return (yield from self._quiet(x, run, res, time.perf_counter() - t))
        return (yield from self.plain.run(self._plan(x, run, room, k)))

    def plan(self, x: int, run: Reply, room: int) -> StepRows:
        """The step's rows for a pass shared with other sequences (engine.batch); drafts are made here. A constraint's
        forced tokens need no drafts: they run as a plain step's rows, the head told of them as of a plain step's."""
        if run.matcher is not None and (forced := self.plain.forced(x, run, room)) is not None:
            return forced
        k = self.depth.choose(room)
        if k == 0 and self.depth.quiet:
            return StepRows([x], False, lambda res, seconds: self._quiet(x, run, res, seconds))
        return self._plan(x, run, room, k)

    def _plan(self, x: int, run: Reply, room: int, k: int) -> StepRows:
        return self._plain(x, run, room) if k == 0 else self._speculative(x, k, run)

    def _plain(self, x: int, run: Reply, room: int) -> StepRows:
        sampler, spec, depth = self.sampler, self.stats, self.depth
        probe, probe_s, probe_faulted = None, 0.0, False
        if depth.probe_now(room):  # shadow probe: one draft, no verify
            t_probe, f_probe = time.perf_counter(), major_faults()
            probe = self.drafter.draft(x, 1, sampler, run.history, matcher=run.matcher,
                                       budget_s=depth.catch_up_budget())
            probe_s, probe_faulted = time.perf_counter() - t_probe, major_faults() > f_probe
            spec.draft_s += probe_s

        def finish(res: ForwardResult, pass_s: float) -> Generator[Event, None, int]:
            t = time.perf_counter()
            # after a probe the head already holds x's row: keep it, pair the next token with the trunk's row
            nxt, logits = self.plain.settle([x], run, res, self._after_probe if probe is not None else None)
            dt = pass_s + time.perf_counter() - t
            spec.plain_steps += 1
            spec.decode_s += dt
            depth.observe_decode(dt)
            if probe is not None and probe.tokens:
                q = probe.probs[0]
                hit = float(probe.tokens[0] == nxt) if q is None else \
                    float(torch.minimum(sampler.distribution(logits, run.history, run.matcher), q).sum())
                depth.observe_probe(hit, probe_s - probe.catch_up_s, probe_faulted)
            yield from run.emit([(nxt, False)], logits)
            return nxt
        return StepRows([x], False, finish)

    def _quiet(self, x: int, run: Reply, res: ForwardResult, pass_s: float) -> Generator[Event, None, int]:
        """A plain step with nothing to weigh: only its time is recorded."""
        t = time.perf_counter()
        nxt, logits = self.plain.settle([x], run, res)
        dt = pass_s + time.perf_counter() - t
        self.stats.plain_steps += 1
        self.stats.decode_s += dt
        self.depth.observe_decode(dt)
        yield from run.emit([(nxt, False)], logits)
        return nxt

    def _after_probe(self, tokens: Sequence[int], hidden: torch.Tensor) -> None:
        self.drafter.commit(0, tokens, hidden)

    def _speculative(self, x: int, k: int, run: Reply) -> StepRows:
        """Draft k tokens after x; the pass verifies [x, d1..dk]; its end emits and commits the kept prefix."""
        sampler, spec, depth, cache = self.sampler, self.stats, self.depth, self.cache
        cost_only = depth.cost_only
        t0, f0 = time.perf_counter(), major_faults()
        if cost_only:  # a stand-in draft (x again): the pass costs what a verify of two rows costs, the head sleeps
            draft = Draft([x], [None if sampler.cfg.greedy else _one_hot(x, self.runner.hp.n_vocab)])
        else:
            cut = depth.chain_p_min(k)
            draft = self.drafter.draft(x, k, sampler, run.history, cut, run.matcher, confidence=depth.learns_cut,
                                       budget_s=depth.catch_up_budget())
        draft_s, faulted = time.perf_counter() - t0, major_faults() > f0
        pos0 = cache.pos
        seq = [x] + draft.tokens

        def finish(res: ForwardResult, pass_s: float) -> Generator[Event, None, int]:
            t1 = time.perf_counter()
            # run.history ends with x: it was emitted by the previous step
            if sampler.cfg.greedy:
                n_acc, nxt = accept_greedy(res.logits, draft.tokens, sampler, run.history,  # type: ignore[arg-type]
                                           run.matcher)
            else:
                n_acc, nxt = accept_sampling(res.logits, draft, sampler, run.history,  # type: ignore[arg-type]
                                             run.matcher)
            t_acc = time.perf_counter()
            emitted = [(d, not cost_only) for d in draft.tokens[:n_acc]] + [(nxt, False)]  # a stand-in is no draft
            n_out = len(run.out_ids)
            kept = 0
            try:
                kept = yield from run.emit(emitted, res.logits)  # row i: what emitted token i was chosen from
            finally:  # also when the consumer abandons the reply mid-window: commit exactly what it was given
                kept = kept or max(len(run.out_ids) - n_out, 1)
                t3 = time.perf_counter()
                c = kept - 1  # drafts whose effect stays in the trunk; the last kept token is not yet processed
                cache.commit(res.captured, c)  # type: ignore[arg-type]
                cache.truncate(pos0 + c + 1)
                if cost_only:  # the head never saw the pass: the kept rows join its backlog, as a plain step's do
                    self.drafter.push(seq[:c + 1], res.hidden)
                else:
                    self.drafter.commit(c, seq, res.hidden)
                self.plain.advance(seq[:c + 1], res.logits[c])  # type: ignore[index]
            t4 = time.perf_counter()
            if not cost_only:  # a stand-in's fate says nothing of the head's acceptance
                spec.record(len(draft.tokens), n_acc)
                depth.observe_chain(draft.confidence, n_acc)
            spec.draft_s += draft_s
            spec.verify_s += pass_s
            spec.commit_s += t4 - t3
            # auto weighs a verify step as all it costs beside the drafts: the pass, acceptance and the commit (a plain
            # step's measured time holds its sampling and bookkeeping likewise); the consumer's time in emit is not ours
            depth.observe_verify(len(seq), pass_s + (t_acc - t1) + (t4 - t3), 0 if cost_only else len(draft.tokens),
                                 draft_s - draft.catch_up_s, faulted)
            return emitted[kept - 1][0]
        return StepRows(seq, True, finish)


def _one_hot(token: int, n_vocab: int) -> torch.Tensor:
    """The distribution of a draft chosen without a model: all its mass on the token (rejection sampling against it
    keeps the emitted tokens distributed as plain sampling)."""
    q = torch.zeros(n_vocab)
    q[token] = 1.0
    return q


def major_faults() -> int:
    """Page faults this process waited on the disk for, so far (0 where the system does not count them): a draft
    that took some ran on weights the page cache had dropped, a cost that drafting often does not pay again."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt if resource is not None else 0


def accept_greedy(target_logits: torch.Tensor, drafts: Sequence[int], sampler: Sampler,
                  history: list[int], matcher: ReplyMatcher | None = None) -> tuple[int, int]:
    """(number of drafts accepted, the trunk's own next token) — the longest matching prefix; under a constraint
    each row's choice is the masked one (the drafts are ones it allows)."""
    hist = list(history)
    try:
        for i, d in enumerate(drafts):
            t = sampler.pick(target_logits[i], hist, matcher)
            if t != d:
                return i, t
            hist.append(d)
            if matcher is not None:
                matcher.ahead(d)
        return len(drafts), sampler.pick(target_logits[len(drafts)], hist, matcher)
    finally:
        if matcher is not None:
            matcher.back()


def accept_sampling(target_logits: torch.Tensor, draft: Draft, sampler: Sampler,
                    history: list[int], matcher: ReplyMatcher | None = None) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.): accept d_i with probability
    min(1, p_i(d_i)/q_i(d_i)); on rejection draw from normalise(max(0, p_i − q_i)); after K acceptances
    draw the bonus token from p_{K+1}. The emitted tokens are distributed exactly as plain sampling (under a
    constraint, p and q both masked: as plain masked sampling)."""
    hist = list(history)
    try:
        for i, (d, q) in enumerate(zip(draft.tokens, draft.probs)):
            p = sampler.distribution(target_logits[i], hist, matcher)
            assert q is not None
            if sampler.uniform() * float(q[d]) < float(p[d]):  # u < p/q without dividing by a tiny q
                hist.append(d)
                if matcher is not None:
                    matcher.ahead(d)
                continue
            residual = torch.clamp(p - q, min=0.0)
            total = float(residual.sum())
            tok = sampler.draw(residual / total) if total > 0 and math.isfinite(total) else sampler.draw(p)
            return i, tok
        return len(draft.tokens), sampler.draw(sampler.distribution(target_logits[len(draft.tokens)], hist, matcher))
    finally:
        if matcher is not None:
            matcher.back()
