"""One generation at a time: a single thread runs `Engine.generate` for queued jobs, in order.

The engine holds one sequence cache, so requests take turns. A request joins a bounded queue or is refused at
once (`QueueFullError` → 429), never left to pile up. Events cross from the generation thread to the event loop
with `call_soon_threadsafe` onto the job's asyncio queue. A job's `stop` event ends its generation within one
decode step; the HTTP side sets it when the client goes away.

`lock` is held around every generation. The desktop app passes the lock its own engine worker holds while it
generates, so a chat in the window and a request to the server never run on the engine at once: whichever
comes second waits for the first to finish.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from engine.api import EngineLike, ServedEngine
from engine.errors import EngineError
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

    def post(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shut down): nobody reads this job any more
            self.stop.set()

    async def events(self) -> AsyncIterator[Event | Failure]:
        while (item := await self.queue.get()) is not _END:
            yield item  # type: ignore[misc]


class Scheduler:
    """Runs jobs on one thread; at most `max_waiting` wait behind the running one."""

    def __init__(self, engine: ServedEngine, defaults: Callable[[], GenerationConfig], *, max_waiting: int = 8,
                 lock: threading.Lock | None = None, metrics: ServerMetrics | None = None):
        self.engine = engine  # what requests are tokenized for and queued on; the app swaps it between requests
        self.defaults = defaults  # the engine's settings: sampling, MTP and draft depth a request did not set
        self.max_waiting = max_waiting
        self.lock = lock or threading.Lock()
        self.metrics = metrics or ServerMetrics()
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="foretell-serve-generate", daemon=True)
        self._thread.start()

    def submit(self, engine: EngineLike, prompt: list[int], gen: GenerationConfig) -> Job:
        """Queue a generation (call on the event loop); raises QueueFullError when no place is left."""
        with self._pending_lock:
            if self._pending >= 1 + self.max_waiting:
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
        while (job := self._jobs.get()) is not None:
            self.metrics.adjust(waiting=-1, running=1)
            try:
                self._run(job)
            finally:
                self.metrics.adjust(running=-1)
                with self._pending_lock:
                    self._pending -= 1
                job.post(_END)

    def _run(self, job: Job) -> None:
        if job.stop.is_set():  # the client left while waiting
            job.post(Done("stopped"))
            self.metrics.add_failure("abort")
            return
        final: Stats | None = None
        done: Done | None = None
        try:
            with self.lock:
                for ev in job.engine.generate(job.prompt, job.gen, job.stop):
                    if isinstance(ev, Stats):
                        if not ev.final:
                            continue  # the HTTP side answers with the final stats only
                        final = ev
                    elif isinstance(ev, Done):
                        done = ev
                    job.post(ev)
        except EngineError as e:
            job.post(Failure(str(e)))
        except Exception as e:  # a bug: the request fails, the server and its thread go on
            traceback.print_exc()
            job.post(Failure(f"internal error ({type(e).__name__}: {e})"))
        finish = "error" if done is None else "abort" if done.reason == "stopped" else finish_reason(done.reason)
        if final is not None:
            self.metrics.add_generation(final, finish)
        else:
            self.metrics.add_failure(finish)
