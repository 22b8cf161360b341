"""Several sequences decoded together (the server's parallel requests, `serve --parallel N`).

A `Batch` holds up to N slots over one loaded `Engine`'s runner, each with its own sequence state: the trunk's cache
(attention KV, GDN conv and recurrent states) and the MTP head's, and the tokens in them, kept after a reply so that a
request extending a slot's sequence (the next turn of a chat) prefills only its new tokens. Each `step()` runs a
prompt chunk of every sequence still prefilling, then one decode step of every sequence under way: alone, a sequence
steps with its own decoder (MTP where the request asks for it); several step together in one pass over their rows
(`Runner.forward_many`: the weights read once for all rows, each sequence's attention or recurrence over its own
state): each its last token, and where its request asks for MTP, the drafts its own depth controller chose to verify
(its decoder's `plan`: a verify for one sequence and a plain step for another share one read of the weights; where
the runner cannot capture a verify's states in the shared pass, `Runner.shares_verify`, the sequences step plain
together). Sequences join and leave between steps. Every op is batch-invariant, so a sequence's logits, and its greedy
tokens, are those of its run alone.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.cache import Cache, CapturedStates
from engine.decoding import Decoder, PlainDecoder, Reply, StepRows
from engine.events import Done, Event, GenerationConfig, Progress, Stats, Token
from engine.generate import PREFILL_CHUNK, Engine
from engine.models.qwen35 import ForwardResult
from engine.sampling import Sampler
from engine.speculative import AutoMemory, DepthController, MTPDrafter, SpecStats, SpeculativeDecoder
from engine.validate import validate_generation


@dataclass
class Slot:
    """One sequence's state: the trunk's cache, the MTP head's (None: the model has none), the tokens in them and the
    logits after the last."""

    cache: Cache
    drafter: MTPDrafter | None
    seq: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None

    def advance(self, tokens: list[int], logits: torch.Tensor) -> None:
        self.seq.extend(tokens)
        self.last_logits = logits

    def keep_head(self, tokens: list[int], hidden: torch.Tensor) -> None:
        if self.drafter is not None:
            self.drafter.push(tokens, hidden)

    def common(self, ids: list[int]) -> int:
        """How many of `ids` this slot's state holds already: all of its sequence where `ids` extends it, else 0."""
        n = len(self.seq)
        return n if n and n <= len(ids) and ids[:n] == self.seq else 0

    def consistent(self) -> bool:
        d = self.drafter
        return self.cache.pos == len(self.seq) and (d is None or d.cache.pos + len(d.pending_tokens) == len(self.seq))

    def reset(self) -> None:
        self.cache.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self.seq, self.last_logits = [], None


class Sequence:
    """One request in a batch: its prompt's prefill, then its reply, in the slot it was given."""

    def __init__(self, engine: Engine, slot: Slot, prompt: list[int], gen: GenerationConfig,
                 stop: threading.Event | None, memory: AutoMemory):
        self.engine, self.slot, self.prompt, self.gen, self.stop = engine, slot, prompt, gen, stop
        self.t0 = time.perf_counter()
        self.sampler = Sampler(gen.sampling)
        self.spec = SpecStats()
        self.use_mtp = gen.mtp and slot.drafter is not None
        reproducible = not gen.sampling.greedy and gen.sampling.seed is not None
        self.depth = DepthController(gen.draft, self.spec, p_min=gen.p_min, reproducible=reproducible,
                                     memory=memory) if self.use_mtp else None
        self.plain = PlainDecoder(engine.runner, slot.cache, slot.advance, self.sampler, slot.keep_head)
        self.decoder: Decoder = SpeculativeDecoder(self.plain, slot.drafter, self.depth, self.spec) \
            if self.depth is not None and slot.drafter is not None else self.plain
        self.reply = Reply(prompt, gen, engine.tokenizer)
        common = slot.common(prompt)
        if common == len(prompt) and slot.last_logits is None or common == 0:
            slot.reset()
            common = 0
        self.todo = prompt[common:]  # prompt tokens not yet in the cache
        self.n_prefill = len(self.todo)
        self.prefilling = True  # until the first token
        self.x = -1  # the last emitted token, not yet run by the trunk (once decoding)
        self.t_prefill = self.t_stats = 0.0

    def prefill_chunk(self) -> Iterator[Event]:
        """The next chunk of the prompt; after the last, the first token."""
        if self.stop is not None and self.stop.is_set():
            self.slot.reset()
            self.reply.reason = "stopped"
            self.prefilling = False
            return
        chunk, self.todo = self.todo[:PREFILL_CHUNK], self.todo[PREFILL_CHUNK:]
        if chunk:
            runner, slot = self.engine.runner, self.slot
            res = runner.forward(chunk, slot.cache, logit_rows="last",
                                 chunked=len(chunk) > 1 and not runner.sequential_prefill)
            slot.keep_head(chunk, res.hidden)
            slot.advance(chunk, res.logits[-1])  # type: ignore[index]
            if self.n_prefill > PREFILL_CHUNK:
                yield Progress(self.n_prefill - len(self.todo), self.n_prefill)
        if self.todo:
            return
        self.prefilling = False
        if self.use_mtp and self.depth.head_at_prefill():  # the head's pass over the prompt: prompt processing too
            self.slot.drafter.catch_up()  # type: ignore[union-attr]
        self.t_prefill = self.t_stats = time.perf_counter()
        logits = self.slot.last_logits
        self.x = self.sampler.sample(logits, self.reply.history, self.reply.matcher)  # type: ignore[arg-type]
        yield from self.reply.emit([(self.x, False)], logits)

    def ready(self) -> bool:
        """Whether a decode step may run (else the reply ends: stopped, or the context is full)."""
        if self.stop is not None and self.stop.is_set():
            self.reply.reason = "stopped"
        elif self.slot.cache.pos >= self.engine.n_ctx:
            self.reply.reason = "context_full"
        return self.reply.reason is None

    def step(self) -> Iterator[Event]:
        """A decode step alone: the sequence's own decoder (MTP where asked)."""
        self.x = yield from self.decoder.step(self.x, self.reply, self.room)
        yield from self.tick()

    @property
    def room(self) -> int:
        """Free positions in the context after the next token (what a step's depth may use)."""
        return self.engine.n_ctx - self.slot.cache.pos - 1

    @property
    def reproducible(self) -> bool:
        """Seeded sampling with MTP: its steps' depths (and so its draws) must not depend on timings, nor on the
        other sequences (VerifyChoice)."""
        return self.depth is not None and self.depth.reproducible

    def plan(self, verify: bool) -> StepRows:
        """A decode step's rows for a pass with other sequences: its decoder's (drafts to verify among them, where
        `verify` or the sequence is `reproducible`), else x alone."""
        decoder = self.decoder if verify or self.reproducible else self.plain
        return decoder.plan(self.x, self.reply, self.room)

    def stepped(self, rows: StepRows, res: ForwardResult, seconds: float) -> Iterator[Event]:
        """The end of a decode step run with other sequences: `res` holds its rows' hidden states and logits (and
        captured states), the shared pass took `seconds`."""
        self.x = yield from rows.finish(res, seconds)
        yield from self.tick()

    def tick(self) -> Iterator[Event]:
        if time.perf_counter() - self.t_stats >= self.gen.stats_interval_s:
            self.t_stats = time.perf_counter()
            yield self.stats()

    def end(self) -> Iterator[Event]:
        """The reply's last events; the slot keeps the sequence for a request that extends it."""
        if self.reply.reason == "stopped" and not self.reply.out_ids:  # stopped in the prompt
            yield Done("stopped")
            return
        yield from self.reply.tail()
        if self.depth is not None:
            self.depth.remember()
        if not self.slot.consistent():
            self.slot.reset()
        yield self.stats(final=True)
        reason = self.reply.reason or "max_tokens"
        yield Done(reason, f"the context of {self.engine.n_ctx} tokens is full" if reason == "context_full" else "")

    def stats(self, final: bool = False) -> Stats:
        now, run, model = time.perf_counter(), self.reply, self.engine.model
        t_first = run.t_first or now
        decode_n = max(len(run.out_ids) - 1, 0)
        return Stats(
            prompt_tokens=len(self.prompt), prefill_tokens=self.n_prefill, generated_tokens=len(run.out_ids),
            ttft_s=t_first - self.t0, prefill_tok_s=self.n_prefill / max(self.t_prefill - self.t0, 1e-9),
            decode_tok_s=decode_n / max(now - t_first, 1e-9) if decode_n else 0.0, elapsed_s=now - self.t0,
            cache_bytes=self.slot.cache.nbytes, state_bytes=self.slot.cache.state_nbytes, final=final,
            mtp=self.use_mtp, speculative=self.spec.snapshot() if self.use_mtp else None,
            expert_usage={il: c.tolist() for il, c in model.routing.counts.items()} or None,
            expert_cache={il: {**c.stats.as_dict(), "capacity": c.capacity, "occupancy": len(c.lru)}
                          for il, c in model.expert_caches.items()} or None)


class VerifyChoice:
    """Whether sequences stepping together verify drafts among their rows (each sequence's depth controller choosing
    its depth) or step plain, per number of sequences k: the batch's own tokens per second (every token emitted over
    the steps' time, drafts included) decide, not each controller's view of its share. Batching already shares the
    weights' reads that speculation saves, and a controller cannot see the other sequences' drafts it waits for: on
    this project's CPU benchmarks at 2 and 4 sequences, verifying every step ran at 0.52-1.03x of plain
    (bench/results/batch_mtp.json).
    So plain runs first; every EVERY-th window of WINDOW batched steps tries the other form, and the faster (median
    of its last windows) runs; a retry that finds the other form still slower doubles the wait (up to EVERY_MAX)."""

    WINDOW, EVERY, EVERY_MAX = 8, 16, 256

    def __init__(self) -> None:
        self.rates: dict[tuple[int, bool], deque] = {}
        self.windows: dict[int, int] = {}
        self.every: dict[int, int] = {}
        self._now: dict[int, list] = {}  # k -> [form, steps, tokens, seconds, retry] of the window under way

    def verify(self, k: int) -> bool:
        """The form of k sequences' next step."""
        now = self._now.get(k)
        if now is None:
            n = self.windows[k] = self.windows.get(k, 0) + 1
            v, o = (self.rates.setdefault((k, form), deque(maxlen=4)) for form in (True, False))
            form = bool(v) and bool(o) and statistics.median(v) > statistics.median(o)
            retry = n % self.every.get(k, self.EVERY) == 0
            now = self._now[k] = [form != retry, 0, 0, 0.0, retry]
        return now[0]

    def observe(self, k: int, tokens: int, seconds: float) -> None:
        """A step of k sequences in the form `verify(k)` gave: its emitted tokens and seconds."""
        now = self._now[k]
        now[1] += 1
        now[2] += tokens
        now[3] += seconds
        if now[1] < self.WINDOW:
            return
        form, _, toks, secs, retry = self._now.pop(k)
        rate = toks / max(secs, 1e-9)
        if retry:
            other = self.rates[(k, not form)]
            slower = bool(other) and rate < statistics.median(other)
            self.every[k] = min(2 * self.every.get(k, self.EVERY), self.EVERY_MAX) if slower else self.EVERY
        self.rates[(k, form)].append(rate)


class Batch:
    """Up to `size` sequences over one engine's runner, stepped together (see the module docstring). Not thread-safe:
    one thread adds and steps; the caller keeps other users of the engine's runner out meanwhile."""

    def __init__(self, engine: Engine, size: int, verify: bool | None = None):
        """`verify`: whether sequences stepping together verify their drafts among the rows (None: as VerifyChoice
        measures; True: always, where each controller drafts; False: never)."""
        if size < 1:
            raise ValueError(f"a batch holds at least one sequence, not {size}")
        self.engine, self.size = engine, size
        self.slots: list[Slot] = []  # made when first needed
        self.active: list[Sequence] = []
        self.memory = AutoMemory()  # draft-depth costs and acceptance, carried across replies
        self.batched_steps = 0  # decode steps that ran several sequences in one pass
        self.shared_verifies = 0  # ... with a sequence's drafts verified among the rows
        self.verify_choice = VerifyChoice()
        self.verify = verify

    @property
    def full(self) -> bool:
        return len(self.active) >= self.size

    def add(self, prompt: list[int], gen: GenerationConfig, stop: threading.Event | None = None) -> Sequence:
        """Start a reply to the token ids `prompt` (checked: not empty, shorter than the context) in the free slot whose
        sequence it extends furthest (the least recently used where none), or a new one where none is free; its events
        come from `step`."""
        validate_generation(gen)
        if self.full:
            raise ValueError(f"the batch already holds {self.size} sequences")
        if not prompt or len(prompt) >= self.engine.n_ctx:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit a context of {self.engine.n_ctx}")
        busy = {id(s.slot) for s in self.active}
        free = [s for s in self.slots if id(s) not in busy]
        slot = max(free, key=lambda s: s.common(prompt)) if free else self._slot()  # slots: as many as ran at once
        seq = Sequence(self.engine, slot, list(prompt), gen, stop, self.memory)
        self.active.append(seq)
        return seq

    def _slot(self) -> Slot:
        eng = self.engine
        mtp = eng.runner.mtp
        slot = Slot(eng.runner.new_cache(eng.n_ctx), MTPDrafter(mtp, eng.n_ctx) if mtp is not None else None)
        self.slots.append(slot)
        return slot

    def step(self) -> Iterator[tuple[Sequence, Event | Exception]]:
        """One round: a prompt chunk of each sequence prefilling, one decode step of each decoding (together where
        there are several); each event with its sequence. A sequence whose work raised gets the exception instead of
        an event and leaves the batch (its slot reset); one that ended leaves after its Done."""
        for s in [s for s in self.active if s.prefilling]:
            yield from self._guarded(s, lambda s=s: s.prefill_chunk())
        going = [s for s in self.active if not s.prefilling and s.reply.reason is None and s.ready()]
        if len(going) == 1:
            yield from self._guarded(going[0], going[0].step)
        elif going:
            yield from self._together(going)
        for s in [s for s in self.active if s.reply.reason is not None]:
            yield from self._guarded(s, s.end)
            if s in self.active:
                self._leave(s)

    def _together(self, going: list[Sequence]) -> Iterator[tuple[Sequence, Event | Exception]]:
        """One decode step of each sequence in one pass over all their rows: x alone, or x and the drafts a sequence's
        own depth controller chose to verify (where the runner verifies within the shared pass)."""
        runner, planned = self.engine.runner, []
        t_step = time.perf_counter()
        choose = runner.shares_verify and self.verify is None and any(s.use_mtp and not s.reproducible for s in going)
        verify = self.verify_choice.verify(len(going)) if choose else bool(self.verify) and runner.shares_verify
        for s in going:
            try:
                planned.append((s, s.plan(verify)))
            except Exception as e:  # its draft failed: it leaves, the others step
                yield from self._fail(s, e)
        if not planned:
            return
        caps = [CapturedStates({}, {}) if rows.capture else None for _, rows in planned]
        verifying = any(c is not None for c in caps)  # a verify among them: every row's logits
        t0 = time.perf_counter()
        try:
            res = runner.forward_many([rows.tokens for _, rows in planned], [s.slot.cache for s, _ in planned],
                                      caps if verifying else None, all_rows=verifying)
        except Exception as e:  # the pass failed for all of them
            for s, _ in planned:
                yield from self._fail(s, e)
            return
        seconds = time.perf_counter() - t0
        self.batched_steps += 1
        self.shared_verifies += verifying
        start, emitted = 0, 0
        for i, ((s, rows), cap) in enumerate(zip(planned, caps)):
            n = len(rows.tokens)
            at = slice(start, start + n) if verifying else slice(i, i + 1)
            own = ForwardResult(res.hidden[start:start + n], res.logits[at], cap)  # type: ignore[index]
            start += n
            for pair in self._guarded(s, lambda s=s, rows=rows, own=own: s.stepped(rows, own, seconds)):
                if isinstance(pair[1], Token):
                    emitted += len(pair[1].ids)
                yield pair
        if choose and len(planned) == len(going):
            self.verify_choice.observe(len(going), emitted, time.perf_counter() - t_step)

    def _leave(self, s: Sequence) -> None:
        """The sequence leaves; its slot goes last in the order free slots are taken in (least recently used first, where
        no sequence extends one)."""
        self.active.remove(s)
        self.slots.remove(s.slot)
        self.slots.append(s.slot)

    def _guarded(self, s: Sequence, work) -> Iterator[tuple[Sequence, Event | Exception]]:  # type: ignore[no-untyped-def]
        if s not in self.active:
            return
        try:
            for ev in work():
                yield s, ev
        except Exception as e:
            yield from self._fail(s, e)

    def _fail(self, s: Sequence, e: Exception) -> Iterator[tuple[Sequence, Event | Exception]]:
        s.slot.reset()
        self._leave(s)
        yield s, e
