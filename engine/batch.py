"""Several sequences decoded together (the server's parallel requests, `serve --parallel N`).

A `Batch` holds up to N slots over one loaded `Engine`'s runner, each with its own sequence state: the trunk's cache
(attention KV, GDN conv and recurrent states) and the MTP head's, and the tokens in them, kept after a reply so that a
request extending a slot's sequence (the next turn of a chat) prefills only its new tokens. Each `step()` runs a
prompt chunk of every sequence still prefilling, then one decode step of every sequence under way: alone, a sequence
steps with its own decoder (MTP where the request asks for it); several step together in one pass over one row each
(`Runner.forward_many`: the weights read once for all rows, each sequence's attention or recurrence over its own
state). Sequences join and leave between steps. Every op is batch-invariant, so a sequence's logits, and its greedy
tokens, are those of its run alone.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from engine.cache import Cache
from engine.decoding import Decoder, PlainDecoder, Reply
from engine.events import Done, Event, GenerationConfig, Progress, Stats
from engine.generate import PREFILL_CHUNK, Engine
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
        plain = PlainDecoder(engine.runner, slot.cache, slot.advance, self.sampler, slot.keep_head)
        self.decoder: Decoder = SpeculativeDecoder(plain, slot.drafter, self.depth, self.spec) \
            if self.depth is not None and slot.drafter is not None else plain
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
        self.x = yield from self.decoder.step(self.x, self.reply, self.engine.n_ctx - self.slot.cache.pos - 1)
        yield from self.tick()

    def stepped(self, hidden: torch.Tensor, logits: torch.Tensor) -> Iterator[Event]:
        """A decode step run with other sequences: the trunk's row after x (`hidden` [1, d], `logits` [V])."""
        slot, x = self.slot, self.x
        slot.keep_head([x], hidden)
        slot.advance([x], logits)
        self.x = self.sampler.sample(logits, self.reply.history, self.reply.matcher)
        yield from self.reply.emit([(self.x, False)], logits)
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


class Batch:
    """Up to `size` sequences over one engine's runner, stepped together (see the module docstring). Not thread-safe:
    one thread adds and steps; the caller keeps other users of the engine's runner out meanwhile."""

    def __init__(self, engine: Engine, size: int):
        if size < 1:
            raise ValueError(f"a batch holds at least one sequence, not {size}")
        self.engine, self.size = engine, size
        self.slots: list[Slot] = []  # made when first needed
        self.active: list[Sequence] = []
        self.memory = AutoMemory()  # draft-depth costs and acceptance, carried across replies
        self.batched_steps = 0  # decode steps that ran several sequences in one pass

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
            try:
                res = self.engine.runner.forward_many([[s.x] for s in going], [s.slot.cache for s in going])
            except Exception as e:  # the pass failed for all of them
                for s in going:
                    yield from self._fail(s, e)
            else:
                self.batched_steps += 1
                for i, s in enumerate(going):
                    yield from self._guarded(s, lambda s=s, i=i: s.stepped(res.hidden[i:i + 1], res.logits[i]))
        for s in [s for s in self.active if s.reply.reason is not None]:
            yield from self._guarded(s, s.end)
            if s in self.active:
                self._leave(s)

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
