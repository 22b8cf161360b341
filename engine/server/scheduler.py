"""Generation for the server: one thread takes queued jobs in order and runs up to `parallel` of them at once.

A local engine's jobs join a `engine.batch.Batch` (each its own sequence state; decoded together, one pass over a row
of each, joining and leaving between steps); an engine that cannot batch (the tests' scripted one) runs its jobs one at
a time through `generate`. A request joins a bounded queue or is refused at once (`QueueFullError` → 429), never left
to pile up. Events cross from the generation thread to the event loop with `call_soon_threadsafe` onto the job's
asyncio queue. A job's `stop` event ends its generation within one decode step and frees its place in the batch; the
HTTP side sets it when the client goes away.

`lock` is held while anything generates. The desktop app passes the lock its own engine worker holds while it
generates, so a chat in the window and requests to the server never run on the engine at once: whichever comes
second waits for the first to finish.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from engine.api import EngineLike, ServedEngine
from engine.batch import Batch, Sequence
from engine.errors import EngineError
from engine.generate import Engine
from engine.events import Done, Event, GenerationConfig, Stats
from engine.server.metrics import ServerMetrics
from engine.server.protocol import finish_reason


class QueueFullError(Exception):
    """Every place in the queue is taken."""


@dataclass(frozen=True)
class Failure:
    """The engine raised during a job: the message to answer with."""

    message: str


_END = object()  # posted after a job's last event


@dataclass
class Job:
    engine: EngineLike  # the scheduler's engine when the job was queued (the app may swap engines between jobs)
    prompt: list[int]
    gen: GenerationConfig
    loop: asyncio.AbstractEventLoop
    stop: threading.Event = field(default_factory=threading.Event)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    final: Stats | None = None  # the generation's final stats, once posted
    done: Done | None = None

    def post(self, item: object) -> None:
        _post_all([(self, item)])

    async def events(self) -> AsyncIterator[Event | Failure]:
        while (item := await self.queue.get()) is not _END:
            yield item  # type: ignore[misc]


class Scheduler:
    """Runs jobs on one thread, up to `parallel` at once; at most `max_waiting` wait behind them."""

    def __init__(self, engine: ServedEngine, defaults: Callable[[], GenerationConfig], *, max_waiting: int = 8,
                 parallel: int = 1, lock: threading.Lock | None = None,
                 metrics: ServerMetrics | None = None):
        self.engine = engine  # what requests are tokenized for and queued on; the app swaps it between requests
        self.defaults = defaults  # the engine's settings: sampling, MTP and draft depth a request did not set
        self.max_waiting, self.parallel = max_waiting, parallel
        self.lock = lock or threading.Lock()
        self.metrics = metrics or ServerMetrics()
        self.batch: Batch | None = None  # the last batched engine's sequences (their slots kept for the next requests)
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="foretell-serve-generate", daemon=True)
        self._thread.start()

    def submit(self, engine: EngineLike, prompt: list[int], gen: GenerationConfig) -> Job:
        """Queue a generation (call on the event loop); raises QueueFullError when no place is left."""
        with self._pending_lock:
            if self._pending >= self.parallel + self.max_waiting:
                self.metrics.adjust(rejected=1)
                raise QueueFullError(f"the server is busy: {self._pending} requests are running or waiting")
            self._pending += 1
        job = Job(engine, prompt, gen, asyncio.get_running_loop())
        self.metrics.adjust(waiting=1)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        self._jobs.put(None)

    def _work(self) -> None:
        held: Job | None = None  # taken from the queue by a batch it could not join
        while not self._closing and (job := held or self._jobs.get()) is not None:
            held = None
            self.metrics.adjust(waiting=-1, running=1)
            if self.parallel > 1 and isinstance(job.engine, Engine):
                held = self._batched(job)
            else:
                self._run(job)
                self._finish(job)

    def _run(self, job: Job) -> None:
        if job.stop.is_set():  # the client left while waiting
            self._take(job, Done("stopped"))
            return
        try:
            with self.lock:
                for ev in job.engine.generate(job.prompt, job.gen, job.stop):
                    self._take(job, ev)
        except Exception as e:
            self._take(job, _failure(e))

    def _batched(self, first: Job) -> Job | None:
        """Run `first` and the queued jobs for its engine together, up to `parallel` at once, until none is left
        running; returns a job taken from the queue that could not join (another engine's, or one that cannot
        batch), to run next."""
        eng: Engine = first.engine  # type: ignore[assignment]
        if self.batch is None or self.batch.engine is not eng or self.batch.size != self.parallel:
            self.batch = Batch(eng, self.parallel)
        batch, jobs, held = self.batch, {}, None
        with self.lock:
            self._admit(first, jobs)
            while jobs:
                while not batch.full and held is None and not self._closing:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if job is None:
                        self._closing = True  # the server stopped: what runs is stopped too
                    elif job.engine is not eng:
                        held = job
                    else:
                        self.metrics.adjust(waiting=-1, running=1)
                        self._admit(job, jobs)
                if self._closing:
                    for job in jobs.values():
                        job.stop.set()
                posts: list[tuple[Job, object]] = []  # the step's events, handed to the event loop at once
                try:
                    for seq, ev in batch.step():
                        self._take(jobs[seq], _failure(ev) if isinstance(ev, Exception) else ev, posts)
                except Exception as e:  # a bug outside any one sequence's work: every reply in it fails
                    for job in jobs.values():
                        self._take(job, _failure(e), posts)
                    self.batch = batch = Batch(eng, self.parallel)
                _post_all(posts)
                for seq in [s for s in jobs if s not in batch.active]:
                    self._finish(jobs.pop(seq))
        return held

    def _admit(self, job: Job, jobs: dict[Sequence, Job]) -> None:
        """A job into the batch (a stopped or refused one is finished at once)."""
        assert self.batch is not None
        if job.stop.is_set():  # the client left while waiting
            self._take(job, Done("stopped"))
        else:
            try:
                jobs[self.batch.add(job.prompt, job.gen, job.stop)] = job
                return
            except Exception as e:
                self._take(job, _failure(e))
        self._finish(job)

    @staticmethod
    def _take(job: Job, item: Event | Failure, posts: list[tuple[Job, object]] | None = None) -> None:
        """An event of the job's generation (or its failure), recorded and posted (or added to `posts`, which
        _post_all hands over); the HTTP side answers with the final stats only."""
        if isinstance(item, Stats):
            if not item.final:
                return
            job.final = item
        elif isinstance(item, Done):
            job.done = item
        if posts is None:
            job.post(item)
        else:
            posts.append((job, item))

    def _finish(self, job: Job) -> None:
        done = job.done
        finish = "error" if done is None else "abort" if done.reason == "stopped" else finish_reason(done.reason)
        if job.final is not None:
            self.metrics.add_generation(job.final, finish)
        else:
            self.metrics.add_failure(finish)
        with self._pending_lock:  # its place is free before the gauge says so
            self._pending -= 1
        self.metrics.adjust(running=-1)
        job.post(_END)


def _post_all(posts: list[tuple[Job, object]]) -> None:
    """A batch step's events in one hand-over per event loop (each `call_soon_threadsafe` wakes the loop: one per
    token took ~3 % of the decoding thread under 4 clients on the embedded model, and woke the loop as often)."""
    loops: dict[asyncio.AbstractEventLoop, list[tuple[Job, object]]] = {}
    for job, item in posts:
        loops.setdefault(job.loop, []).append((job, item))
    for loop, items in loops.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop is gone (server shut down): nobody reads these jobs any more
            for job, _ in items:
                job.stop.set()


def _deliver(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job.queue.put_nowait(item)


def _failure(e: Exception) -> Failure:
    if isinstance(e, EngineError):
        return Failure(str(e))
    traceback.print_exception(e)  # a bug: the request fails, the server and its thread go on
    return Failure(f"internal error ({type(e).__name__}: {e})")
