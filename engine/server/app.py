"""The routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions` (streamed as server-sent events or
not), `/health`, `/metrics`. Every error is answered in OpenAI's shape; nothing a client sends reaches it as a
traceback or stops the server.

A /v1 request from a web page that is not allowed is refused (engine.server.guard); a POST's body must be JSON.
A request is checked and tokenized before it queues, so a bad body or a prompt over the context is a 400 at
once, and its reply is capped by the room left in the context. A streamed reply starts with its headers right
away and ends its generation when the client goes away (starlette cancels the stream on `http.disconnect`); a
plain reply watches for the disconnect itself.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import validate
from engine.api import ServedEngine
from engine.errors import ChatTemplateError, InvalidParameterError
from engine.events import Done, Stats, Token
from engine.server import guard, protocol
from engine.server.protocol import APIError, Request, bad
from engine.server.reasoning import ReasoningSplitter, opens_thinking
from engine.server.scheduler import Failure, Job, QueueFullError, Scheduler

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

MAX_BODY_BYTES = 8 * 2**20
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def model_name(eng: ServedEngine) -> str:
    return eng.mf.get("general.name") or eng.mf.path.stem


def create_app(scheduler: Scheduler, *, port: int, api_key: str | None = None,
               cors_origins: tuple[str, ...] = ()) -> Starlette:
    """The ASGI app over `scheduler`'s engine (which may be swapped between requests), served on `port`;
    `api_key` and the browser-origin check guard /v1, not /health or /metrics."""
    created = int(time.time())
    origins = guard.allowed_origins(cors_origins, port)

    def authorize(request: HTTPRequest) -> None:
        guard.check_origin(request.headers, origins)
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY'",
                           type="invalid_request_error", code="invalid_api_key")

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: HTTPRequest) -> Response:
        return PlainTextResponse(scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(request: HTTPRequest) -> Response:
        authorize(request)
        eng = scheduler.engine
        return JSONResponse({"object": "list", "data": [{
            "id": model_name(eng), "object": "model", "created": created, "owned_by": "foretell",
            "meta": {"n_ctx": eng.n_ctx, "n_vocab": eng.hp.n_vocab, "mtp": eng.drafter is not None}}]})

    async def chat_completions(request: HTTPRequest) -> Response:
        return await complete(request, chat=True)

    async def completions(request: HTTPRequest) -> Response:
        return await complete(request, chat=False)

    async def complete(request: HTTPRequest, chat: bool) -> Response:
        authorize(request)
        guard.check_json_body(request.headers)
        body = protocol.parse_json(await _read_body(request))
        req = (protocol.parse_chat if chat else protocol.parse_completion)(body, scheduler.defaults())
        try:  # what the engine would refuse once queued, refused now (the fields' own checks name them)
            validate.validate_generation(req.gen)
        except InvalidParameterError as e:
            raise bad(str(e)) from None
        eng = scheduler.engine
        ids, thinking = await run_in_threadpool(_encode, eng, req)
        if len(ids) >= eng.n_ctx:
            raise bad(f"the prompt has {len(ids)} tokens but the context holds {eng.n_ctx}; shorten it",
                      "messages" if chat else "prompt", "context_length_exceeded")
        # the settings' default when the request sets none; never more than the context has room for
        gen = replace(req.gen, max_tokens=min(req.max_tokens or req.gen.max_tokens, eng.n_ctx - len(ids)))
        try:
            job = scheduler.submit(eng, ids, gen)
        except QueueFullError as e:
            raise APIError(429, f"{e}; try again shortly", type="rate_limit_error", code="queue_full") from None
        reply = _Reply(req, model_name(eng), ReasoningSplitter(thinking) if chat else None)
        if req.stream:
            return _EventStream(job, reply.stream(job))
        watcher = asyncio.create_task(_stop_on_disconnect(request, job))
        try:
            return JSONResponse(await reply.collect(job))
        finally:  # done, or cancelled (the server is shutting down): nothing more is wanted either way
            watcher.cancel()
            job.stop.set()

    async def api_error(request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                     type=kind).body(), status_code=exc.status_code)

    async def server_error(request: HTTPRequest, exc: Exception) -> Response:
        return JSONResponse(APIError(500, f"internal error ({type(exc).__name__}: {exc})", type="server_error").body(),
                            status_code=500)

    routes = [
        Route("/health", health), Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"])] if cors_origins else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers={
        APIError: api_error, HTTPException: http_error, Exception: server_error})


async def _read_body(request: HTTPRequest) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB", code="request_too_large")
    return bytes(body)


def _encode(eng: ServedEngine, req: Request) -> tuple[list[int], bool]:
    """Prompt ids, and whether the reply starts inside a thinking block (runs off the event loop)."""
    _check_size(eng, req)
    if not req.chat:
        if isinstance(req.prompt, str):  # the whole prompt is the client's: special tokens are parsed
            ids = eng.tokenizer.encode(req.prompt, special=True)
        else:
            ids = list(req.prompt)
            if max(ids) >= eng.hp.n_vocab:
                raise bad(f"token id {max(ids)} is outside the vocabulary (0..{eng.hp.n_vocab - 1})", "prompt")
        if not ids:
            raise bad("the prompt is empty", "prompt")
        return ids, False
    try:
        ids = eng.encode_prompt(req.prompt, req.enable_thinking)
        thinking = opens_thinking(eng.chat.render(req.prompt, enable_thinking=req.enable_thinking))
    except (ChatTemplateError, InvalidParameterError) as e:
        raise bad(str(e), "messages") from None
    return ids, thinking


def _check_size(eng: ServedEngine, req: Request) -> None:
    """A prompt of more bytes than the context's tokens can stand for is over the context before it is
    tokenized (8 MiB of text took ~3 s of a core to tokenize): no token stands for more than the longest."""
    texts = [m["content"] for m in req.prompt] if req.chat else [req.prompt] if isinstance(req.prompt, str) else []
    size = sum(len(t.encode()) for t in texts)
    if size > eng.n_ctx and size > eng.n_ctx * _longest_token(eng.tokenizer):
        raise bad(f"the prompt's {size} bytes of text cannot fit in a context of {eng.n_ctx} tokens; shorten it",
                  "messages" if req.chat else "prompt", "context_length_exceeded")


@functools.lru_cache(maxsize=4)
def _longest_token(tokenizer: Tokenizer) -> int:
    """The most bytes one token of the vocabulary stands for (read once per tokenizer, for a big prompt only)."""
    return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.n_vocab))


class _EventStream(StreamingResponse):
    """Server-sent events that stop their job however the response ends: complete, failed, or cancelled by
    starlette on `http.disconnect` (even before the first event, when no generator cleanup would run)."""

    def __init__(self, job: Job, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.stop.set()


async def _stop_on_disconnect(request: HTTPRequest, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.stop.set()


class _Reply:
    """One response's id, shapes and text assembly, streamed or whole."""

    def __init__(self, req: Request, model: str, splitter: ReasoningSplitter | None):
        self.req, self.model, self.splitter = req, model, splitter
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"

    def _parts(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of newly generated text."""
        if self.splitter is None:
            return "", text
        r, c = self.splitter.push(text)
        if final:
            fr, fc = self.splitter.flush()
            r, c = r + fr, c + fc
        return r, c

    def _choice(self, reasoning: str, content: str, finish: str | None, *, delta: bool) -> dict[str, Any]:
        if not self.req.chat:
            return {"index": 0, "text": content, "logprobs": None, "finish_reason": finish}
        msg: dict[str, Any] = {} if delta else {"role": "assistant", "content": content}
        if delta and content:
            msg["content"] = content
        if reasoning:
            msg["reasoning_content"] = reasoning
        return {"index": 0, ("delta" if delta else "message"): msg, "logprobs": None, "finish_reason": finish}

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.req.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    async def collect(self, job: Job) -> dict[str, Any]:
        reasoning, content = [], []
        final: Stats | None = None
        done = Done("stopped")
        async for ev in job.events():
            if isinstance(ev, Token):
                r, c = self._parts(ev.text)
                reasoning.append(r)
                content.append(c)
            elif isinstance(ev, Stats):
                final = ev
            elif isinstance(ev, Done):
                done = ev
            elif isinstance(ev, Failure):
                raise APIError(500, ev.message, type="server_error")
        r, c = self._parts("", final=True)
        out = self._envelope([self._choice("".join(reasoning) + r, "".join(content) + c,
                                           protocol.finish_reason(done.reason), delta=False)], chunk=False)
        if final is not None:
            out["usage"], out["timings"] = protocol.usage(final), protocol.timings(final)
        return out

    async def stream(self, job: Job) -> AsyncIterator[str]:
        if self.req.chat:
            first = self._choice("", "", None, delta=True)
            first["delta"] = {"role": "assistant", "content": ""}
            yield self._sse(self._envelope([first], chunk=True))
        final: Stats | None = None
        done = Done("stopped")
        async for ev in job.events():
            if isinstance(ev, Token):
                r, c = self._parts(ev.text)
                if r or c:
                    yield self._sse(self._envelope([self._choice(r, c, None, delta=True)], chunk=True))
            elif isinstance(ev, Stats):
                final = ev
            elif isinstance(ev, Done):
                done = ev
            elif isinstance(ev, Failure):
                yield self._sse(APIError(500, ev.message, type="server_error").body())
                return
        r, c = self._parts("", final=True)
        last = self._envelope([self._choice(r, c, protocol.finish_reason(done.reason), delta=True)], chunk=True)
        if final is not None:
            last["timings"] = protocol.timings(final)
        yield self._sse(last)
        if self.req.include_usage and final is not None:
            yield self._sse({**self._envelope([], chunk=True), "usage": protocol.usage(final)})
        yield "data: [DONE]\n\n"

    def _sse(self, payload: dict[str, Any]) -> str:
        if self.req.include_usage and "choices" in payload and "usage" not in payload:
            payload["usage"] = None  # OpenAI's shape: every chunk but the last carries a null usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
