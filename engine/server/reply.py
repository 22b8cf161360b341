"""One reply as the routes send it: its text split into thinking, content and tool calls (`ReplyText`), each
token's log-probabilities beside it, and OpenAI's shapes of it, streamed as chunks or whole (`OpenAIReply`).

A tool call reaches the client only whole and checked: its markup is held until it closes, then parsed and its
arguments validated against the function's schema (engine.tools). A valid call goes out as OpenAI sends one
streamed — a first delta with its id, type, name and empty arguments, then the arguments — and makes the
finish_reason "tool_calls". An invalid one is never passed on as a call: its markup stays in the content and
`tool_call_errors` (an extension beside content) says what is wrong with it.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from engine.events import Done, Stats, Token, TokenLogprob
from engine.server import protocol
from engine.server.protocol import APIError, Request, Tools
from engine.server.reasoning import ReasoningSplitter
from engine.server.scheduler import Failure, Job
from engine.tools import CallSplitter, ToolCall, ToolCallError, ToolFormat, parse_call

MIN_LOGPROB = -9999.0  # OpenAI's floor: a probability that underflowed to 0 is still a JSON number


@dataclass(frozen=True)
class CallSetup:
    """A request's tools as this model writes calls: its format, and the call opening prefilled ahead of the reply
    when tool_choice forces a call ("" otherwise)."""

    tools: Tools
    fmt: ToolFormat
    prefill: str = ""


@dataclass
class Piece:
    """What a stretch of the reply adds."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per invalid call, whose markup is in `content`
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def shows(self) -> bool:
        return bool(self.reasoning or self.content or self.calls or self.errors)


class ReplyText:
    """Streamed reply text in, Pieces out: thinking split off (with a `splitter`), then tool calls parsed out of the
    content (with `calls`; past the first when only one may be made, calls are dropped)."""

    def __init__(self, splitter: ReasoningSplitter | None, calls: CallSetup | None = None):
        self.splitter, self.setup = splitter, calls
        self.calls = CallSplitter() if calls is not None else None
        if self.calls is not None and calls is not None:
            self.calls.push(calls.prefill)  # the forced call's opening: the reply goes on inside it
        self.made = 0  # calls made, valid or not

    def push(self, ev: Token) -> Piece:
        piece = self._split(ev.text, final=False)
        piece.logprobs = list(ev.logprobs)
        return piece

    def finish(self) -> Piece:
        return self._split("", final=True)

    def _split(self, text: str, final: bool) -> Piece:
        reasoning, content = ("", text) if self.splitter is None else self.splitter.push(text)
        if final and self.splitter is not None:
            r, c = self.splitter.flush()
            reasoning, content = reasoning + r, content + c
        piece = Piece(reasoning)
        if self.calls is None or self.setup is None:
            piece.content = content
            return piece
        for item in self.calls.push(content) + (self.calls.flush() if final else []):
            if isinstance(item, str):
                piece.content += item
            elif not (self.setup.tools.single and self.made):
                self.made += 1
                try:
                    piece.calls.append(parse_call(self.setup.fmt, item, self.setup.tools.schemas))
                except ToolCallError as e:
                    piece.content += item.markup
                    piece.errors.append(str(e))
        return piece


async def gather(job: Job, text: ReplyText) -> tuple[list[Piece], Stats | None, Done]:
    """A whole reply: its pieces (the last one what `text` held back), its final Stats and its Done; a failure of
    the engine is a 500."""
    pieces: list[Piece] = []
    final: Stats | None = None
    done = Done("stopped")
    async for ev in job.events():
        if isinstance(ev, Token):
            pieces.append(text.push(ev))
        elif isinstance(ev, Stats):
            final = ev
        elif isinstance(ev, Done):
            done = ev
        elif isinstance(ev, Failure):
            raise APIError(500, ev.message, type="server_error")
    return pieces + [text.finish()], final, done


class OpenAIReply:
    """One chat or text completion's id, shapes and assembly, streamed or whole."""

    def __init__(self, req: Request, model: str, text: ReplyText, token_bytes: Callable[[int], bytes]):
        self.req, self.model, self.text, self.token_bytes = req, model, text, token_bytes
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if req.chat else "text_completion"
        self.n_calls = 0
        self.offset = 0  # text completions: where the next token's text starts

    # -- parts ---------------------------------------------------------------------------------------------------
    def _call(self, call: ToolCall) -> dict[str, Any]:
        self.n_calls += 1
        return {"index": self.n_calls - 1, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw)}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.req.gen.logprobs is None:
            return None
        if self.req.chat:
            return {"content": [{**self._token(t.token, t.logprob), "top_logprobs": [self._token(i, v) for i, v in t.top]}
                                for t in lps]}
        tokens = [self._token(t.token, t.logprob) for t in lps]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t["token"])
        return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": [{self._token(i, v)["token"]: max(v, MIN_LOGPROB) for i, v in t.top} for t in lps],
                "text_offset": offsets}

    def _choice(self, piece: Piece, finish: str | None, *, delta: bool,
                calls: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        logprobs = self._logprobs(piece.logprobs)
        if not self.req.chat:
            return {"index": 0, "text": piece.content, "logprobs": logprobs, "finish_reason": finish}
        msg: dict[str, Any] = {}
        if not delta:
            msg = {"role": "assistant", "content": piece.content or (None if calls else "")}
        elif piece.content:
            msg["content"] = piece.content
        if piece.reasoning:
            msg["reasoning_content"] = piece.reasoning
        if calls:
            msg["tool_calls"] = list(calls)
        if piece.errors:
            msg["tool_call_errors"] = piece.errors
        return {"index": 0, ("delta" if delta else "message"): msg, "logprobs": logprobs, "finish_reason": finish}

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.req.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _finish(self, done: Done) -> str:
        return protocol.finish_reason(done.reason, calls=self.n_calls > 0)

    # -- whole and streamed ------------------------------------------------------------------------------------
    async def collect(self, job: Job) -> dict[str, Any]:
        pieces, final, done = await gather(job, self.text)
        whole = Piece()
        for piece in pieces:
            _add(whole, piece)
        calls = [self._call(c) for c in whole.calls]
        out = self._envelope([self._choice(whole, self._finish(done), delta=False, calls=calls)], chunk=False)
        if final is not None:
            out["usage"], out["timings"] = protocol.usage(final), protocol.timings(final)
        return out

    async def stream(self, job: Job) -> AsyncIterator[str]:
        if self.req.chat:
            first = self._choice(Piece(), None, delta=True)
            first["delta"], first["logprobs"] = {"role": "assistant", "content": ""}, None
            yield self._sse(self._envelope([first], chunk=True))
        final: Stats | None = None
        done = Done("stopped")
        held = Piece()  # log-probabilities of tokens whose text is not shown yet
        async for ev in job.events():
            if isinstance(ev, Token):
                piece = self.text.push(ev)
                piece.logprobs = held.logprobs + piece.logprobs
                if not piece.shows():
                    held = piece
                    continue
                held = Piece()
                for chunk in self._chunks(piece):
                    yield chunk
            elif isinstance(ev, Stats):
                final = ev
            elif isinstance(ev, Done):
                done = ev
            elif isinstance(ev, Failure):
                yield self._sse(APIError(500, ev.message, type="server_error").body())
                return
        piece = self.text.finish()
        piece.logprobs = held.logprobs
        if piece.calls:
            for chunk in self._chunks(piece):
                yield chunk
            piece = Piece()
        last = self._envelope([self._choice(piece, self._finish(done), delta=True)], chunk=True)
        if final is not None:
            last["timings"] = protocol.timings(final)
        yield self._sse(last)
        if self.req.include_usage and final is not None:
            yield self._sse({**self._envelope([], chunk=True), "usage": protocol.usage(final)})
        yield "data: [DONE]\n\n"

    def _chunks(self, piece: Piece) -> list[str]:
        """A piece as chunks: its text, then per call the delta that opens it and the one with its arguments."""
        out = [self._sse(self._envelope([self._choice(_without_calls(piece), None, delta=True)], chunk=True))] \
            if piece.reasoning or piece.content or piece.errors or piece.logprobs else []
        for call in piece.calls:
            opened = self._call(call)
            arguments = opened["function"]["arguments"]
            opened["function"]["arguments"] = ""
            for part in (opened, {"index": opened["index"], "function": {"arguments": arguments}}):
                out.append(self._sse(self._envelope([self._choice(Piece(), None, delta=True, calls=[part])],
                                                    chunk=True)))
        return out

    def _sse(self, payload: dict[str, Any]) -> str:
        if self.req.include_usage and "choices" in payload and "usage" not in payload:
            payload["usage"] = None  # OpenAI's shape: every chunk but the last carries a null usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _without_calls(piece: Piece) -> Piece:
    """`piece` without its calls (they go in chunks of their own)."""
    return Piece(piece.reasoning, piece.content, [], piece.errors, piece.logprobs)


def _add(whole: Piece, piece: Piece) -> None:
    whole.reasoning += piece.reasoning
    whole.content += piece.content
    whole.calls += piece.calls
    whole.errors += piece.errors
    whole.logprobs += piece.logprobs
