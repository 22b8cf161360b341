"""The OpenAI wire format: request bodies checked field by field into engine configs, and the response parts
(usage, llama-server's `timings`, finish reasons, error bodies).

Validation is hand-written rather than a schema library: the few fields are checked with messages that name
the field, bools are never taken for numbers (JSON `true` is not 1), and unknown fields are ignored as
OpenAI clients send many. A field the engine cannot honour (n > 1, logit_bias, penalties, functions) is refused
with 400 rather than silently ignored. `response_format` json_object and json_schema become a constraint the
engine enforces token by token (engine.constrain); a schema it cannot compile is a 400 saying why. Tools are
checked here too: each function's name, and its parameters as a JSON schema (jsonschema), so that a call can be
checked against it later. The body as a whole must be plain JSON: no NaN or Infinity, no nesting past what the
parser takes, no string (or key) that is not Unicode (a lone surrogate such as "\\ud800").
The limits are engine.validate's: a request is a 400 here, never a failure in the engine.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from jsonschema.exceptions import SchemaError

from engine import tools as toolkit
from engine import validate
from engine.constrain import Constraint
from engine.errors import InvalidParameterError
from engine.events import GenerationConfig, Stats
from engine.sampling import SamplingConfig

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOOLS = 128  # OpenAI's limit on a request's tools
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule; it also keeps a forced call's prefill plain text


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Tools:
    """A request's tools, checked: what the template is given, each function's parameters schema by name, and
    what `tool_choice` asks: "auto" (the model decides), "required" (a call, of any function) or one function's
    name; `parallel`: more than one call may be made."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, description, parameters}}
    schemas: dict[str, dict[str, Any]]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> str | None:
        """The function a call must be of, or None."""
        return self.choice if self.choice not in ("auto", "required") else None

    @property
    def single(self) -> bool:
        """At most one call is made: one function's, or parallel calls turned off."""
        return self.forced is not None or not self.parallel


@dataclass(frozen=True)
class Request:
    """One generation request, validated: the prompt (chat messages, text, or token ids) and how to generate."""

    chat: bool
    prompt: list[dict[str, Any]] | str | list[int]
    gen: GenerationConfig
    max_tokens: int | None  # None: the server's default (its GenerationConfig's)
    stream: bool
    include_usage: bool
    enable_thinking: bool | None
    tools: Tools | None = None  # None: no tools, or tool_choice "none"


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # ints past 4300 digits too
        raise bad(f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    where = _not_unicode(body)
    if where is not None:
        raise bad(f"{where or 'a key'} holds a lone surrogate (such as \\ud800): it is not Unicode text", where or None,
                  "invalid_json")
    return body


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _not_unicode(body: dict[str, Any]) -> str | None:
    """Where the first string that is not valid Unicode is ('messages[0].content'; '' for a key), or None."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _unicode(value):
                return _path(path)
        elif isinstance(value, dict):
            for k, v in value.items():
                if not _unicode(k):
                    return ""
                stack.append((v, (path, k)))
        elif isinstance(value, list):
            stack.extend((v, (path, i)) for i, v in enumerate(value))
    return None


def _unicode(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(path: tuple[Any, ...]) -> str:
    """A (parent, key) chain as a param name: messages[0].content."""
    keys = []
    while path:
        path, key = path
        keys.append(key)
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys)).lstrip(".")


def parse_chat(body: dict[str, Any], defaults: GenerationConfig) -> Request:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    if len(msgs) > validate.MAX_MESSAGES:
        raise bad(f"{len(msgs)} messages are too many: at most {validate.MAX_MESSAGES}", "messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    max_tokens = _int(body, "max_completion_tokens", 1, validate.MAX_TOKENS)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, validate.MAX_TOKENS)
    thinking = _bool(_object(body, "chat_template_kwargs"), "enable_thinking", "chat_template_kwargs")
    _off(body, "functions", [])
    constraint = parse_response_format(body.get("response_format"))
    logprobs = _bool(body, "logprobs", "logprobs")
    top = _int(body, "top_logprobs", 0, validate.MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    req = _request(body, defaults, chat=True, prompt=messages, max_tokens=max_tokens, enable_thinking=thinking,
                   logprobs=(top or 0) if logprobs else None)
    tools = parse_tools(body.get("tools"), body.get("tool_choice"),
                        _bool(body, "parallel_tool_calls", "parallel_tool_calls"))
    if tools is not None and constraint is not None:
        raise bad("a JSON 'response_format' leaves no room for tool calls: send 'tool_choice': 'none' or no 'tools'",
                  "response_format")
    return replace(req, tools=tools, gen=replace(req.gen, constraint=constraint))


def parse_response_format(fmt: Any) -> Constraint | None:
    """`response_format`: None for text; json_object (any JSON object) or json_schema ({"name", "schema",
    "strict"}) as the constraint the engine decodes under, whether or not `strict` is set."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                  "response_format", "unsupported_parameter")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("'response_format.json_schema' must be an object whose 'schema' is a JSON schema object",
                  "response_format.json_schema")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not TOOL_NAME.fullmatch(name)):
        raise bad("'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
                  "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema", {})
    try:
        return toolkit.schema_constraint(schema)
    except InvalidParameterError as e:
        raise bad(f"'response_format.json_schema.schema' is not a schema this server can enforce: {e}",
                  "response_format.json_schema.schema") from None


def parse_tools(tools: Any, choice: Any, parallel: bool | None) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None when no call can be made."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' asks for a call but the request has no 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
    given: list[dict[str, Any]] = []
    schemas: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        name, params = f.get("name"), f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'", f"tools[{i}].function.name")
        if name in schemas:
            raise bad(f"two tools are named {name!r}", f"tools[{i}].function.name")
        if not isinstance(f.get("description") or "", str):
            raise bad(f"tools[{i}].function.description must be a string", f"tools[{i}].function.description")
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        try:
            toolkit.check_schema(params)
        except (SchemaError, RecursionError) as e:
            raise bad(f"tools[{i}].function.parameters is not a valid JSON schema: {str(e).splitlines()[0][:300]}",
                      f"tools[{i}].function.parameters") from None
        schemas[name] = params
        given.append({"type": "function", "function": {"name": name, "description": f.get("description") or "",
                                                        "parameters": params}})
    if choice in (None, "auto", "required"):
        picked = choice or "auto"
    elif choice == "none":
        return None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and choice["function"].get("name") in schemas:
        picked = choice["function"]["name"]
    else:
        raise bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                  "{\"name\": NAME}} naming one of the tools", "tool_choice")
    return Tools(tuple(given), schemas, picked, True if parallel is None else parallel)


def parse_completion(body: dict[str, Any], defaults: GenerationConfig) -> Request:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string", "prompt")
    for name, off in (("echo", False), ("suffix", ""), ("best_of", 1)):
        _off(body, name, off)
    max_tokens = _int(body, "max_tokens", 1, validate.MAX_TOKENS)
    return _request(body, defaults, chat=False, prompt=prompt, max_tokens=16 if max_tokens is None else max_tokens,
                    enable_thinking=None, logprobs=_int(body, "logprobs", 0, validate.MAX_TOP_LOGPROBS))


def _request(body: dict[str, Any], defaults: GenerationConfig, *, chat: bool, prompt: Any, max_tokens: int | None,
             enable_thinking: bool | None, logprobs: int | None) -> Request:
    for name, off in (("n", 1), ("logit_bias", {})):
        _off(body, name, off)
    for name in ("presence_penalty", "frequency_penalty"):
        if _float(body, name, -2.0, 2.0) not in (None, 0.0):
            raise bad(f"'{name}' is not supported; use 'repeat_penalty'", name, "unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    s = defaults.sampling
    seed = _int(body, "seed", -1, validate.MAX_SEED)  # -1: a random seed (llama-server's convention)
    temperature = _float(body, "temperature", 0.0, 2.0)
    if temperature and temperature < validate.MIN_LOGIT_DIVISOR:
        raise bad(f"'temperature' must be 0 (greedy) or at least {validate.MIN_LOGIT_DIVISOR:g}", "temperature")
    sampling = SamplingConfig(
        temperature=_or(temperature, s.temperature),
        top_k=_or(_int(body, "top_k", 0, validate.MAX_TOP_K), s.top_k),
        top_p=_or(_float(body, "top_p", 0.0, 1.0, low_open=True), s.top_p),
        min_p=_or(_float(body, "min_p", 0.0, 1.0), s.min_p),
        repeat_penalty=_or(_float(body, "repeat_penalty", validate.MIN_LOGIT_DIVISOR, 10.0), s.repeat_penalty),
        repeat_last_n=s.repeat_last_n,
        seed=s.seed if seed is None else None if seed == -1 else seed,
    )
    mtp, draft = _mtp(body.get("mtp"), defaults)
    stream = _bool(body, "stream", "stream") or False
    include_usage = _bool(_object(body, "stream_options"), "include_usage", "stream_options") or False
    gen = replace(defaults, sampling=sampling, stop_strings=_stop(body.get("stop")), mtp=mtp, draft=draft,
                  enable_thinking=enable_thinking, logprobs=logprobs)
    return Request(chat=chat, prompt=prompt, gen=gen, max_tokens=max_tokens, stream=stream,
                   include_usage=include_usage, enable_thinking=enable_thinking)


def _message(m: Any, i: int) -> dict[str, Any]:
    """One chat message as the template takes it: role and text content; an assistant's tool calls (their
    arguments as objects, as templates render them); a tool result's tool_call_id."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{param} must be an object with 'role' and 'content'", param)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"{param}.role is {validate.shown(role)}; this server takes {', '.join(sorted(ROLES))}",
                  f"{param}.role")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad(f"{param}.content: only text parts are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"{param}.content must be a string or an array of text parts", f"{param}.content")
    out: dict[str, Any] = {"role": ROLES[role], "content": content}
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{param}.tool_calls")
    if role == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise bad(f"{param}.tool_call_id must be a string", f"{param}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad(f"{param} must be an array of tool calls", param)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(c.get("id", ""), str):
            raise bad(f"{param}[{j}] must be {{\"id\": ID, \"type\": \"function\", \"function\": "
                      "{\"name\": NAME, \"arguments\": JSON}}", f"{param}[{j}]")
        args = f.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise bad(f"{param}[{j}].function.arguments must be a JSON object (as a string)",
                      f"{param}[{j}].function.arguments")
        out.append({"id": c.get("id", f"call_{j}"), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    """An optional object field ({} when left out)."""
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise bad(f"'{name}' must be an object", name)
    return v or {}


def _bool(body: dict[str, Any], name: str, param: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{param}{'' if param == name else '.' + name}' must be true or false", param)
    return v


def _off(body: dict[str, Any], name: str, off: Any) -> None:
    """A field this server cannot honour: only left out, null, or its 'off' value (of that JSON type) is taken."""
    v = body.get(name)
    if v is not None and (type(v) is not type(off) or v != off):
        raise bad(f"'{name}' is not supported by this server (only {json.dumps(off)})", name, "unsupported_parameter")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _int(body: dict[str, Any], name: str, low: int, high: int = 2**63 - 1) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(f"'{name}' must be an integer", name)
    if not low <= v <= high:
        raise bad(f"'{name}' must be in [{low}, {high}], got {validate.shown(v)}", name)
    return v


def _float(body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
        raise bad(f"'{name}' must be a number", name)
    if v > high or v < low or (low_open and v == low):  # compared as they are: an int may be past any float
        lo = "(" if low_open else "["
        raise bad(f"'{name}' must be in {lo}{low:g}, {high:g}], got {validate.shown(v)}", name)
    return float(v)


def _stop(value: Any) -> tuple[str, ...]:
    """A string or an array of strings; empty ones are dropped (they stop nothing), the rest within the engine's
    limits (each is searched for after every token)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or an array of strings", "stop")
    try:
        return validate.stop_strings([s for s in items if s])
    except InvalidParameterError as e:
        raise bad(f"'stop': {e}", "stop") from None


def _mtp(value: Any, defaults: GenerationConfig) -> tuple[bool, int | None]:
    """The `mtp` extension: false (plain decoding), true (auto depth) or a draft depth 1..MAX_DRAFT."""
    if value is None:
        return defaults.mtp, defaults.draft
    if isinstance(value, bool):
        return value, None if value else defaults.draft
    if isinstance(value, int):  # a JSON number; a string ("3", "auto") is not a depth here
        try:
            return True, validate.parse_draft(value)
        except InvalidParameterError:
            pass
    raise bad(f"'mtp' must be false, true or a draft depth 1..{validate.MAX_DRAFT}", "mtp")


# -- response parts --------------------------------------------------------------------------------------------
def finish_reason(done_reason: str, calls: bool = False) -> str:
    """OpenAI's finish_reason for the engine's Done reason; `calls`: the reply made tool calls. A reply cut short is
    "length" even after whole calls (the next one was cut, its markup left in the content): a client that ran the
    calls as all there were would be wrong."""
    if done_reason in ("max_tokens", "context_full"):
        return "length"
    return "tool_calls" if calls else "stop"


def usage(st: Stats) -> dict[str, Any]:
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.generated_tokens,
            "total_tokens": st.prompt_tokens + st.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": st.prompt_tokens - st.prefill_tokens}}


def timings(st: Stats) -> dict[str, Any]:
    """llama-server's per-response `timings`: prompt = the tokens computed before the first one (the rest came
    from the cache), predicted = every generated token, timed after the first."""
    prompt_ms = st.ttft_s * 1000
    predicted_ms = max(st.elapsed_s - st.ttft_s, 0.0) * 1000
    spec = st.speculative
    return {
        "cache_n": st.prompt_tokens - st.prefill_tokens,
        "prompt_n": st.prefill_tokens, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / st.prefill_tokens if st.prefill_tokens else 0.0,
        "prompt_per_second": st.prefill_tok_s,
        "predicted_n": st.generated_tokens, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": 1000 / st.decode_tok_s if st.decode_tok_s else 0.0,
        "predicted_per_second": st.decode_tok_s,
        "draft_n": spec.drafted if spec else 0, "draft_n_accepted": spec.accepted if spec else 0,
        # what MTP gave: the decode rate over this reply's own plain steps' rate (auto runs some); None where none ran
        "mtp_plain_per_second": spec.plain_tok_s if spec and spec.plain_tok_s else None,
        "mtp_speedup": st.decode_tok_s / spec.plain_tok_s if spec and spec.plain_tok_s and st.decode_tok_s else None,
    }
