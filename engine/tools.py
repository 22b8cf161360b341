"""Tool calls in the model's own markup: how its chat template writes a call, the text that opens one, and the
reply's text split into prose and calls, each call checked against its function's JSON schema.

The Qwen family writes calls between <tool_call> and </tool_call> in one of two forms, and the template says
which: `tool_format` renders a probe conversation (one tool, one call) and reads the form off the text.
  xml  (Qwen3.5, Qwen3.6, Qwen3-Coder): <function=NAME> then <parameter=KEY>VALUE</parameter> per argument, the
       value as text (a string as is, anything else as JSON), then </function>;
  json (Qwen3, Qwen2.5, Hermes): {"name": NAME, "arguments": {...}}.
A template that renders no tools (the embedded model's plain ChatML) gets the json form written into the
conversation here (`written_in`): the tools described in the system message, calls and results as markup.
A call the request forces (tool_choice required or named) is decoded under `call_grammar`: the markup read off the
template, the arguments held to their function's schema.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jsonschema
from jsonschema.exceptions import best_match

from engine.chat import ChatFormat
from engine.constrain import JSON_LAYOUT, Constraint
from engine.errors import ChatTemplateError, InvalidParameterError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_XML_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)
_PYTHON_WORDS = {"True": True, "False": False, "None": None}  # Qwen3.5's template writes a bool with Python's str()

# the probe: names no conversation uses, so each is found where the template put it
_PROBE_NAME, _PROBE_ARG, _PROBE_VALUE = "probe_fn_5e1c", "probe_arg_93b7", "probe_value_0d2a"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe_description_7f30",
    "parameters": {"type": "object", "properties": {_PROBE_ARG: {"type": "string"}}}}}
_PROBE_MESSAGES = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {_PROBE_ARG: _PROBE_VALUE}}}]}]


@dataclass(frozen=True)
class ToolFormat:
    kind: str  # "xml" or "json" (the module docstring)
    head: str  # a call's text up to its function's name
    after_name: str  # between the name and the arguments
    native: bool  # the template renders tools and calls itself; False: `written_in` writes them into the messages
    close: str = "}\n" + CALL_CLOSE  # after the arguments to the end of the call (json: the call object's brace)
    open_value: str = ""  # xml: between a parameter's name and its value
    close_value: str = ""  # xml: after a parameter's value (to the next parameter or the function's end)

    def opening(self, name: str | None = None) -> str:
        """The text that opens a call (of function `name`): prefilled, it makes the reply a call."""
        return self.head if name is None else self.head + name + self.after_name


WRITTEN = ToolFormat("json", CALL_OPEN + '\n{"name": "', '", "arguments": ', native=False)


@functools.lru_cache(maxsize=8)
def tool_format(chat: ChatFormat) -> ToolFormat:
    """How `chat`'s template writes a call, read off its rendering of a probe call; WRITTEN when it renders none."""
    try:
        text = chat.render(_PROBE_MESSAGES, add_generation_prompt=False, tools=[_PROBE_TOOL])
    except ChatTemplateError:
        return WRITTEN
    name = text.rfind(_PROBE_NAME)  # the call's, after the tools' description
    start = text.rfind(CALL_OPEN, 0, name)
    if start < 0 or _PROBE_TOOL["function"]["description"] not in text:
        return WRITTEN
    head = text[start:name]
    kind, args = ("xml", "<parameter=" + _PROBE_ARG) if "<function=" in head else ("json", '{"' + _PROBE_ARG)
    end, value = text.find(args, name), text.find(_PROBE_VALUE, name)
    stop = text.find(CALL_CLOSE, value)
    if end < 0 or value < 0 or stop < 0:
        return WRITTEN
    stop += len(CALL_CLOSE)
    after_name = text[name + len(_PROBE_NAME):end]
    if kind == "json":  # the arguments object ends after the value's closing quote
        brace = text.find("}", value + len(_PROBE_VALUE))
        return ToolFormat(kind, head, after_name, True, text[brace + 1:stop]) if 0 <= brace < stop else WRITTEN
    function_end = text.find("</function>", value)
    if function_end < 0:
        return WRITTEN
    return ToolFormat(kind, head, after_name, True, text[function_end:stop], text[end + len(args):value],
                      text[value + len(_PROBE_VALUE):function_end])


# a text value's maxLength the grammar keeps (a counted repeat that long compiles fast); past it, any length
MAX_TEXT_BOUND = 4096


def call_grammar(fmt: ToolFormat, schemas: Mapping[str, Mapping[str, Any]], forced: str | None,
                 parallel: bool, lead: str = "") -> str:
    """What may follow a forced call's prefill (`fmt.opening(forced)`) as a Lark grammar (engine.constrain's
    Constraint.grammar_of): the call written as the template writes one, of `forced` or of any function, with
    arguments valid for the function's schema - json: the arguments object; xml: each parameter in the schema's
    order (the optional ones may be left out), a string's value as text up to the parameter's end, any other as JSON,
    and any others the schema leaves open, as text - then the call's end; where `parallel` and no function is forced,
    more calls after it. `lead`: text first (what follows CALL_OPEN in the opening, where the grammar starts after the
    tag: auto_call_grammar)."""
    names, rules = list(schemas), []
    for i, name in enumerate(names):
        extra: list[str] = []
        rules += [f"args{i}: {_arguments(fmt, schemas[name], i, extra)} {_lit(fmt.close)}", *extra]
    rules.append("call: " + " | ".join(f"{_lit(n + fmt.after_name)} args{i}" for i, n in enumerate(names)))
    first = f"args{names.index(forced)}" if forced is not None else "call"
    more = f" ({_lit(chr(10) + fmt.head)} call)*" if parallel and forced is None else ""
    return "\n".join([f"start: {_lit(lead) + ' ' if lead else ''}{first}{more}", *rules])


def auto_call_grammar(fmt: ToolFormat, schemas: Mapping[str, Mapping[str, Any]]) -> str:
    """A call the model chooses to make (tool_choice auto), from after its CALL_OPEN tag to its end: the lazy
    constraint's grammar (Constraint.lazy with CALL_OPEN as the trigger). One call: a next one opens with the tag
    again."""
    return call_grammar(fmt, schemas, None, False, fmt.head[len(CALL_OPEN):])


def _arguments(fmt: ToolFormat, schema: Mapping[str, Any], i: int, extra: list[str]) -> str:
    """The rule body of function i's arguments; rules it refers to are added to `extra` (each a line)."""
    if fmt.kind == "json":
        return _json(schema)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for j, (key, sub) in enumerate(props.items()):
        head = _lit("<parameter=" + key + fmt.open_value)
        if _raw_text(sub):  # a string's value as it stands, up to the parameter's end
            values = _strings(sub)
            if values:
                body = "(" + " | ".join(_lit(v) for v in values) + f") {_lit(fmt.close_value)}"
            else:  # up to the schema's maxLength characters (llguidance's JSON strings keep it too)
                most = sub.get("maxLength")
                bounded = isinstance(most, int) and not isinstance(most, bool) and 0 <= most <= MAX_TEXT_BOUND
                span = f"{{0,{most}}}" if bounded else "*"
                extra.append(f"v{i}_{j}[suffix={_lit(fmt.close_value)}]: /(?s:.{span})/")
                body = f"v{i}_{j}"
        elif isinstance(sub, Mapping) and sub.get("type") == "boolean":  # Qwen3.5 writes Python's True / False
            body = "(" + " | ".join(_lit(w) for w in ("True", "False", "true", "false")) + f") {_lit(fmt.close_value)}"
        else:
            body = f"{_json(sub)} {_lit(fmt.close_value)}"
        extra.append(f"p{i}_{j}: {head} {body}")
        parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
    if schema.get("additionalProperties", True) is not False:  # parameters the schema leaves open, as text
        extra += [f"x{i}: {_lit('<parameter=')} /[^>\\n]+/ {_lit(fmt.open_value)} xv{i}",
                  f"xv{i}[suffix={_lit(fmt.close_value)}]: /(?s:.*)/"]
        parts.append(f"x{i}*")
    return " ".join(parts)


def _raw_text(schema: Any) -> bool:
    """Whether the xml form's value is text as it stands: a schema a string satisfies (an enum or const of strings
    included; the parser reads such a value as text wherever it is not JSON)."""
    if not isinstance(schema, Mapping):
        return False
    declared = schema.get("type")
    if declared == "string" or (isinstance(declared, list) and "string" in declared):
        return True
    return declared is None and bool(_strings(schema))


def _strings(schema: Mapping[str, Any]) -> list[str]:
    """The values of an enum or const of strings only (none otherwise)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return list(values) if isinstance(values, list) and values and all(isinstance(v, str) for v in values) else []


def _json(schema: Any) -> str:
    """An inline JSON schema in the layout chat templates write (tojson: ", " and ": ")."""
    body = dict(schema) if isinstance(schema, Mapping) else {}
    return "%json " + json.dumps({**body, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def written_in(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template that renders no tools: the tools described in the system message, each
    assistant's calls appended to its text and each tool result sent as a user message, in the json markup."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    guide = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
             f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each "
             "function call, return a json object with function name and arguments within "
             f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
             '{"name": <function-name>, "arguments": <args-json-object>}\n' + CALL_CLOSE)
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"{RESPONSE_OPEN}\n{m['content']}\n{RESPONSE_CLOSE}"})
        elif m.get("tool_calls"):
            calls = [f'{CALL_OPEN}\n{json.dumps(c["function"], ensure_ascii=False)}\n{CALL_CLOSE}' for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join([m["content"]] * bool(m["content"]) + calls)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{guide}"}
        else:
            out.insert(0, {"role": "system", "content": guide})
    return out


# -- the reply ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RawCall:
    """The text of one call between its tags; `closed`: its </tool_call> came (else the reply ended inside it)."""

    body: str
    closed: bool = True

    @property
    def markup(self) -> str:
        return CALL_OPEN + self.body + (CALL_CLOSE if self.closed else "")


class CallSplitter:
    """Streamed reply text in; prose and whole calls out, in order. Text that could open a call, and whitespace
    that may only separate calls, is held until what follows shows what it is."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False

    def push(self, text: str) -> list[str | RawCall]:
        self.buf += text
        out: list[str | RawCall] = []
        while True:
            if self.in_call:
                i = self.buf.find(CALL_CLOSE)
                if i < 0:
                    return out
                out.append(RawCall(self.buf[:i]))
                self.buf, self.in_call = self.buf[i + len(CALL_CLOSE):], False
                continue
            i = self.buf.find(CALL_OPEN)
            if i >= 0:
                before = self.buf[:i].rstrip()  # the whitespace that leads up to a call is not content
                out += [before] * bool(before)
                self.buf, self.in_call = self.buf[i + len(CALL_OPEN):], True
                continue
            keep = max((k for k in range(1, len(CALL_OPEN)) if self.buf.endswith(CALL_OPEN[:k])), default=0)
            keep += len(self.buf[:len(self.buf) - keep]) - len(self.buf[:len(self.buf) - keep].rstrip())
            if len(self.buf) > keep:
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
            return out

    def flush(self) -> list[str | RawCall]:
        """What is held at the end of the reply: a call cut short, or text."""
        out, self.buf = self.buf, ""
        if self.in_call:
            return [RawCall(out, closed=False)]
        return [out] if out.strip() else []


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A call that does not parse, names no given function, or whose arguments do not fit its schema."""


def check_schema(schema: Mapping[str, Any]) -> None:
    """jsonschema.SchemaError when `schema` is not a JSON schema (of the draft it names; 2020-12 by default)."""
    jsonschema.validators.validator_for(schema).check_schema(schema)


def schema_constraint(schema: Mapping[str, Any]) -> Constraint:
    """The constraint that holds a reply to `schema`: InvalidParameterError saying why where it is not a JSON schema
    (check_schema) or not one llguidance can enforce (Constraint.check). Callers put their own name for it first."""
    try:
        check_schema(schema)
    except (jsonschema.SchemaError, RecursionError) as e:
        raise InvalidParameterError(f"not a JSON schema: {str(e).splitlines()[0][:300]}") from None
    constraint = Constraint.json_schema(schema)
    constraint.check()
    return constraint


def parse_call(fmt: ToolFormat, raw: RawCall, tools: Mapping[str, Mapping[str, Any]]) -> ToolCall:
    """`raw` read in `fmt`'s form and checked against `tools` (name → its function's parameters schema)."""
    name, arguments = (_parse_xml if fmt.kind == "xml" else _parse_json)(raw, tools)
    schema = tools[name]
    error = best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments))
    if error is not None:
        where = "/".join(map(str, error.absolute_path))
        raise ToolCallError(f"the arguments of {name} do not fit its parameters' schema"
                            f"{f' at {where}' if where else ''}: {error.message}")
    return ToolCall(name, arguments)


def _known(name: str, tools: Mapping[str, Any]) -> str:
    if name not in tools:
        raise ToolCallError(f"the model called {name!r}, which is not among the request's tools "
                            f"({', '.join(tools)})")
    return name


def _parse_xml(raw: RawCall, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    m = _XML_FUNCTION.search(raw.body)
    if m is None or (not raw.closed and "</function>" not in raw.body):
        raise ToolCallError("the reply ended inside a tool call" if not raw.closed else
                            "the tool call has no <function=NAME> in it")
    name = _known(m.group(1).strip(), tools)
    props = tools[name].get("properties", {})
    arguments: dict[str, Any] = {}
    for p in _XML_PARAMETER.finditer(m.group(2)):
        key = p.group(1).strip()
        if key in arguments:
            raise ToolCallError(f"the call of {name} gives parameter {key!r} twice")
        arguments[key] = _xml_value(name, key, p.group(2), props.get(key) if isinstance(props, Mapping) else None)
    return name, arguments


def _xml_value(name: str, key: str, text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type reads it: a string as is, anything else as JSON."""
    declared = schema.get("type") if isinstance(schema, Mapping) else None
    types = [declared] if isinstance(declared, str) else list(declared or [])
    if types == ["string"]:
        return text
    try:
        return json.loads(text)
    except ValueError:
        if text in _PYTHON_WORDS:
            return _PYTHON_WORDS[text]
        if not types or "string" in types:
            return text
        raise ToolCallError(f"parameter {key!r} of {name} is {text[:80]!r}, not JSON of type "
                            f"{' or '.join(map(str, types))}") from None


def _parse_json(raw: RawCall, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    try:
        call = json.loads(raw.body)
    except ValueError as e:
        what = "the tool call is not valid JSON" if raw.closed else "the reply ended inside a tool call"
        raise ToolCallError(f"{what}: {e}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('the tool call is not a JSON object with a "name"')
    name = _known(call["name"], tools)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # arguments written as a JSON string, as OpenAI's API carries them
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ToolCallError(f"the arguments of {name} are not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"the arguments of {name} are not a JSON object")
    return name, arguments
