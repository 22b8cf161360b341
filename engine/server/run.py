"""Running the server: uvicorn in the foreground (`python -m engine serve`) or on a background thread (the app's
"Serve on localhost" switch, the tests).

The socket is bound here, not by uvicorn, so a port in use is an `EngineError` with a plain message (uvicorn
would exit the process) and port 0 gives an ephemeral port whose number is known before the first request.
"""
from __future__ import annotations

import argparse
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable

from engine.errors import EngineError
from engine import validate

if TYPE_CHECKING:  # types only: the CLI's parser does not load the kernels (engine.events imports engine.ops)
    from engine.api import ServedEngine
    from engine.events import GenerationConfig

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
DEFAULT_PARALLEL = 4  # requests decoded together


class LocalServer:
    """One engine served over HTTP; `start()` returns once it accepts connections, `stop()` shuts it down."""

    def __init__(self, engine: ServedEngine, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 api_key: str | None = None, defaults: Callable[[], GenerationConfig] | None = None,
                 max_waiting: int = 8, parallel: int = DEFAULT_PARALLEL, lock: threading.Lock | None = None,
                 cors_origins: tuple[str, ...] = (), shutdown_grace_s: int = 5):
        import uvicorn

        from engine.events import GenerationConfig
        from engine.server.app import create_app
        from engine.server.scheduler import Scheduler

        if api_key is not None:
            validate.api_key(api_key)
        validate.integer("port", port, 0, validate.MAX_PORT)
        validate.integer("queue", max_waiting, 0, validate.MAX_QUEUE)
        validate.integer("parallel", parallel, 1, validate.MAX_PARALLEL)
        for origin in cors_origins:
            validate.origin(origin)
        self.sock = _bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.scheduler = Scheduler(engine, defaults or GenerationConfig, max_waiting=max_waiting, parallel=parallel,
                                   lock=lock)
        self.app = create_app(self.scheduler, port=self.port, api_key=api_key, cors_origins=cors_origins)
        # No access log: clients' requests are nobody's business. On stop, replies in flight get
        # `shutdown_grace_s`, then are cancelled, which stops their generations.
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     lifespan="off",
                                                     timeout_graceful_shutdown=shutdown_grace_s))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        from engine.server.app import model_name

        return model_name(self.scheduler.engine)

    @property
    def metrics(self):  # engine.server.metrics.ServerMetrics
        return self.scheduler.metrics

    def set_engine(self, engine: ServedEngine) -> None:
        """Serve another engine from the next request on (the app loaded a new model)."""
        self.scheduler.engine = engine

    def run(self) -> None:
        """Serve in this thread until interrupted (Ctrl+C)."""
        try:
            self._server.run(sockets=[self.sock])
        finally:
            self.scheduler.close()

    def start(self, timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self.run, name="foretell-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EngineError(f"the server did not start on {self.url}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EngineError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=validate.port_arg, default=DEFAULT_PORT,
                   help="TCP port (default 8080; 0 = any free port)")
    s.add_argument("--api-key", type=validate.api_key_arg, default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--queue", type=validate.queue_arg, default=8,
                   help=f"requests that may wait behind the running ones (default 8, at most {validate.MAX_QUEUE}); "
                   "more are refused with 429")
    s.add_argument("--parallel", type=validate.parallel_arg, default=DEFAULT_PARALLEL,
                   help=f"requests decoded together, each with its own cache (default {DEFAULT_PARALLEL}, at most "
                   f"{validate.MAX_PARALLEL}; 1: one at a time)")
    s.add_argument("--cors", action="append", default=[], metavar="ORIGIN", type=validate.origin_arg,
                   help="allow browser requests from this origin, e.g. http://localhost:3000 (repeatable; "
                   "default: none)")
    s.add_argument("--ctx", type=int, default=4096, help="context length")
    s.add_argument("--no-mtp", dest="mtp", action="store_false", default=True,
                   help="plain decoding by default (a request may still ask for MTP)")
    s.add_argument("--draft", default="auto", type=validate.draft_arg,
                   help=f"default draft depth 1-{validate.MAX_DRAFT} or 'auto'")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="reply length when a request sets none (default: until the context is full)")
    s.add_argument("--temp", type=float, default=0.0, help="default temperature when a request sets none (0 = greedy)")


def defaults(args: argparse.Namespace) -> GenerationConfig:
    """The CLI's `serve` flags as the settings every request starts from, checked before the model loads (a bad
    one would fail every request)."""
    from engine.events import GenerationConfig
    from engine.sampling import SamplingConfig

    gen = GenerationConfig(max_tokens=args.ctx if args.max_tokens is None else args.max_tokens, mtp=args.mtp,
                           draft=args.draft, sampling=SamplingConfig(temperature=args.temp))
    validate.validate_generation(gen)
    return gen


def serve(args: argparse.Namespace, engine: ServedEngine, gen: GenerationConfig) -> int:
    """The CLI's `serve`: `gen` as the defaults, the URL on stderr, then serve until Ctrl+C."""
    import sys

    server = LocalServer(engine, host=args.host, port=args.port, api_key=args.api_key, defaults=lambda: gen,
                         max_waiting=args.queue, parallel=args.parallel,
                         cors_origins=tuple(args.cors))
    print(f"serving {server.model_name} on {server.url} (OpenAI API; Ctrl+C stops)", file=sys.stderr, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down gracefully, then re-raises the signal it caught
        pass
    print("stopped", file=sys.stderr)
    return 0
