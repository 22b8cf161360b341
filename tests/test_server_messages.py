"""Anthropic's Messages API on the server (issue 46, item 5) with Anthropic's own client: a reply whole and streamed
(the same text, the events in their order), thinking as a thinking block, tool use and tool results through a
scripted engine (tests/scripted_engine.py), errors in Anthropic's shape, the x-api-key header; and GET
/v1/models/{id}."""
from __future__ import annotations

import anthropic
import openai
import pytest

import engine.generate
from engine.server.run import LocalServer
from tests.scripted_engine import ScriptedEngine
from tests.test_server_tools import CALL, QWEN35, THOUGHT

KEY = "sekrit"
HI = [{"role": "user", "content": "Who made the heaven?"}]
WEATHER = {"name": "get_weather", "description": "Weather by city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def real():
    return engine.generate.load(None)


@pytest.fixture(scope="module")
def server(real):
    srv = LocalServer(real, port=0, api_key=KEY)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def scripted(real):
    return ScriptedEngine(real, QWEN35)


@pytest.fixture(scope="module")
def scripted_server(scripted, server):
    srv = LocalServer(scripted, port=0)
    srv.start()
    yield srv
    srv.stop()


def client(srv: LocalServer, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=60)


def test_a_reply_whole_and_streamed(server) -> None:
    """The server's default temperature is 0 (greedy): both replies are the same text."""
    c = client(server)
    whole = c.messages.create(model="foretell-demo", max_tokens=12, system="Answer briefly.", messages=HI)
    (block,) = whole.content
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert block.type == "text" and block.text and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 5 and 1 <= whole.usage.output_tokens <= 12
    with c.messages.stream(model="foretell-demo", max_tokens=12, system="Answer briefly.", messages=HI) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert streamed.content[0].text == block.text and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    cut = c.messages.create(model="foretell-demo", max_tokens=3, messages=HI)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_errors_in_anthropics_shape(server) -> None:
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="foretell-demo", max_tokens=4, messages=[{"role": "system", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": e.value.body[
        "error"]["message"]}} and "'user' or 'assistant'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="foretell-demo", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}])
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "wrong").messages.create(model="foretell-demo", max_tokens=4, messages=HI)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_tool_use_round_trip_whole_and_streamed(scripted, scripted_server) -> None:
    c = client(scripted_server)
    scripted.replies.append(THOUGHT + "Let me look.\n\n" + CALL)
    m = c.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "Weather in Paris?"}],
                          tools=[WEATHER])
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    use = m.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 2} and use.id.startswith("toolu_")
    scripted.replies.append(THOUGHT + CALL)
    with c.messages.stream(model="m", max_tokens=200, tools=[WEATHER],
                           messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        deltas = [ev.delta.type for ev in stream if ev.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.content[-1].input == use.input and final.stop_reason == "tool_use"
    scripted.replies.append(THOUGHT + "Sunny.")
    back = c.messages.create(model="m", max_tokens=200, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])
    assert back.content[-1].text == "Sunny." and back.stop_reason == "end_turn"
    assert "<function=get_weather>\n<parameter=city>\nParis" in scripted.prompts[-1]
    assert "<tool_response>\nsunny\n</tool_response>" in scripted.prompts[-1]
    scripted.replies.append("<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")
    forced = c.messages.create(model="m", max_tokens=200, tools=[WEATHER], messages=HI,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert scripted.prompts[-1].endswith("<tool_call>\n<function=get_weather>\n") and forced.stop_reason == "tool_use"


def test_models_by_id(server) -> None:
    c = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    assert c.models.retrieve("foretell-demo").id == "foretell-demo"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found" and "foretell-demo" in e.value.body["message"]
