"""Anthropic's Messages API (`POST /v1/messages`) over the same generation: the body is read into an OpenAI chat
request (one set of checks, one prompt path), and the reply comes back in Anthropic's shape — content blocks
(thinking, text, tool_use), whole or as the server-sent events message_start, content_block_start /
_delta / _stop, message_delta and message_stop. Errors are Anthropic's {"type": "error", "error": {...}}.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from engine.events import Done, GenerationConfig, Stats, Token
from engine.server import protocol
from engine.server.protocol import APIError, Request, bad
from engine.server.reply import Piece, ReplyText, gather
from engine.server.scheduler import Failure, Job

STOP_REASONS = {"eos": "end_turn", "stop_string": "stop_sequence", "max_tokens": "max_tokens",
                "context_full": "max_tokens", "stopped": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def error_body(e: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def parse(body: dict[str, Any], defaults: GenerationConfig) -> Request:
    """A Messages API body as the chat request it asks for (max_tokens is required there)."""
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad("'max_tokens' is required: an integer", "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    chat: dict[str, Any] = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream") if k in body}
    chat["messages"] = _system(body.get("system")) + [m for i, msg in enumerate(msgs) for m in _message(msg, i)]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
            raise bad("'thinking' must be {\"type\": \"enabled\" | \"disabled\"}", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    chat.update(_tool_choice(body.get("tool_choice")))
    req = protocol.parse_chat(chat, defaults)
    return replace(req, include_usage=False)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system):
        system = "".join(b.get("text") for b in system if isinstance(b.get("text"), str))
    if not isinstance(system, str):
        raise bad("'system' must be a string or an array of text blocks", "system")
    return [{"role": "system", "content": system}]


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages API message as chat messages: a user turn's tool results become tool messages ahead of its
    text; an assistant turn's tool_use blocks become its tool calls."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"{param} must be an object whose role is 'user' or 'assistant'", f"{param}.role")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad(f"{param}.content must be a string or an array of content blocks", f"{param}.content")
    text, calls, results = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and m["role"] == "assistant":
            continue  # earlier thinking: the template keeps or drops it; the text goes as the turn's content
        elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("input"), dict):
            calls.append({"id": b.get("id"), "type": "function", "function": {"name": b.get("name"),
                                                                            "arguments": b["input"]}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": _result(b, f"{param}.content[{j}]")})
        else:
            raise bad(f"{param}.content[{j}]: this server takes text, tool_use (assistant) and tool_result (user) "
                      "blocks", f"{param}.content[{j}]")
    turn: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if text or calls or not results else [])


def _result(b: dict[str, Any], param: str) -> str:
    content = b.get("content", "")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(p.get("text") for p in content if isinstance(p.get("text"), str))
    if not isinstance(content, str):
        raise bad(f"{param}.content must be a string or an array of text blocks", f"{param}.content")
    return content


def _tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of tools", "tools")
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {"type": "object"})}}
            if isinstance(t, dict) else t for t in tools]


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {}
    if not isinstance(choice, dict) or choice.get("type") not in (*TOOL_CHOICES, "tool"):
        raise bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    out: dict[str, Any] = {"tool_choice": TOOL_CHOICES.get(choice["type"]) or
                           {"type": "function", "function": {"name": choice.get("name")}}}
    if choice.get("disable_parallel_tool_use") is not None:
        out["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    return out


class AnthropicReply:
    """One message's id, content blocks and events."""

    def __init__(self, model: str, text: ReplyText, prompt_tokens: int):
        self.model, self.text, self.prompt_tokens = model, text, prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks: list[dict[str, Any]] = []  # whole: the content; streamed: the blocks opened so far
        self.errors: list[str] = []

    def _message(self, content: list[dict[str, Any]], stop: str | None, output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens}}

    def _stop(self, done: Done) -> str:
        """A reply cut short says so (max_tokens) even after whole tool calls, as protocol.finish_reason does."""
        if done.reason not in ("max_tokens", "context_full") and any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use"
        return STOP_REASONS.get(done.reason, "end_turn")

    def _blocks(self, piece: Piece) -> list[tuple[str, str | dict[str, Any]]]:
        """(kind, text) for thinking and text, ("tool_use", block) per call, in the reply's order."""
        self.errors += piece.errors
        out: list[tuple[str, str | dict[str, Any]]] = [("thinking", piece.reasoning)] * bool(piece.reasoning)
        out += [("text", piece.content)] * bool(piece.content)
        out += [("tool_use", {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c.name,
                              "input": c.arguments}) for c in piece.calls]
        return out

    async def collect(self, job: Job) -> dict[str, Any]:
        pieces, final, done = await gather(job, self.text)
        for piece in pieces:
            self._gather(piece)
        out = self._message(self.blocks, self._stop(done), final.generated_tokens if final else 0)
        if self.errors:
            out["tool_call_errors"] = self.errors
        return out

    def _gather(self, piece: Piece) -> None:
        for kind, part in self._blocks(piece):
            last = self.blocks[-1] if self.blocks else None
            if kind == "tool_use":
                self.blocks.append(part)  # type: ignore[arg-type]
            elif last is not None and last["type"] == kind:
                last[kind] += part
            else:
                self.blocks.append({"type": kind, kind: part} | ({"signature": ""} if kind == "thinking" else {}))

    async def stream(self, job: Job) -> AsyncIterator[str]:
        yield _event("message_start", {"type": "message_start", "message": self._message([], None, 0)})
        final: Stats | None = None
        done = Done("stopped")
        open_kind: str | None = None
        async for ev in job.events():
            if isinstance(ev, (Token, Done)):
                piece = self.text.push(ev) if isinstance(ev, Token) else self.text.finish()
                for kind, part in self._blocks(piece):
                    if kind != open_kind or kind == "tool_use":
                        if open_kind is not None:
                            yield _event("content_block_stop", {"type": "content_block_stop",
                                                                "index": len(self.blocks) - 1})
                        start = dict(part, input={}) if kind == "tool_use" else \
                            {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
                        self.blocks.append(start)  # type: ignore[arg-type]
                        yield _event("content_block_start", {"type": "content_block_start",
                                                             "index": len(self.blocks) - 1, "content_block": start})
                        open_kind = kind
                    delta = {"type": "input_json_delta", "partial_json": json.dumps(part["input"])} \
                        if kind == "tool_use" else {"type": f"{kind}_delta", kind: part}  # type: ignore[index]
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                         "delta": delta})
                if isinstance(ev, Done):
                    done = ev
            elif isinstance(ev, Stats):
                final = ev
            elif isinstance(ev, Failure):
                yield _event("error", error_body(APIError(500, ev.message)))
                return
        if open_kind is not None:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})
        delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": self._stop(done),
                                                                    "stop_sequence": None},
                                 "usage": {"output_tokens": final.generated_tokens if final else 0}}
        if self.errors:
            delta["tool_call_errors"] = self.errors
        yield _event("message_delta", delta)
        yield _event("message_stop", {"type": "message_stop"})


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

