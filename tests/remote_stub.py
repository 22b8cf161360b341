"""llama.cpp's own server in-process (`llama_server`), and a small OpenAI-shaped server for tests/test_remote.py: what vLLM and SGLang report (per-request metrics,
Prometheus counters and gauges, /server_info), and each fault a remote engine must survive. One `Stub` per
behaviour, on 127.0.0.1, run by uvicorn on a thread."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

WORDS = ["In", " the", " beginning", " was", " the", " word", ".", " And", " the", " word"]


@dataclass
class Behaviour:
    owner: str = "vllm"  # /v1/models owned_by: how the client tells the server kind
    model: str = "stub-model"
    api_key: str | None = None
    request_metrics: bool = False  # vLLM's per-request metrics.speculative_decoding on the final chunk
    counters: bool = False  # vllm: Prometheus counters on /metrics, advanced by each request
    gauges: bool = False  # sglang: accept-rate/length gauges on /metrics
    server_info: bool = False  # sglang: /server_info with avg_spec_accept_length
    usage: bool = True
    cut_after: int | None = None  # end the stream (cleanly, no finish/[DONE]) after this many chunks
    abort_after: int | None = None  # break the connection after this many chunks
    error_after: int | None = None  # an error event inside the stream after this many chunks
    delay_first_s: float = 0.0  # before the response starts (headers included): a read timeout
    stall_after: int | None = None  # then sleep stall_s mid-stream
    stall_s: float = 0.0
    chunk_delay_s: float = 0.0
    count_midway: bool = False  # the counters advance half-way through the reply, not at its end
    reasoning: int = 0  # the first chunks carry reasoning_content (a thinking model behind a reasoning parser)
    status: int | None = None  # answer completions with this status (and an OpenAI error body)
    requests: list[dict[str, Any]] = field(default_factory=list)  # bodies received


class Stub:
    def __init__(self, b: Behaviour):
        self.b = b
        self.draft_tokens = self.accepted = self.drafts = 0
        self.per_pos = [0, 0]
        app = Starlette(routes=[Route("/v1/models", self.models), Route("/metrics", self.metrics),
                                Route("/server_info", self.server_info),
                                Route("/v1/chat/completions", self.complete, methods=["POST"]),
                                Route("/v1/completions", self.complete, methods=["POST"])])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off",
                                                   timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Stub":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def _denied(self, request: Request) -> Response | None:
        if self.b.api_key and request.headers.get("authorization") != f"Bearer {self.b.api_key}":
            return JSONResponse({"error": {"message": "Invalid API key", "type": "authentication_error",
                                           "code": "invalid_api_key"}}, status_code=401)
        return None

    async def models(self, request: Request) -> Response:
        return self._denied(request) or JSONResponse({"object": "list", "data": [
            {"id": self.b.model, "object": "model", "owned_by": self.b.owner, "max_model_len": 4096}]})

    async def metrics(self, request: Request) -> Response:
        lines = []
        if self.b.counters:
            lab = f'{{engine="0",model_name="{self.b.model}"}}'
            lines += ["# TYPE vllm:spec_decode_num_drafts_total counter",
                      f"vllm:spec_decode_num_drafts_total{lab} {float(self.drafts)}",
                      f"vllm:spec_decode_num_draft_tokens_total{lab} {float(self.draft_tokens)}",
                      f"vllm:spec_decode_num_accepted_tokens_total{lab} {float(self.accepted)}"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{self.b.model}",'
                      f'position="{i}"}} {float(n)}' for i, n in enumerate(self.per_pos)]
        if self.b.gauges:
            lines += ["# TYPE sglang:spec_accept_rate gauge", 'sglang:spec_accept_rate{model_name="m"} 0.7',
                      'sglang:spec_accept_length{model_name="m"} 2.4']
        return PlainTextResponse("\n".join(lines) + "\n")

    async def server_info(self, request: Request) -> Response:
        if not self.b.server_info:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"internal_states": [{"avg_spec_accept_length": 2.75}], "version": "stub"})

    async def complete(self, request: Request) -> Response:
        denied = self._denied(request)
        if denied:
            return denied
        body = await request.json()
        self.b.requests.append(body)
        if self.b.status:
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                           "type": "NotFoundError", "code": self.b.status}}, status_code=self.b.status)
        if self.b.delay_first_s:
            await asyncio.sleep(self.b.delay_first_s)
        chat = request.url.path.endswith("chat/completions")
        n = min(int(body.get("max_tokens") or 8), len(WORDS))
        return StreamingResponse(self._events(chat, n, bool(body.get("return_token_ids"))),
                                 media_type="text/event-stream")

    def _count(self) -> None:
        """One reply's speculation: 3 drafts of 2 tokens, 4 accepted (3 at position 0, 1 at position 1)."""
        self.drafts += 3
        self.draft_tokens += 6
        self.accepted += 4
        self.per_pos[0] += 3
        self.per_pos[1] += 1

    async def _events(self, chat: bool, n: int, ids: bool = False):
        b = self.b
        for i in range(n):
            if b.count_midway and i == n // 2:
                self._count()
            if i == b.cut_after:
                return
            if i == b.abort_after:
                raise RuntimeError("connection lost")  # uvicorn drops the connection mid-body
            if i == b.error_after:
                yield _sse({"error": {"message": "CUDA out of memory", "type": "server_error"}})
                return
            if i == b.stall_after:
                await asyncio.sleep(b.stall_s)
            if b.chunk_delay_s:
                await asyncio.sleep(b.chunk_delay_s)
            field = "reasoning_content" if i < b.reasoning else "content"
            choice = {"index": 0, "delta": {field: WORDS[i]}} if chat else {"index": 0, "text": WORDS[i]}
            if ids:
                choice["token_ids"] = [100 + i]
            yield _sse({"object": "chunk", "choices": [{**choice, "finish_reason": None}]})
        if not b.count_midway:
            self._count()
        last: dict[str, Any] = {"object": "chunk", "choices": [
            {"index": 0, "delta": {} if chat else None, "text": "", "finish_reason": "length"}]}
        if b.request_metrics:
            last["metrics"] = {"speculative_decoding": {"num_drafts": 3, "num_draft_tokens": 6,
                                                        "num_accepted_tokens": 4,
                                                        "num_accepted_tokens_per_pos": [3, 1]}}
        yield _sse(last)
        if b.usage:
            yield _sse({"object": "chunk", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n,
                                                                    "total_tokens": 11 + n}})
        yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def llama_server():  # xllamacpp.Server
    """llama-server's code in-process on 127.0.0.1 (xllamacpp): the embedded model, MTP drafting 2 tokens,
    /metrics on; 1 thread, no busy polling (the test host is small and shared). Keep a reference: dropping it
    stops the server."""
    import xllamacpp as xl  # a declared test dependency (the `test` extra)

    from engine.storage.modelfile import default_model_path

    p = xl.CommonParams()
    p.model.path = str(default_model_path())
    p.n_ctx, p.n_parallel, p.warmup, p.endpoint_metrics = 512, 1, False, True
    for cp in (p.cpuparams, p.cpuparams_batch, p.speculative.draft.cpuparams, p.speculative.draft.cpuparams_batch):
        cp.n_threads, cp.poll = 1, 0
    p.speculative.types = [xl.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_MTP]
    p.speculative.draft.n_max = 2
    p.hostnames, p.port = ["127.0.0.1"], 0
    return xl.Server(p)
