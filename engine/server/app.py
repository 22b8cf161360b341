"""The routes: `/v1/models` (and `/v1/models/{id}`), `/v1/chat/completions`, `/v1/completions`, `/v1/messages`
(Anthropic's; each streamed as server-sent events or not), `/health`, `/metrics`. Every error is answered in
OpenAI's shape (Anthropic's on /v1/messages); nothing a client sends reaches it as a traceback or stops the server.

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
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import tools as toolkit
from engine import validate
from engine.api import ServedEngine
from engine.constrain import Constraint
from engine.errors import ChatTemplateError, InvalidParameterError
from engine.server import anthropic, guard, protocol
from engine.server.protocol import APIError, Request, bad
from engine.server.reasoning import CLOSE, OPEN, ReasoningSplitter, opens_thinking
from engine.server.reply import CallSetup, OpenAIReply, ReplyText
from engine.server.scheduler import Job, QueueFullError, Scheduler

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
        bearer = request.headers.get("authorization", "").encode()
        key = request.headers.get("x-api-key", "").encode()  # Anthropic's clients send it so
        if not (hmac.compare_digest(bearer, f"Bearer {api_key}".encode()) or hmac.compare_digest(key, api_key.encode())):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                           type="invalid_request_error", code="invalid_api_key")

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: HTTPRequest) -> Response:
        return PlainTextResponse(scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(eng: ServedEngine) -> dict[str, Any]:
        return {"id": model_name(eng), "object": "model", "created": created, "owned_by": "foretell",
                "meta": {"n_ctx": eng.n_ctx, "n_vocab": eng.hp.n_vocab, "mtp": eng.drafter is not None}}

    async def models(request: HTTPRequest) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card(scheduler.engine)]})

    async def model(request: HTTPRequest) -> Response:
        authorize(request)
        eng, wanted = scheduler.engine, request.path_params["id"]
        if wanted != model_name(eng):
            raise APIError(404, f"the model {wanted!r} does not exist here; this server serves {model_name(eng)!r}",
                           param="model", code="model_not_found")
        return JSONResponse(model_card(eng))

    async def chat_completions(request: HTTPRequest) -> Response:
        return await openai_reply(request, protocol.parse_chat)

    async def completions(request: HTTPRequest) -> Response:
        return await openai_reply(request, protocol.parse_completion)

    async def openai_reply(request: HTTPRequest, parse: Any) -> Response:
        req = await read(request, parse)
        prompt = await prepare(req)
        return await answer(request, prompt, lambda text: OpenAIReply(req, model_name(prompt.eng), text,
                                                                       prompt.eng.tokenizer.token_bytes))

    async def messages(request: HTTPRequest) -> Response:
        try:
            req = await read(request, anthropic.parse)
            prompt = await prepare(req)
            return await answer(request, prompt, lambda text: anthropic.AnthropicReply(model_name(prompt.eng), text,
                                                                                        len(prompt.ids)))
        except APIError as e:
            return JSONResponse(anthropic.error_body(e), status_code=e.status)

    async def read(request: HTTPRequest, parse: Any) -> Request:
        """The body, checked: what the engine would refuse once queued is refused now (the fields' own checks
        name them)."""
        authorize(request)
        guard.check_json_body(request.headers)
        req = parse(protocol.parse_json(await _read_body(request)), scheduler.defaults())
        try:
            validate.validate_generation(req.gen)
        except InvalidParameterError as e:
            raise bad(str(e)) from None
        return req

    async def prepare(req: Request) -> _Prompt:
        eng = scheduler.engine
        prompt = await run_in_threadpool(_encode, eng, req)
        if len(prompt.ids) >= eng.n_ctx:
            raise bad(f"the prompt has {len(prompt.ids)} tokens but the context holds {eng.n_ctx}; shorten it",
                      "messages" if req.chat else "prompt", "context_length_exceeded")
        return prompt

    async def answer(request: HTTPRequest, prompt: _Prompt, make: Any) -> Response:
        """Queue the generation and answer with `make(ReplyText)`'s reply, streamed or whole."""
        req, eng, ids = prompt.req, prompt.eng, prompt.ids
        # the settings' default when the request sets none; never more than the context has room for
        gen = replace(req.gen, max_tokens=min(req.max_tokens or req.gen.max_tokens, eng.n_ctx - len(ids)))
        if prompt.calls is not None and prompt.calls.tools.single and len(gen.stop_strings) < validate.MAX_STOP_STRINGS:
            gen = replace(gen, stop_strings=gen.stop_strings + (toolkit.CALL_CLOSE,))  # one call: end after it
        if prompt.calls is not None and (prompt.calls.prefill or gen.constraint is None):
            gen = replace(gen, constraint=_call_constraint(prompt.calls, prompt.thinking))
        try:
            job = scheduler.submit(eng, ids, gen)
        except QueueFullError as e:
            raise APIError(429, f"{e}; try again shortly", type="rate_limit_error", code="queue_full") from None
        reply = make(ReplyText(ReasoningSplitter(prompt.thinking) if req.chat else None, prompt.calls))
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
        Route("/v1/models", models), Route("/v1/models/{id:path}", model),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"])
                  ] if cors_origins else []
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


@dataclass(frozen=True)
class _Prompt:
    """A request tokenized for the engine it will run on: whether the reply starts inside a thinking block, and how
    its tool calls are written (None: no tools)."""

    req: Request
    eng: ServedEngine
    ids: list[int]
    thinking: bool = False
    calls: CallSetup | None = None


def _encode(eng: ServedEngine, req: Request) -> _Prompt:
    """The prompt as ids (runs off the event loop). A chat's tools go to the template, or are written into the
    messages for a template that renders none; a forced call (tool_choice required or named) is prefilled: the
    reply starts inside the call, after a thinking block the template closes (enable_thinking false) or, where it
    does not, one closed here. A reply held to a JSON response_format starts after such a closed block too."""
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
        return _Prompt(req, eng, ids)
    tools = req.tools
    fmt = toolkit.tool_format(eng.chat)
    prefill = "" if tools is None or tools.choice == "auto" else fmt.opening(tools.forced)
    held = bool(prefill) or req.gen.constraint is not None  # the reply starts at once with a call or the JSON
    thinking_on = False if held else req.enable_thinking
    msgs, given = (req.prompt, tools.tools if tools else None) if fmt.native else \
        (toolkit.written_in(req.prompt, tools.tools if tools else ()), None)
    try:
        validate.messages(msgs)
        ids = eng.chat.encode(msgs, enable_thinking=thinking_on, tools=given)
        thinking = opens_thinking(eng.chat.render(msgs, enable_thinking=thinking_on, tools=given))
    except (ChatTemplateError, InvalidParameterError) as e:
        raise bad(str(e), "messages") from None
    if held:
        ids += eng.tokenizer.encode((f"\n{CLOSE}\n\n" if thinking else "") + prefill, special=True, add_bos=False)
        thinking = False
    return _Prompt(req, eng, ids, thinking, None if tools is None else CallSetup(tools, fmt, prefill))


def _call_constraint(calls: CallSetup, thinking: bool = False) -> Constraint | None:
    """Calls held to their markup and their function's schema by constrained decoding (engine.tools.call_grammar):
    a forced call (tool_choice required or named) from its prefilled opening; under tool_choice auto each call the
    model opens (a lazy constraint from its CALL_OPEN tag, outside a thinking block: free text is not masked). Every
    call such a reply makes parses and validates. None where llguidance cannot enforce a schema: the calls are then
    checked after they are made."""
    tools, fmt = calls.tools, calls.fmt
    c = Constraint.grammar_of(toolkit.call_grammar(fmt, tools.schemas, tools.forced, tools.parallel)) if calls.prefill \
        else Constraint.lazy(toolkit.auto_call_grammar(fmt, tools.schemas), toolkit.CALL_OPEN, (OPEN, CLOSE), thinking)
    try:
        c.check()
    except (InvalidParameterError, ValueError) as e:  # a schema llguidance does not implement, a name it cannot take
        logging.getLogger(__name__).info("tool calls are not constrained: %s", e)
        return None
    return c


def _check_size(eng: ServedEngine, req: Request) -> None:
    """A prompt of more bytes than the context's tokens can stand for is over the context before it is
    tokenized (8 MiB of text took ~3 s of a core to tokenize): no token stands for more than the longest."""
    texts = [m["content"] + str(m.get("tool_calls", "")) for m in req.prompt] if req.chat else \
        [req.prompt] if isinstance(req.prompt, str) else []
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
