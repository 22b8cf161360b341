"""Tool calls (issue 46, item 1): the call markup read off the published Qwen3.5 and Qwen3.6 chat templates (and a
Qwen3-style JSON one), parsed back whole from streamed text and checked against the function's schema; then the
server end to end with the real `openai` client — a round trip streamed and whole, every tool_choice, parallel calls,
and invalid arguments reported rather than passed on. The embedded model never writes a call itself: the server runs
on a scripted engine (tests/scripted_engine.py) whose replies are the markup a Qwen3.5 model writes."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

import engine.generate
from engine import tools as toolkit
from engine.chat import ChatFormat
from engine.constrain import Constraint
from engine.sampling import SamplingConfig
from engine.server.run import LocalServer
from tests.generation import collect
from tests.scripted_engine import ScriptedEngine

DATA = Path(__file__).parent / "data"
QWEN35, QWEN36 = ((DATA / f"qwen{v}_chat_template.jinja").read_text() for v in ("3.5", "3.6"))
# Qwen3's form of a call (JSON in <tool_call>), cut down to what the probe and the tests render.
QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}{%- for c in m.tool_calls or [] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson) + "
    "'}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "hours": {"type": "array", "items": {"type": "integer"}},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}}, "note": {"type": ["string", "null"]},
    "unit": {"enum": ["C", "F"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ARGS = {"city": "Paris\nFrance", "days": 3, "metric": True, "ratio": 0.5, "hours": [6, 18], "where": {"lat": 48.8},
        "note": None, "unit": "C"}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>")
USER = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "The user wants the weather.\n</think>\n\n"  # the Qwen3.5 prompt opens a thinking block: replies close it


@pytest.fixture(scope="module")
def real():
    return engine.generate.load(None)


@pytest.fixture(scope="module")
def scripted(real):
    return ScriptedEngine(real, QWEN35)


@pytest.fixture(scope="module")
def server(scripted):
    srv = LocalServer(scripted, port=0)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def split(text: str, step: int = 1) -> list:
    sp = toolkit.CallSplitter()
    out = [x for i in range(0, len(text), step) for x in sp.push(text[i:i + step])] + sp.flush()
    return out


def rendered_call(chat: ChatFormat, name: str, args: dict) -> str:
    msgs = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}]}]
    text = chat.render(msgs, add_generation_prompt=False, tools=TOOLS)
    return text[text.rindex(toolkit.CALL_OPEN):text.rindex(toolkit.CALL_CLOSE) + len(toolkit.CALL_CLOSE)]


# -- the markup ----------------------------------------------------------------------------------------------------
def test_the_format_is_read_off_the_template(real) -> None:
    for template in (QWEN35, QWEN36):
        fmt = toolkit.tool_format(ChatFormat(template, real.tokenizer))
        assert (fmt.kind, fmt.native, fmt.opening("f")) == ("xml", True, "<tool_call>\n<function=f>\n")
    fmt = toolkit.tool_format(ChatFormat(QWEN3_STYLE, real.tokenizer))
    assert (fmt.kind, fmt.native, fmt.opening("f")) == ("json", True, '<tool_call>\n{"name": "f", "arguments": ')
    assert toolkit.tool_format(real.chat) == toolkit.WRITTEN  # plain ChatML renders no tools: they are written in


@pytest.mark.parametrize("template", [QWEN35, QWEN36, QWEN3_STYLE], ids=["qwen3.5", "qwen3.6", "qwen3-json"])
@pytest.mark.parametrize("step", [1, 7, 10_000])
def test_calls_the_templates_write_parse_back(real, template: str, step: int) -> None:
    """Every JSON type as each template writes it (Qwen3.5 writes a bool as Python's True), streamed in pieces."""
    chat = ChatFormat(template, real.tokenizer)
    fmt = toolkit.tool_format(chat)
    markup = rendered_call(chat, "get_weather", ARGS)
    parts = split(f"Let me look.\n\n{markup}\n{rendered_call(chat, 'get_time', {})}", step)
    assert "".join(p for p in parts if isinstance(p, str)) == "Let me look."
    calls = [toolkit.parse_call(fmt, p, SCHEMAS) for p in parts if isinstance(p, toolkit.RawCall)]
    assert calls == [toolkit.ToolCall("get_weather", ARGS), toolkit.ToolCall("get_time", {})]


def test_a_call_cut_at_its_closing_tag_still_parses(real) -> None:
    """One call only: the server stops the reply at </tool_call> (a stop string), which the text then lacks."""
    fmt = toolkit.tool_format(ChatFormat(QWEN35, real.tokenizer))
    (raw,) = split(CALL.removesuffix(toolkit.CALL_CLOSE))
    assert not raw.closed and toolkit.parse_call(fmt, raw, SCHEMAS) == toolkit.ToolCall("get_weather",
                                                                                       {"city": "Paris", "days": 2})


@pytest.mark.parametrize("body, closed, says", [
    ("<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>", True, "'city' is a required property"),
    ("<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=days>\ntwo\n</parameter>\n</function>",
     True, "not JSON of type integer"),
    ("<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=days>\n0\n</parameter>\n</function>", True,
     "at days: 0 is less than the minimum of 1"),
    ("<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=unit>\nK\n</parameter>\n</function>", True,
     "'K' is not one of ['C', 'F']"),
    ("<function=rm_rf>\n</function>", True, "'rm_rf', which is not among the request's tools"),
    ("<function=get_weather>\n<parameter=city>\nPar", False, "the reply ended inside a tool call"),
    ("{\"name\": \"get_weather\"}", True, "no <function=NAME>"),
])
def test_invalid_calls_say_why(real, body: str, closed: bool, says: str) -> None:
    fmt = toolkit.tool_format(ChatFormat(QWEN35, real.tokenizer))
    with pytest.raises(toolkit.ToolCallError, match=None) as e:
        toolkit.parse_call(fmt, toolkit.RawCall(body, closed), SCHEMAS)
    assert says in str(e.value)


def test_json_calls_that_are_not_json_say_so(real) -> None:
    fmt = toolkit.tool_format(ChatFormat(QWEN3_STYLE, real.tokenizer))
    for body, says in (('{"name": "get_weather", "arguments": {"city": 1', "not valid JSON"),
                       ('{"name": "get_weather", "arguments": [1]}', "not a JSON object"),
                       ('{"arguments": {}}', 'with a "name"')):
        with pytest.raises(toolkit.ToolCallError) as e:
            toolkit.parse_call(fmt, toolkit.RawCall(body), SCHEMAS)
        assert says in str(e.value)


def test_tools_written_into_a_template_that_renders_none(real) -> None:
    msgs = toolkit.written_in(USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "noon"}], TOOLS)
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}


# -- the server ----------------------------------------------------------------------------------------------------
def ask(client, scripted, reply: str, **kw):
    scripted.replies.append(reply)
    return client.chat.completions.create(model="m", messages=kw.pop("messages", USER), max_tokens=200, **kw)


def test_round_trip_whole(client, scripted) -> None:
    r = ask(client, scripted, THOUGHT + "I will look it up.\n\n" + CALL, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "I will look it up."
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    prompt = scripted.prompts[-1]
    assert '"name": "get_weather"' in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")
    follow = ask(client, scripted, THOUGHT + "Sunny, 21 degrees.", tools=TOOLS, messages=USER + [
        msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.choices[0].message.content == "Sunny, 21 degrees." and follow.choices[0].finish_reason == "stop"
    prompt = scripted.prompts[-1]
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt


def test_round_trip_streamed_as_openai_sends_it(client, scripted) -> None:
    second = CALL.replace("Paris", "Rome")
    chunks = list(ask(client, scripted, THOUGHT + CALL + "\n" + second, tools=TOOLS, stream=True))
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 0, 1, 1]
    for opening, rest in (deltas[0:2], deltas[2:4]):
        assert opening.id.startswith("call_") and opening.type == "function"
        assert opening.function.name == "get_weather" and opening.function.arguments == ""
        assert rest.id is None and rest.function.name is None
    assert [json.loads(d.function.arguments)["city"] for d in (deltas[1], deltas[3])] == ["Paris", "Rome"]
    assert not any(ch.choices[0].delta.content for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_variants(client, scripted) -> None:
    r = ask(client, scripted, THOUGHT + CALL, tools=TOOLS, tool_choice="none")  # no tools offered, nothing parsed
    assert "get_weather" not in scripted.prompts[-1] and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == CALL and r.choices[0].finish_reason == "stop"
    rest = CALL.removeprefix("<tool_call>\n<function=")
    r = ask(client, scripted, rest, tools=TOOLS, tool_choice="required")  # a call of any function, prefilled
    assert scripted.prompts[-1].endswith("<think>\n\n</think>\n\n<tool_call>\n<function=")
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert scripted.configs[-1].constraint is not None  # the forced call held to its markup and schema
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = ask(client, scripted, rest.removeprefix("get_weather>\n"), tools=TOOLS, tool_choice=named)
    assert scripted.prompts[-1].endswith("</think>\n\n<tool_call>\n<function=get_weather>\n")
    assert toolkit.CALL_CLOSE in scripted.configs[-1].stop_strings  # one call: the reply ends with it
    assert scripted.configs[-1].constraint is not None
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    r = ask(client, scripted, THOUGHT + CALL + "\n" + CALL, tools=TOOLS, parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    r = ask(client, scripted, THOUGHT + CALL + "\n" + CALL, tools=TOOLS, tool_choice="auto")
    assert len(r.choices[0].message.tool_calls) == 2
    c = scripted.configs[-1].constraint  # each call the model opens held to the grammar, after its thinking block
    assert c.trigger == toolkit.CALL_OPEN and c.quiet_first and c.lark == toolkit.auto_call_grammar(
        toolkit.tool_format(scripted.chat), SCHEMAS)


def test_invalid_arguments_are_reported_not_passed_on(client, scripted) -> None:
    bad = CALL.replace("\n2\n", "\ntwo\n")
    r = ask(client, scripted, THOUGHT + bad, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop" and msg.content == bad
    assert msg.model_extra["tool_call_errors"] == ["parameter 'days' of get_weather is 'two', not JSON of type integer"]
    chunks = list(ask(client, scripted, THOUGHT + bad, tools=TOOLS, stream=True))
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks)
    errors = [e for ch in chunks for e in (ch.choices[0].delta.model_extra or {}).get("tool_call_errors", [])]
    assert errors == msg.model_extra["tool_call_errors"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == bad


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_time", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400(client, kw: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=kw.pop("messages", USER), max_tokens=2, **kw)
    assert e.value.body["param"] == param


def test_tools_on_a_model_whose_template_renders_none(real) -> None:
    """The embedded model's plain ChatML: the tools are described in a system message it is sent."""
    scripted = ScriptedEngine(real)
    srv = LocalServer(scripted, port=0)
    srv.start()
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        r = ask(c, scripted, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', tools=TOOLS)
        assert r.choices[0].message.tool_calls[0].function.name == "get_time"
        assert scripted.prompts[-1].startswith("<|im_start|>system\n# Tools\n") and '"get_weather"' in scripted.prompts[-1]
    finally:
        srv.stop()


@pytest.mark.parametrize("template", [QWEN35, QWEN36, QWEN3_STYLE, None],
                         ids=["qwen3.5", "qwen3.6", "qwen3-json", "written-json"])
def test_a_forced_call_the_model_writes_is_valid_for_its_schema(real, template: str | None) -> None:
    """tool_choice required or named: the embedded model, which never learnt any of these markups, writes its calls
    under the call grammar (engine.tools.call_grammar), greedy and sampled: each one parses, names the forced
    function where one is, and its arguments validate against the function's schema; the reply ends after the
    call (or the calls)."""
    chat = ChatFormat(template, real.tokenizer) if template is not None else real.chat
    fmt = toolkit.tool_format(chat)
    # WEATHER with its texts, lists and objects bounded (a weak model's text runs on where a real one's ends)
    props = {**WEATHER["properties"], "city": {"type": "string", "maxLength": 24},
             "note": {"type": ["string", "null"], "maxLength": 16},
             "hours": {**WEATHER["properties"]["hours"], "maxItems": 4},
             "where": {**WEATHER["properties"]["where"], "additionalProperties": False}}
    schemas = {"get_weather": {**WEATHER, "properties": props, "additionalProperties": False},
               "get_time": {**SCHEMAS["get_time"], "additionalProperties": False}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    msgs = USER if fmt.native else toolkit.written_in(USER, tools)
    prompt = chat.encode(msgs, enable_thinking=False, tools=tools if fmt.native else None)
    for forced, parallel in (("get_weather", False), (None, False), (None, True)):
        c = Constraint.grammar_of(toolkit.call_grammar(fmt, schemas, forced, parallel))
        c.check()
        ids = prompt + real.tokenizer.encode(fmt.opening(forced), special=True, add_bos=False)
        for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=3), SamplingConfig(temperature=1.5,
                                                                                                   seed=4)):
            out, _, _, done = collect(real, ids, max_tokens=600, mtp=False, constraint=c, sampling=sampling)
            raw = [x for x in split(fmt.opening(forced) + real.tokenizer.decode(out)) if isinstance(x, toolkit.RawCall)]
            if done.reason == "max_tokens" and parallel:  # call after call until the room ran out: the last one cut
                raw = [x for x in raw if x.closed]
            else:
                assert done.reason == "eos" and len(raw) == 1, (sampling, real.tokenizer.decode(out))
            calls = [toolkit.parse_call(fmt, x, schemas) for x in raw]
            assert calls
            for call in calls:
                jsonschema.validate(call.arguments, schemas[call.name])
            assert forced is None or [call.name for call in calls] == [forced]


def test_forced_calls_through_the_server_always_come_back_valid(real) -> None:
    """The served embedded model (its plain ChatML: the json form written into the messages) under tool_choice
    required and named, whole and streamed: every reply is a call whose arguments validate, finish_reason
    tool_calls."""
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                 "additionalProperties": False}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    srv = LocalServer(real, port=0)
    srv.start()
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        named = {"type": "function", "function": {"name": "get_time"}}
        for seed, choice in enumerate(["required", named, "required", named]):
            r = c.chat.completions.create(model="m", messages=USER, tools=tools, tool_choice=choice, max_tokens=200,
                                          temperature=1.0, seed=seed, parallel_tool_calls=False)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls"
            assert choice == "required" or call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        chunks = list(c.chat.completions.create(model="m", messages=USER, tools=tools, tool_choice="required",
                                                max_tokens=200, temperature=0.9, seed=7, stream=True,
                                                parallel_tool_calls=False))
        calls: dict[int, list[str]] = {}  # parallel calls allowed: each index its name and its arguments' pieces
        for d in (d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])):
            name_args = calls.setdefault(d.index, ["", ""])
            name_args[0] += d.function.name or ""
            name_args[1] += d.function.arguments or ""
        assert calls
        for name, args in calls.values():
            jsonschema.validate(json.loads(args), schemas[name])
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["tool_calls"]
        # calls after calls until max_tokens cuts one: the whole ones come back, the reply says it was cut
        r = c.chat.completions.create(model="m", messages=USER, tools=tools, tool_choice="required", max_tokens=60,
                                      temperature=1.0, seed=1)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and msg.tool_calls
        assert any("ended inside a tool call" in e for e in msg.model_extra["tool_call_errors"])
        # the same on /v1/messages: tool_use blocks, and stop_reason max_tokens
        import anthropic

        a = anthropic.Anthropic(base_url=srv.url.removesuffix("/v1"), api_key="none", max_retries=0, timeout=60)
        m = a.messages.create(model="m", max_tokens=60, messages=USER, extra_body={"temperature": 0.0},
                              tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                     for t in tools], tool_choice={"type": "any"})
        assert m.stop_reason == "max_tokens" and any(b.type == "tool_use" for b in m.content)
        m = a.messages.create(model="m", max_tokens=200, messages=USER,
                              tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                     for t in tools], tool_choice={"type": "tool", "name": "get_weather"})
        assert m.stop_reason == "tool_use" and [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]
    finally:
        srv.stop()


def test_the_call_grammar_keeps_what_a_schema_leaves_open_and_refuses_what_it_closes(real) -> None:
    """Open parameters taken as text, closed ones refused; a wrong type, an unknown function, a const broken and a
    text past its maxLength refused."""
    from engine.constrain import ConstraintError, Matcher

    fmt = toolkit.tool_format(ChatFormat(QWEN35, real.tokenizer))
    schemas = {"open": {"type": "object"},
               "shut": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
               "text": {"type": "object", "properties": {"mode": {"const": "fast"}, "t": {"type": "string",
                                                                                         "maxLength": 3}},
                        "additionalProperties": False}}
    c = Constraint.grammar_of(toolkit.call_grammar(fmt, schemas, None, False))

    def takes(text: str) -> bool:
        m = Matcher(c, real.tokenizer)
        try:
            for t in real.tokenizer.encode(text, add_bos=False):
                m.consume(t)
        except ConstraintError:
            return False
        return m.done
    end = "</function>\n</tool_call>"
    assert takes("open>\n<parameter=x>\nhello\n</parameter>\n<parameter=y>\n3\n</parameter>\n" + end)
    assert takes("shut>\n<parameter=a>\n3\n</parameter>\n" + end) and takes("shut>\n" + end)
    assert not takes("shut>\n<parameter=zz>\nq\n</parameter>\n" + end)
    assert not takes("shut>\n<parameter=a>\nthree\n</parameter>\n" + end)
    assert not takes("other>\n" + end)
    assert takes("text>\n<parameter=mode>\nfast\n</parameter>\n<parameter=t>\nabc\n</parameter>\n" + end)
    assert not takes("text>\n<parameter=mode>\nslow\n</parameter>\n" + end)  # a const of a string
    assert not takes("text>\n<parameter=t>\nabcd\n</parameter>\n" + end)  # past maxLength


@pytest.mark.parametrize("template", [QWEN35, QWEN3_STYLE, None], ids=["qwen3.5", "qwen3-json", "written-json"])
def test_a_call_the_model_opens_under_tool_choice_auto_is_held_to_its_schema(real, template: str | None) -> None:
    """tool_choice auto: the reply is free text, and a call it opens is held to the call grammar from its opening
    to its end (a lazy constraint, engine.constrain.LazyMatcher), free text again after it. The embedded model never
    writes CALL_OPEN: a piece of its own free reply stands in for the tag as the trigger. Greedy (with and without
    MTP, the same tokens) and sampled: the text up to the trigger is the free reply's, after it a call that parses
    and validates, then more text."""
    chat = ChatFormat(template, real.tokenizer) if template is not None else real.chat
    fmt = toolkit.tool_format(chat)
    schemas = {"get_weather": {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    msgs = USER if fmt.native else toolkit.written_in(USER, tools)
    prompt = chat.encode(msgs, enable_thinking=False, tools=tools if fmt.native else None)
    free_ids = collect(real, prompt, max_tokens=24, mtp=False)[0]
    free = real.tokenizer.decode(free_ids)
    lead = fmt.head[len(toolkit.CALL_OPEN):]  # what the grammar starts with after the trigger
    # greedy: a piece of the free reply, ending where a token does; sampled (which need not write it): a letter
    for sampling, trigger in ((SamplingConfig(), real.tokenizer.decode(free_ids[:6])[-8:]),
                              (SamplingConfig(temperature=1.0, seed=5), "e")):
        assert trigger.strip(), free
        c = Constraint.lazy(toolkit.auto_call_grammar(fmt, schemas), trigger)
        c.check()
        runs = [collect(real, prompt, max_tokens=160, mtp=mtp, constraint=c, draft=2, sampling=sampling)[0]
                for mtp in (False, True)]
        assert sampling.temperature or runs[0] == runs[1]
        text = real.tokenizer.decode(runs[0])
        at = text.find(lead)
        assert at > 0 and text[:at].endswith(trigger) and (sampling.temperature or free.startswith(text[:at])), text
        end = text.find(toolkit.CALL_CLOSE, at) + len(toolkit.CALL_CLOSE)
        assert end > at and len(text) > end, text  # the call closed, and the reply went on after it
        (raw,) = [x for x in split(toolkit.CALL_OPEN + text[at:end]) if isinstance(x, toolkit.RawCall)]
        call = toolkit.parse_call(fmt, raw, schemas)
        jsonschema.validate(call.arguments, schemas[call.name])


def test_the_lazy_matcher_masks_nothing_outside_a_call_and_undoes_drafts_past_its_opening(real) -> None:
    """Free text: no mask; the opening tag, in one token or split over several, starts the call's grammar, which
    ends with the call; a draft taken `ahead` over the opening is undone by `back`; an opening inside a thinking
    block starts nothing."""
    from engine.constrain import LazyMatcher
    from engine.server.reasoning import CLOSE, OPEN

    tok = real.tokenizer
    fmt = toolkit.tool_format(ChatFormat(QWEN3_STYLE, tok))
    schemas = {"f": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                     "additionalProperties": False}}
    c = Constraint.lazy(toolkit.auto_call_grammar(fmt, schemas), toolkit.CALL_OPEN, (OPEN, CLOSE), quiet_first=True)
    call = fmt.head[len(toolkit.CALL_OPEN):] + 'f", "arguments": {"a": 7}' + fmt.close

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_bos=False)

    m = c.matcher(tok)
    assert isinstance(m, LazyMatcher) and m.free and not m.done
    for t in ids(f"Let me think {toolkit.CALL_OPEN} not yet{CLOSE}\n\nSure. <tool_") + ids("call>"):
        m.consume(t)  # the tag inside the thinking block started nothing; split after it, it does
    forced = m.forces()
    assert not m.free and not m.allows(ids("x")[0]) and forced
    for t in ids(call)[:3]:  # a draft into the call, then back: as it was
        m.ahead(t)
    m.back()
    assert not m.free and m.forces() == forced
    for t in ids(call):
        m.consume(t)
    assert m.free and m.allows(ids("x")[0])  # the call closed: free text again
    for t in ids(" " + toolkit.CALL_OPEN):  # a draft past the opening
        m.ahead(t)
    assert not m.free
    m.back()
    assert m.free
