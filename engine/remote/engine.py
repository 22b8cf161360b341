"""A remote engine: an OpenAI-compatible server (llama-server, vLLM, SGLang, another Foretell) behind the same
event API as a local one — `generate(...)` streams `Token`, `Stats` (every ~250 ms and a final one) and `Done`.

tok/s and TTFT always come from this client's own clock (request sent → first text → last text); token counts
from the server's `usage` when it reports one; speculation from the best source the server offers
(engine.remote.spec_sources). Failures before the first token raise a typed `RemoteError`; a failure after it
ends the reply with `Done("interrupted", why)`, so what was received is kept and can be marked.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


from engine.events import Done, Event, GenerationConfig, SpeculativeStats, Stats, Token
from engine.remote import spec_sources
from engine.remote.errors import RemoteError, RemoteModelError, RemoteProtocolError
from engine.remote.http import Reply, Wire, sse_events

# Servers that take MTP on/off and a draft depth per request (Foretell's `mtp` field). llama-server reads
# `speculative.n_max` per request in its source, but the tested build (xllamacpp 2026.10.11549) drafted the same
# with 0, 1 and 2: there MTP stays the server's setting rather than a control that does nothing.
_PER_REQUEST_MTP = ("foretell",)
LIVE_SCRAPE_S = 1.0
_OWNERS = {"llamacpp": "llama.cpp", "vllm": "vllm", "sglang": "sglang", "foretell": "foretell"}


@dataclass(frozen=True)
class RemoteConfig:
    url: str  # base URL: http://host:port or …/v1
    api_key: str | None = None
    model: str | None = None  # one of the server's /v1/models ids; None = its first
    name: str = ""  # what the app's model menu calls this engine; "" = host and model
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0  # a long prompt on a busy cluster may take minutes before its first token


@dataclass
class _Received:
    """What one streamed reply has brought so far."""

    t_start: float
    t_first: float = 0.0
    t_last: float = 0.0
    chunks: int = 0  # chunks that carried text: the token count when the server reports no usage
    ids: list[int] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    thinking: bool = False  # inside a reasoning block (reasoning_content), rendered as <think>…</think>
    scraped: float = 0.0  # when /metrics was last read for the live figures
    live: SpeculativeStats | None = None


class RemoteEngine:
    """One model on one server. `connect` checks the server and the model; `generate` streams a reply."""

    def __init__(self, config: RemoteConfig):
        self.config = config
        self.wire = Wire(config.url, config.api_key, config.connect_timeout_s, config.read_timeout_s)
        self.models: list[str] = []
        self.server = "openai-compatible"  # llama.cpp | vllm | sglang | foretell, from /v1/models' owned_by
        self.model = config.model or ""
        self.n_ctx: int | None = None
        self.counters_at_connect: spec_sources.Counters | None = None
        self.has_gauges = False
        self.notices: list[str] = []

    @property
    def name(self) -> str:
        return self.config.name or f"{self.model} @ {self.wire.where}"

    @property
    def mtp_per_request(self) -> bool:
        """Whether MTP on/off and depth are sent with each request (else they are the server's setting)."""
        return self.server in _PER_REQUEST_MTP

    def connect(self) -> "RemoteEngine":
        listing = self.wire.get_json("/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
            raise RemoteProtocolError(f"{self.wire.where}/v1/models is not an OpenAI model list")
        self.models = [str(m["id"]) for m in data]
        if not self.models:
            raise RemoteModelError(f"{self.wire.where} serves no model")
        if not self.model:
            self.model = self.models[0]
        elif self.model not in self.models:
            raise RemoteModelError(f"{self.wire.where} does not serve {self.model!r}; it serves "
                                   f"{', '.join(self.models[:8])}")
        entry = data[self.models.index(self.model)]
        self.server = _OWNERS.get(str(entry.get("owned_by", "")).lower(), "openai-compatible")
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        ctx = meta.get("n_ctx") or entry.get("max_model_len")
        self.n_ctx = int(ctx) if isinstance(ctx, (int, float)) and not isinstance(ctx, bool) else None
        text = self.wire.get_text("/metrics", root=True)
        self.counters_at_connect = spec_sources.counters(text)
        self.has_gauges = spec_sources.gauges(text) is not None
        if not self.mtp_per_request:
            self.notices.append(f"MTP on/off and draft depth are the {self.server} server's own setting "
                                "(it does not take them per request)")
        return self

    # -- one reply ---------------------------------------------------------------------------------------------
    def generate(self, prompt: Sequence[Any] | str, gen: GenerationConfig = GenerationConfig(),
                 stop: threading.Event | None = None) -> Iterator[Event]:
        stop = stop or threading.Event()
        chat = not isinstance(prompt, str) and not (prompt and isinstance(prompt[0], int))
        body = self._body(prompt, gen, chat)
        before = self._scrape() if self.counters_at_connect is not None else None
        reply = _Received(t_start=time.perf_counter())
        resp = self.wire.stream("/chat/completions" if chat else "/completions", body)
        done_reading = threading.Event()
        threading.Thread(target=_shutdown_on_stop, args=(resp, stop, done_reading), daemon=True).start()
        last_stats = reply.t_start
        try:
            try:
                for ev in sse_events(resp):
                    if ev is None:
                        break
                    n_ids = len(reply.ids)
                    for i, text in enumerate(self._read_chunk(ev, reply, chat)):
                        yield Token(reply.ids[n_ids:] if i == 0 else [], text)  # a chunk's ids go with its text
                    now = time.perf_counter()
                    if reply.chunks and now - last_stats >= gen.stats_interval_s:
                        last_stats = now
                        yield self._stats(reply, self._live(reply, before), final=False)
            except RemoteError as e:
                if stop.is_set():  # the read was cut by _shutdown_on_stop
                    yield from self._finish(reply, before, "stopped", "")
                    return
                yield from self._cut(reply, before, e)
                return
        finally:
            done_reading.set()
            resp.close()
        if stop.is_set():
            yield from self._finish(reply, before, "stopped", "")
        elif reply.finish is None:
            yield from self._cut(reply, before, RemoteProtocolError(
                f"{self.wire.where} ended the stream before the reply was finished"))
        else:
            yield from self._finish(reply, before, _done_reason(reply.finish), "")

    def _body(self, prompt: Sequence[Any] | str, gen: GenerationConfig, chat: bool) -> dict[str, Any]:
        s = gen.sampling
        body: dict[str, Any] = {"model": self.model, "max_tokens": gen.max_tokens, "temperature": s.temperature,
                                "top_p": s.top_p, "stream": True, "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [_message(m) for m in prompt]
            if gen.enable_thinking is not None:
                body["chat_template_kwargs"] = {"enable_thinking": gen.enable_thinking}
        else:
            body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        if s.top_k:
            body["top_k"] = s.top_k
        if s.min_p:
            body["min_p"] = s.min_p
        if s.repeat_penalty != 1.0:
            key = "repetition_penalty" if self.server in ("vllm", "sglang") else "repeat_penalty"
            body[key] = s.repeat_penalty
        if s.seed is not None:
            body["seed"] = s.seed
        if gen.stop_strings:
            body["stop"] = list(gen.stop_strings)
        if self.server == "foretell":
            body["mtp"] = (gen.draft or True) if gen.mtp else False
        elif self.server == "vllm":
            body["return_token_ids"] = True  # vLLM adds each chunk's token_ids (older versions ignore the field)
        return body

    def _read_chunk(self, ev: dict[str, Any], reply: _Received, chat: bool) -> list[str]:
        if "error" in ev:  # an error sent inside the stream (after the 200 status)
            err = ev["error"]
            raise RemoteProtocolError(f"{self.wire.where} reported an error mid-reply: "
                                      f"{err.get('message') if isinstance(err, dict) else err}")
        if isinstance(ev.get("usage"), dict):
            reply.usage = ev["usage"]
        if isinstance(ev.get("timings"), dict):
            reply.timings = ev["timings"]
        if isinstance(ev.get("metrics"), dict):
            reply.metrics = ev["metrics"]
        texts: list[str] = []
        for choice in ev.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                reply.finish = str(choice["finish_reason"])
            ids = choice.get("token_ids") or ev.get("tokens")
            if isinstance(ids, list):
                reply.ids += [int(i) for i in ids if isinstance(i, int)]
            if chat:
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                content = delta.get("content") or ""
            else:
                reasoning, content = "", choice.get("text") or ""
            # reasoning arrives apart from the content; the event API carries one text, as a local model's
            if reasoning:
                texts.append(("" if reply.thinking else "<think>\n") + reasoning)
                reply.thinking = True
            if content:
                texts.append(("\n</think>\n\n" if reply.thinking else "") + content)
                reply.thinking = False
        if texts:
            now = time.perf_counter()
            reply.t_first = reply.t_first or now
            reply.t_last = now
            reply.chunks += 1
        return texts

    def _cut(self, reply: _Received, before: spec_sources.Counters | None, err: RemoteError) -> Iterator[Event]:
        """A failure: before any text it is raised; after, the partial reply ends with Done("interrupted")."""
        if not reply.chunks:
            raise err
        yield from self._finish(reply, before, "interrupted", f"{err} — the reply so far is kept")

    def _finish(self, reply: _Received, before: spec_sources.Counters | None, reason: str,
                message: str) -> Iterator[Event]:
        if reply.thinking:
            yield Token([], "\n</think>\n\n")
        spec = self._speculation(reply, before)
        if reply.usage is None and reason not in ("stopped", "interrupted"):
            note = f"{self.wire.where} reported no token usage: counts are streamed chunks"
            if note not in self.notices:
                self.notices.append(note)
        yield self._stats(reply, spec, final=True)
        yield Done(reason, message)

    def _speculation(self, reply: _Received, before: spec_sources.Counters | None) -> SpeculativeStats | None:
        per_request = spec_sources.from_timings(reply.timings) or spec_sources.from_request_metrics(reply.metrics)
        text = self.wire.get_text("/metrics", root=True) if before is not None or self.has_gauges else None
        delta = spec_sources.from_counter_delta(before, spec_sources.counters(text)) if before else None
        if per_request is not None:
            return spec_sources.with_depths(per_request, delta)
        spec = delta or spec_sources.from_gauges(spec_sources.gauges(text))
        if spec is None and self.server == "sglang":
            try:
                spec = spec_sources.from_server_info(self.wire.get_json("/server_info", root=True))
            except RemoteError:
                spec = None
        return spec

    def _live(self, reply: _Received, before: spec_sources.Counters | None) -> SpeculativeStats | None:
        """Acceptance while the reply streams, for the live charts: the /metrics delta so far (server-wide),
        scraped at most once a second — per-request figures only come with the last chunk."""
        now = time.perf_counter()
        if before is None or now - reply.scraped < LIVE_SCRAPE_S:
            return reply.live
        reply.scraped = now
        reply.live = spec_sources.from_counter_delta(before, self._scrape()) or reply.live
        return reply.live

    def _scrape(self) -> spec_sources.Counters | None:
        return spec_sources.counters(self.wire.get_text("/metrics", root=True))

    def _stats(self, reply: _Received, spec: SpeculativeStats | None, *, final: bool) -> Stats:
        usage, timings = reply.usage or {}, reply.timings or {}
        prompt = int(usage.get("prompt_tokens") or timings.get("prompt_n", 0) + timings.get("cache_n", 0) or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or timings.get("cache_n") or 0)
        generated = int(usage.get("completion_tokens") or timings.get("predicted_n") or reply.chunks)
        ttft = (reply.t_first or time.perf_counter()) - reply.t_start
        decode_s = reply.t_last - reply.t_first
        return Stats(
            prompt_tokens=prompt, prefill_tokens=max(prompt - cached, 0), generated_tokens=generated, ttft_s=ttft,
            prefill_tok_s=(prompt - cached) / ttft if ttft > 0 and prompt > cached else 0.0,
            decode_tok_s=(generated - 1) / decode_s if decode_s > 0 and generated > 1 else 0.0,
            elapsed_s=time.perf_counter() - reply.t_start, cache_bytes=0, state_bytes=0, final=final,
            mtp=spec is not None, speculative=spec)


def connect(config: RemoteConfig) -> RemoteEngine:
    """A remote engine, checked: the server answers, the key is accepted, the model is served."""
    return RemoteEngine(config).connect()


def list_models(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """The ids a server lists on /v1/models (for a model picker)."""
    return connect(RemoteConfig(url, api_key, connect_timeout_s=timeout_s, read_timeout_s=timeout_s)).models


def _message(m: Any) -> dict[str, str]:
    if isinstance(m, dict):
        return {"role": str(m["role"]), "content": str(m["content"])}
    return {"role": m.role, "content": m.content}


def _done_reason(finish: str) -> str:
    return {"length": "max_tokens", "stop": "eos", "eos": "eos"}.get(finish, finish)


def _shutdown_on_stop(resp: Reply, stop: threading.Event, done: threading.Event) -> None:
    """Stop is honoured at once, even while the server is still computing the prompt: shut the connection down
    (the server then aborts the request), and the blocked read returns."""
    while not done.is_set():
        if stop.wait(0.1):
            resp.shutdown()
            return
