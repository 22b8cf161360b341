"""The OpenAI-compatible server (engine.server) on 127.0.0.1, driven by the official `openai` client and by raw
HTTP: replies streamed and not, usage and timings, errors and their status codes, a bounded load, client
disconnects, and greedy text equal to `engine generate`'s."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import openai
import pytest

import engine.generate
from engine.chat import ChatFormat
from engine.server.reasoning import ReasoningSplitter, opens_thinking
from engine.server.run import LocalServer

KEY = "sekrit"
# Greedy continuation of this raw text runs ~500 tokens before EOS: long enough to disconnect from.
LONG_PROMPT = "In the beginning God created the heaven and the earth."
THINKING_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                     "{%- endfor %}{{- '<|im_start|>assistant\\n<think>\\n' }}")


@pytest.fixture(scope="module")
def eng():
    return engine.generate.load(None)


@pytest.fixture(scope="module")
def server(eng):
    srv = LocalServer(eng, port=0, max_waiting=4)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(eng, server):
    """A second server on the same engine with an API key; it shares the first one's lock."""
    srv = LocalServer(eng, port=0, api_key=KEY, lock=server.scheduler.lock)
    srv.start()
    yield srv
    srv.stop()


def client(srv: LocalServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key=key, max_retries=0, timeout=60)


def raw(srv: LocalServer, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if resp.getheader("content-type", "").startswith("application/json") \
            else {"text": data.decode()}
    finally:
        conn.close()


def metric(srv: LocalServer, name: str) -> float:
    """A sample's value; a labelled series not yet counted is 0 (its family must be declared)."""
    _, out = raw(srv, "GET", "/metrics")
    for line in out["text"].splitlines():
        if line.startswith(f"foretell:{name} "):
            return float(line.split()[-1])
    family = name.split("{")[0]
    assert "{" in name and f"# TYPE foretell:{family} " in out["text"], f"{name} missing from /metrics"
    return 0.0


def per_position(srv: LocalServer) -> dict[str, float]:
    _, out = raw(srv, "GET", "/metrics")
    rows = [ln for ln in out["text"].splitlines() if ln.startswith("foretell:spec_decode_num_accepted_tokens_per_pos")]
    return {ln.split('"')[1]: float(ln.split()[-1]) for ln in rows}


def chat(c: openai.OpenAI, text: str, **kw):
    return c.chat.completions.create(model="foretell-demo", messages=[{"role": "user", "content": text}], **kw)


def test_models_health_and_metrics_format(server) -> None:
    models = client(server).models.list().data
    assert [m.id for m in models] == ["foretell-demo"]
    assert raw(server, "GET", "/health") == (200, {"status": "ok"})
    _, out = raw(server, "GET", "/metrics")
    text = out["text"]
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_requests_running"):
        assert f"# TYPE foretell:{name} " in text


def test_chat_reply_usage_timings_and_mtp_counters(server) -> None:
    c = client(server)
    drafts0 = metric(server, "spec_decode_num_draft_tokens_total")
    accepted0 = metric(server, "spec_decode_num_accepted_tokens_total")
    per_pos0 = per_position(server)
    r = c.chat.completions.create(model="foretell-demo", max_tokens=12, temperature=0, extra_body={"mtp": 2},
                                  messages=[{"role": "system", "content": "Answer briefly."},
                                            {"role": "user", "content": "Who made the heaven?"}])
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens and t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    assert t["prompt_ms"] > 0 and t["draft_n"] >= t["draft_n_accepted"] >= 0
    if r.usage.completion_tokens > 2:  # depth 2 on: every verify pass drafted
        assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0  # greedy on the demo model: most drafts hold
    assert metric(server, "spec_decode_num_draft_tokens_total") - drafts0 == t["draft_n"]
    assert metric(server, "spec_decode_num_accepted_tokens_total") - accepted0 == t["draft_n_accepted"]
    assert sum(per_position(server).values()) - sum(per_pos0.values()) == t["draft_n_accepted"]
    assert t["mtp_speedup"] is None  # depth 2 throughout: no plain step of this reply to compare with
    plain = chat(c, "Who made the heaven?", max_tokens=12, extra_body={"mtp": False})
    assert plain.model_extra["timings"]["draft_n"] == 0
    # auto runs plain steps (first of all, to time decoding): MTP's gain is the reply's rate over theirs
    auto = chat(c, "Who made the heaven?", max_tokens=24, extra_body={"mtp": True}).model_extra["timings"]
    assert auto["mtp_plain_per_second"] > 0
    assert auto["mtp_speedup"] == pytest.approx(auto["predicted_per_second"] / auto["mtp_plain_per_second"])


def test_stream_equals_whole_reply_with_usage(server) -> None:
    c = client(server)
    whole = chat(c, "Tell me of Noah.", max_tokens=16, temperature=0)
    chunks = list(chat(c, "Tell me of Noah.", max_tokens=16, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    no_usage = list(chat(c, "Tell me of Noah.", max_tokens=4, stream=True))
    assert all(ch.usage is None for ch in no_usage)


def test_text_completions_streamed_and_not(server) -> None:
    c = client(server)
    r = c.completions.create(model="foretell-demo", prompt="And God said", max_tokens=6, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 6 and r.choices[0].finish_reason in ("stop", "length")
    parts = list(c.completions.create(model="foretell-demo", prompt="And God said", max_tokens=6, temperature=0,
                                      stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    ids = c.completions.create(model="foretell-demo", prompt=[[1, 2, 3]], max_tokens=2)
    assert ids.usage.prompt_tokens == 3
    stopped = c.completions.create(model="foretell-demo", prompt="And God said", max_tokens=6, stop=[r.choices[0].text[2:4]])
    assert stopped.choices[0].finish_reason == "stop" and r.choices[0].text[2:4] not in stopped.choices[0].text


def test_message_forms_clients_send(server) -> None:
    """Text parts (Open WebUI, newer SDKs), the developer role (= system), an assistant turn with null content."""
    parts = chat(client(server), "Hi", max_tokens=6, temperature=0)
    r = client(server).chat.completions.create(model="foretell-demo", max_tokens=6, temperature=0, messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": None}, {"role": "user", "content": [{"type": "text", "text": "H"},
                                                                           {"type": "text", "text": "i"}]}])
    assert r.choices[0].message.content and r.usage.prompt_tokens > parts.usage.prompt_tokens


def test_seeded_sampling_reproduces(server) -> None:
    c = client(server)
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, extra_body={"top_k": 40, "min_p": 0.05})
    a, b = chat(c, "Sing.", **kw), chat(c, "Sing.", **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_errors_as_openai_exceptions(server, keyed) -> None:
    c = client(server)
    for kw in ({"temperature": 5}, {"top_p": 0}, {"max_tokens": 0}, {"n": 2}, {"extra_body": {"mtp": 9}},
               {"extra_body": {"mtp": "3"}}, {"extra_body": {"top_k": "many"}}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(c, "Hi", **kw)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "Hi"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "word " * 5000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        client(keyed, "wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        chat(client(keyed, "wrong"), "Hi", max_tokens=2)
    assert chat(client(keyed, KEY), "Hi", max_tokens=2).usage.completion_tokens >= 1
    status, body = raw(keyed, "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}]}')
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert raw(keyed, "GET", "/health")[0] == 200  # open without the key, like /metrics


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "user"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": "ten"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": true}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "min_p": 2}', "min_p"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "stop": [1]}', "stop"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "seed": 1e30}', "seed"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}', "tools[0]"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "stream_options": {"include_usage": 1}}', "stream_options"),
])
def test_malformed_chat_requests_are_400(server, body: bytes, param: str | None) -> None:
    status, out = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["param"] == param and out["error"]["message"]


def test_other_bad_requests_keep_the_openai_shape(server) -> None:
    assert raw(server, "POST", "/v1/completions", b'{"prompt": ""}')[0] == 400
    assert raw(server, "POST", "/v1/completions", b'{"prompt": [99999999]}')[0] == 400
    status, out = raw(server, "GET", "/v1/nothing")
    assert status == 404 and out["error"]["type"] == "not_found_error"
    status, out = raw(server, "GET", "/v1/chat/completions")
    assert status == 405 and "error" in out
    status, out = raw(server, "POST", "/v1/completions", b"x" * (9 * 2**20))
    assert status == 413 and out["error"]["code"] == "request_too_large"
    assert raw(server, "GET", "/health")[0] == 200


def test_bounded_load_all_answered_or_429(server) -> None:
    """16 clients x 3 requests against 4 places generating together and 4 in the queue."""
    gen0 = metric(server, "generation_tokens_total")
    rejected0 = metric(server, "num_requests_rejected_total")
    c = client(server)

    def one_client(i: int) -> list:
        out = []
        for j in range(3):
            try:
                out.append(chat(c, f"Verse {i}.{j}", max_tokens=3, stream=j == 1,
                                **({"stream_options": {"include_usage": True}} if j == 1 else {})))
            except openai.RateLimitError as e:
                out.append(e)
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        results = [r for rs in pool.map(one_client, range(16)) for r in rs]
    assert time.perf_counter() - t0 < 45
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    answered = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert len(results) == 48 and answered
    tokens = 0
    for r in answered:
        if isinstance(r, openai.Stream):
            chunks = list(r)
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            tokens += chunks[-1].usage.completion_tokens
        else:
            assert r.choices[0].finish_reason in ("stop", "length")
            tokens += r.usage.completion_tokens
    assert raw(server, "GET", "/health")[0] == 200
    assert metric(server, "generation_tokens_total") - gen0 == tokens
    assert metric(server, "num_requests_rejected_total") - rejected0 == len(refused)
    assert metric(server, "num_requests_running") == 0 and metric(server, "num_requests_waiting") == 0


def _wait_aborts(server: LocalServer, n: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, 'request_success_total{finished_reason="abort"}') < n:
        assert time.monotonic() < deadline, "the generation went on after the client left"
        time.sleep(0.05)


def stream_then_leave(srv: LocalServer, body: bytes, before_leaving: Callable[[], None]) -> None:
    """Post a streamed completion over a raw socket, read two chunks, call `before_leaving`, and close the socket."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < 2:
            got += s.recv(4096)
        before_leaving()


def test_disconnect_stops_generation(server) -> None:
    aborts = metric(server, 'request_success_total{finished_reason="abort"}')
    gen0 = metric(server, "generation_tokens_total")
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}).encode()
    stream_then_leave(server, body, lambda: None)
    _wait_aborts(server, aborts + 1)
    body = body.replace(b'"stream": true', b'"stream": false')
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:  # whole reply: leave while waiting
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while metric(server, "num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.05)  # the engine decodes the embedded model at ~2000 tok/s here: 0.3 s was most of the reply
    _wait_aborts(server, aborts + 2)
    # The greedy reply runs ~500 tokens to EOS; both ended far earlier (an abort, not a stop: _wait_aborts).
    assert metric(server, "generation_tokens_total") - gen0 < 400
    assert raw(server, "GET", "/health")[0] == 200 and metric(server, "num_requests_running") == 0


def test_stopping_the_server_stops_a_reply_in_flight(eng, server, monkeypatch) -> None:
    # EOS ignored: the greedy reply (~500 tokens to EOS) could end on its own, at ~4000 tok/s, before the stop
    monkeypatch.setattr(eng.tokenizer, "eog_ids", frozenset())
    srv = LocalServer(eng, port=0, lock=server.scheduler.lock, shutdown_grace_s=1)
    srv.start()
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 4000, "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    threading.Thread(target=lambda: conn.request("POST", "/v1/completions", body=body,
                                                 headers={"Content-Type": "application/json"}), daemon=True).start()
    deadline = time.monotonic() + 10
    while srv.metrics.running < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.stop()
    deadline = time.monotonic() + 5  # 4000 tokens would take about a second at the fastest
    while srv.metrics.running:
        assert time.monotonic() < deadline, "the generation went on after the server stopped"
        time.sleep(0.05)
    assert srv.metrics.finished["abort"] == 1
    conn.close()


def test_greedy_text_equals_engine_generate(server) -> None:
    prompt = "Who was the first man?"
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", prompt, "--max-tokens", "24",
                          "--json"], capture_output=True, text=True, timeout=120, check=True)
    cli = json.loads(out.stdout)
    r = chat(client(server), prompt, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == cli["text"]
    assert r.usage.completion_tokens == cli["stats"]["generated_tokens"]


def test_thinking_goes_to_reasoning_content(eng, server) -> None:
    """A template that opens <think> in the prompt (as Qwen3.5's does): the reply is reasoning until </think>."""
    thinking = engine.generate.load(None)
    thinking.chat = ChatFormat(THINKING_TEMPLATE, thinking.tokenizer)
    srv = LocalServer(thinking, port=0, lock=server.scheduler.lock)
    srv.start()
    try:
        r = chat(client(srv), "Why?", max_tokens=8)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] and not msg.content  # the tiny model never closes it
        chunks = list(chat(client(srv), "Why?", max_tokens=8, stream=True))
        streamed = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks)
        assert streamed == msg.model_extra["reasoning_content"]
    finally:
        srv.stop()


@pytest.mark.parametrize("pieces, opened, want", [
    (["<think>\nI ponder.</think>\n\nAnswer."], False, ("I ponder.", "Answer.")),
    (list("<think>\nI ponder.</think>\n\nAnswer."), False, ("I ponder.", "Answer.")),
    (list("<think>\nI ponder.\n</think>\n\nAnswer."), False, ("I ponder.", "Answer.")),  # newline before the tag
    (["I pon", "der.</th", "ink>", "\n\nAns", "wer."], True, ("I ponder.", "Answer.")),
    (["<b>bold</b> and </think>"], False, ("", "<b>bold</b> and </think>")),
    (["still thinking </thi"], True, ("still thinking </thi", "")),
    (["  "], False, ("", "  ")),
])
def test_reasoning_splitter(pieces: list[str], opened: bool, want: tuple[str, str]) -> None:
    sp = ReasoningSplitter(opened)
    got = [sp.push(p) for p in pieces] + [sp.flush()]
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want


def test_opens_thinking() -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def test_serve_cli_serves_with_its_flags_and_port_in_use_is_one_line() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", "0", "--max-tokens", "3", "--no-mtp"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("serving foretell-demo on http://127.0.0.1:"), line
        url = line.split()[3]
        port = int(url.split(":")[2].split("/")[0])
        r = openai.OpenAI(base_url=url, api_key="none", max_retries=0).chat.completions.create(
            model="foretell-demo", messages=[{"role": "user", "content": "Hi"}])
        assert r.usage.completion_tokens <= 3 and r.model_extra["timings"]["draft_n"] == 0  # the flags' defaults
        busy = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
        assert busy.returncode == 1 and busy.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}")
        assert len(busy.stderr.strip().splitlines()) == 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_cors_only_when_asked(eng, server) -> None:
    origin = "http://editor.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    srv = LocalServer(eng, port=0, cors_origins=(origin,), lock=server.scheduler.lock)
    srv.start()
    try:
        for target, allowed in ((srv, True), (server, False)):
            conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=30)
            conn.request("OPTIONS", "/v1/chat/completions", headers=preflight)
            resp = conn.getresponse()
            resp.read()
            conn.close()
            assert (resp.getheader("access-control-allow-origin") == origin) is allowed
    finally:
        srv.stop()


def test_shared_lock_serializes_with_another_holder(server) -> None:
    """While someone else (the app's worker) holds the lock, a request waits, then is answered."""
    lock = server.scheduler.lock
    lock.acquire()
    result: list = []
    t = threading.Thread(target=lambda: result.append(chat(client(server), "Hi", max_tokens=2)))
    t.start()
    time.sleep(0.5)
    assert not result and metric(server, "num_requests_running") == 1
    lock.release()
    t.join(30)
    assert result and result[0].usage.completion_tokens >= 1
