"""Every request body the server is sent is answered 200 or 400, never 500: the cases are generated, not listed.

A pool of JSON values (every JSON type; edge, huge and negative numbers; NaN and Infinity; empty, long and
megabyte strings; lone surrogates; nesting 50 and 1,000 deep; plus seeded random ones) is put in turn at every
field of a valid request, nested fields and an unknown one included. An oracle written from the documented API
(README "Serving the model") says whether each body is valid: valid bodies must be answered 200, the others 400
in OpenAI's error shape. Then the headers: only a JSON body, uncompressed, from no web page that is not allowed.
Everything on 127.0.0.1, one reply token a request.
"""
from __future__ import annotations

import copy
import gzip
import http.client
import json
import math
import random
import re
import time
from typing import Any, Callable, Iterator

import pytest

import engine.generate
from engine import validate
from engine.server.run import LocalServer

MARK = "\x00candidate\x00"  # where a candidate's JSON text goes in a body
SURROGATE = re.compile("[\ud800-\udfff]")
BIG = 100_000  # characters: more than the 4096-token test context holds whatever the text
ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_BASE = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
COMPLETION_BASE = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
CORS = "http://editor.example"


@pytest.fixture(scope="module")
def server():
    srv = LocalServer(engine.generate.load(None), port=0, cors_origins=(CORS,))
    srv.start()
    yield srv
    srv.stop()


def post(srv: LocalServer, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def assert_openai_error(status: int, data: bytes, want: int, case: str) -> dict[str, Any]:
    assert status == want, (case, status, data[:300])
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], (case, err)
    assert err["type"] == "invalid_request_error" and len(err["message"]) < 1000, (case, err)
    return err


# -- the pool of values --------------------------------------------------------------------------------------

def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def pool(seed: int = 48) -> list[str]:
    """Candidate values as JSON text (NaN, 1e400 and lone surrogates have no other form)."""
    ints = [-(10 ** 30), -2, -1, 0, 1, 2, 8, 9, 16, 17, 256, 2 ** 31, 2 ** 31 + 1, 2 ** 63, 2 ** 64, 10 ** 12,
            10 ** 15, 10 ** 30, 10 ** 400]
    floats = ["0.5", "1.0", "1.5", "-0.5", "2.5", "1e-300", "1e308", "1e400", "-1e400", "NaN", "Infinity",
              "-Infinity"]
    strings = [json.dumps(s) for s in ("", "x", "auto", "3", "text", "user", "a\x00b", "x" * 257, "x" * 10 ** 6)]
    strings += ['"\\ud800"', '"a\\udfffb"', '"\\ud83d\\ude00"']  # two lone surrogates and a valid pair
    lists = ["[]", "[1]", '["x"]', json.dumps(["x"] * 17), '[""]', "[null]", "[[1]]", '["\\ud800"]', "[1.5]",
             json.dumps(["x" * 10 ** 6]), nested(50), nested(1000)]
    objects = ["{}", '{"type": "text"}', '{"include_usage": true}', '{"include_usage": 1}',
               '{"enable_thinking": false}', '{"enable_thinking": "yes"}', '{"type": "text", "text": "Hi"}',
               '{"x": %s}' % nested(1000), '{"\\ud800": 1}']
    rng = random.Random(seed)
    rand = [str(rng.randint(-(2 ** 70), 2 ** 70)) for _ in range(3)] + [repr(rng.uniform(-1e6, 1e6))]
    rand += [json.dumps("".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(1, 40))))]
    return ["null", "true", "false"] + [str(i) for i in ints] + floats + strings + lists + objects + rand


# -- the oracle: what the documented API takes -----------------------------------------------------------------

class Invalid(Exception):
    pass


def strict_json(text: str) -> Any:
    """JSON as the standard has it: no NaN/Infinity, nesting the parser takes, every string Unicode."""
    def constant(name: str) -> Any:
        raise Invalid(name)

    try:
        value = json.loads(text, parse_constant=constant)
    except (ValueError, RecursionError) as e:
        raise Invalid(str(e)) from None
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += list(v) + list(v.values())
        elif isinstance(v, list):
            stack += v
        elif isinstance(v, str):
            check(SURROGATE.search(v) is None)
    return value


def _int_like(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _number(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v)


def check(ok: bool) -> None:
    if not ok:
        raise Invalid


def in_range(v: Any, lo: float, hi: float, *, whole: bool = False, lo_open: bool = False) -> None:
    check((_int_like(v) if whole else _number(v)) and (lo < v if lo_open else lo <= v) and v <= hi)


def common_fields(b: dict[str, Any]) -> None:
    opt = {k: v for k, v in b.items() if v is not None}
    for name in ("max_tokens", "max_completion_tokens"):
        if name in opt:
            in_range(opt[name], 1, validate.MAX_TOKENS, whole=True)
    if "top_k" in opt:
        in_range(opt["top_k"], 0, validate.MAX_TOP_K, whole=True)
    if "seed" in opt:
        in_range(opt["seed"], -1, validate.MAX_SEED, whole=True)
    for name, lo, hi, lo_open in (("temperature", 0, 2, False), ("top_p", 0, 1, True), ("min_p", 0, 1, False),
                                  ("repeat_penalty", validate.MIN_LOGIT_DIVISOR, 10, False),
                                  ("presence_penalty", 0, 0, False), ("frequency_penalty", 0, 0, False)):
        if name in opt:
            in_range(opt[name], lo, hi, lo_open=lo_open)
    if opt.get("temperature"):  # 0 is greedy; a positive one must not overflow the logits it divides
        in_range(opt["temperature"], validate.MIN_LOGIT_DIVISOR, 2)
    for name, off in (("n", 1), ("logit_bias", {})):
        if name in opt:  # fields the engine cannot honour: only their 'off' value
            check(type(opt[name]) is type(off) and opt[name] == off)
    if "model" in opt:
        check(isinstance(opt["model"], str))
    if "stream" in opt:
        check(isinstance(opt["stream"], bool))
    if "stream_options" in opt:
        so = opt["stream_options"]
        check(isinstance(so, dict) and (so.get("include_usage") is None or isinstance(so["include_usage"], bool)))
    if "mtp" in opt:
        m = opt["mtp"]
        check(isinstance(m, bool) or (type(m) is int and 1 <= m <= validate.MAX_DRAFT))
    if "stop" in opt:
        stops = [opt["stop"]] if isinstance(opt["stop"], str) else opt["stop"]
        check(isinstance(stops, list) and all(isinstance(s, str) for s in stops))
        stops = [s for s in stops if s]
        check(len(stops) <= validate.MAX_STOP_STRINGS and all(len(s) <= validate.MAX_STOP_CHARS for s in stops))


def valid_chat(b: Any) -> None:
    check(isinstance(b, dict))
    msgs = b.get("messages")
    check(isinstance(msgs, list) and 1 <= len(msgs) <= validate.MAX_MESSAGES)
    total = 0
    for m in msgs:
        check(isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] in ROLES)
        c = m.get("content")
        if isinstance(c, list):
            check(all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c))
            c = "".join(p["text"] for p in c)
        check(isinstance(c, str) or (c is None and m["role"] == "assistant"))
        total += len(c or "")
    check(total < BIG)  # else over the context
    common_fields(b)
    kw = b.get("chat_template_kwargs")
    check(kw is None or (isinstance(kw, dict) and (kw.get("enable_thinking") is None
                                                   or isinstance(kw.get("enable_thinking"), bool))))
    check(b.get("functions") is None or b["functions"] == [])
    check(b.get("tools") is None or b["tools"] == [])  # the pool holds no valid tool: test_server_tools tries those
    check(b.get("tool_choice") in (None, "none", "auto"))  # without tools nothing can be called
    check(b.get("parallel_tool_calls") is None or isinstance(b["parallel_tool_calls"], bool))
    if b.get("logprobs") is not None:
        check(isinstance(b["logprobs"], bool))
    if b.get("top_logprobs") is not None:
        in_range(b["top_logprobs"], 0, validate.MAX_TOP_LOGPROBS, whole=True)
        check(b["top_logprobs"] == 0 or b.get("logprobs") is True)
    rf = b.get("response_format")
    check(rf is None or (isinstance(rf, dict) and rf.get("type") == "text"))


def valid_completion(b: Any, n_vocab: int) -> None:
    check(isinstance(b, dict))
    p = b.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, list):
        check(bool(p) and all(type(t) is int and 0 <= t < n_vocab for t in p))
    else:
        check(isinstance(p, str) and 0 < len(p) < BIG)
    common_fields(b)
    for name, off in (("echo", False), ("suffix", ""), ("best_of", 1)):
        if b.get(name) is not None:
            check(type(b[name]) is type(off) and b[name] == off)
    if b.get("logprobs") is not None:
        in_range(b["logprobs"], 0, validate.MAX_TOP_LOGPROBS, whole=True)


# -- the cases -------------------------------------------------------------------------------------------------

CHAT_PATHS = [("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
              ("messages", 0, "name"), ("max_tokens",), ("max_completion_tokens",), ("temperature",), ("top_p",),
              ("top_k",), ("min_p",), ("repeat_penalty",), ("seed",), ("stop",), ("stream",), ("stream_options",),
              ("stream_options", "include_usage"), ("chat_template_kwargs",),
              ("chat_template_kwargs", "enable_thinking"), ("mtp",), ("n",), ("model",), ("presence_penalty",),
              ("frequency_penalty",), ("logprobs",), ("top_logprobs",), ("logit_bias",), ("tools",), ("functions",),
              ("tool_choice",), ("parallel_tool_calls",),
              ("response_format",), ("response_format", "type"), ("unknown_field",), ("unknown", "deeper")]
COMPLETION_PATHS = [("prompt",), ("prompt", 0), ("echo",), ("suffix",), ("best_of",), ("max_tokens",), ("stop",),
                    ("seed",), ("top_k",), ("n",), ("mtp",), ("logprobs",)]


def with_value(base: dict[str, Any], path: tuple[Any, ...]) -> str:
    """`base` as JSON text with MARK at `path` (an array or object made where the path needs one)."""
    body = copy.deepcopy(base)
    node: Any = body
    for key, below in zip(path, path[1:]):
        kind = list if isinstance(below, int) else dict
        child = node[key] if isinstance(node, list) else node.get(key)
        if not isinstance(child, kind):
            child = node[key] = kind()
        node = child
    if isinstance(node, list) and path[-1] == len(node):
        node.append(MARK)
    else:
        node[path[-1]] = MARK
    return json.dumps(body)


def cases(base: dict[str, Any], paths: list[tuple[Any, ...]]) -> Iterator[tuple[str, str]]:
    for path in paths:
        skeleton = with_value(base, path)
        for value in pool():
            yield f"{'.'.join(map(str, path))}={value[:40]}", skeleton.replace(json.dumps(MARK), value)


def run_cases(srv: LocalServer, route: str, base: dict[str, Any], paths: list[tuple[Any, ...]],
              valid: Callable[[Any], None]) -> tuple[int, int]:
    n_ok = n_bad = 0
    t_all = time.perf_counter()
    for case, text in cases(base, paths):
        try:
            valid(strict_json(text))
            want = 200
        except Invalid:
            want = 400
        t0 = time.perf_counter()
        status, data = post(srv, route, text.encode("utf-8", "surrogatepass"))
        assert time.perf_counter() - t0 < 10, case
        if want == 400:
            assert_openai_error(status, data, 400, case)
            n_bad += 1
        else:
            assert status == 200, (case, status, data[:300])
            n_ok += 1
    assert time.perf_counter() - t_all < 300
    return n_ok, n_bad


def test_generated_chat_bodies_are_answered_200_or_400(server) -> None:
    n_ok, n_bad = run_cases(server, "/v1/chat/completions", CHAT_BASE, CHAT_PATHS, valid_chat)
    assert n_bad > 1000 and n_ok > 100  # both sides of every field were tried


def test_generated_completion_bodies_are_answered_200_or_400(server) -> None:
    n_vocab = server.scheduler.engine.hp.n_vocab
    n_ok, n_bad = run_cases(server, "/v1/completions", COMPLETION_BASE, COMPLETION_PATHS,
                            lambda b: valid_completion(b, n_vocab))
    assert n_bad > 300 and n_ok > 30


def test_the_issue_cases(server) -> None:
    """The bodies issue 48 found answered 500, and the 1,000,000-character stop string that held the slot."""
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for case, body, param in [
        ("deep", b"[" * 1000 + b"]" * 1000, None),
        ("surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
        ("max_tokens", json.dumps({**chat, "max_tokens": 10 ** 12}).encode(), "max_tokens"),
        ("top_k", json.dumps({**chat, "top_k": 10 ** 15}).encode(), "top_k"),
        ("stop", json.dumps({**chat, "stop": "x" * 10 ** 6}).encode(), "stop"),
        ("stops", json.dumps({**chat, "stop": ["x"] * (validate.MAX_STOP_STRINGS + 1)}).encode(), "stop"),
        ("messages", json.dumps({"messages": [chat["messages"][0]] * (validate.MAX_MESSAGES + 1)}).encode(),
         "messages"),
    ]:
        t0 = time.perf_counter()
        err = assert_openai_error(*post(server, "/v1/chat/completions", body), 400, case)
        assert err["param"] == param and time.perf_counter() - t0 < 2, (case, err)


def test_a_prompt_too_big_for_any_context_is_not_tokenized(server) -> None:
    """7 MB of text took ~3 s of a core to tokenize before it was found over the context; its size shows it."""
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1_400_000}]}),
                        ("/v1/completions", {"prompt": "word " * 1_400_000})):
        t0 = time.perf_counter()
        err = assert_openai_error(*post(server, route, json.dumps(body).encode()), 400, route)
        assert err["code"] == "context_length_exceeded" and time.perf_counter() - t0 < 1.5, err
    err = assert_openai_error(*post(server, "/v1/completions", json.dumps({"prompt": "word " * 20_000}).encode()),
                              400, "counted")
    assert err["message"].startswith("the prompt has 20001 tokens")  # a prompt that might fit is counted


def test_max_tokens_is_capped_by_the_context(server) -> None:
    status, data = post(server, "/v1/completions", json.dumps(
        {"prompt": "In the beginning", "max_tokens": validate.MAX_TOKENS, "temperature": 0}).encode())
    out = json.loads(data)
    assert status == 200 and out["usage"]["total_tokens"] <= server.scheduler.engine.n_ctx


# -- headers ---------------------------------------------------------------------------------------------------

def media_types() -> Iterator[tuple[str | None, bool]]:
    """Content-Type values, each with whether it is JSON in UTF-8."""
    yield None, False
    for media in ("application/json", "Application/JSON", " application/json "):
        for params, ok in (("", True), ("; charset=utf-8", True), ('; charset="UTF-8"', True), ("; charset=utf8", True),
                           ("; charset=latin-1", False), ("; charset=utf-16", False), ("; boundary=x", True)):
            yield media + params, ok
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                  "text/json", "application/jsonx", "application/json-patch+json", "*/*", ""):
        yield media, False


@pytest.mark.parametrize("content_type, ok", list(media_types()))
def test_only_json_bodies(server, content_type: str | None, ok: bool) -> None:
    body = json.dumps(COMPLETION_BASE).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    if content_type is not None:
        conn.putheader("Content-Type", content_type)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if ok:
        assert resp.status == 200, data
    else:
        assert assert_openai_error(resp.status, data, 415, str(content_type))["code"] == "unsupported_media_type"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "x-gzip", "identity, gzip"])
def test_encoded_bodies_are_refused(server, encoding: str) -> None:
    body = gzip.compress(json.dumps(COMPLETION_BASE).encode())
    err = assert_openai_error(*post(server, "/v1/completions", body, {"Content-Encoding": encoding}), 415, encoding)
    assert err["code"] == "unsupported_media_type"
    assert post(server, "/v1/completions", json.dumps(COMPLETION_BASE).encode(),
                {"Content-Encoding": "identity"})[0] == 200


def browser_headers(port: int) -> Iterator[tuple[dict[str, str], bool]]:
    """Origin / Sec-Fetch-Site pairs as browsers send them, each with whether the server must answer."""
    own = [f"http://{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")]
    foreign = ["http://evil.example", "https://evil.example", "null", f"http://localhost:{port + 1}",
               f"http://127.0.0.1.evil.example:{port}", f"http://localhost:{port}.evil.example", CORS + ".evil",
               f"https://127.0.0.1:{port}", "http://127.0.0.1", "file://"]
    for site in (None, "same-origin", "same-site", "cross-site", "none"):
        extra = {} if site is None else {"Sec-Fetch-Site": site}
        for origin in own + [CORS]:
            yield {"Origin": origin, **extra}, True
        for origin in foreign:
            yield {"Origin": origin, **extra}, False
        yield extra, site in (None, "same-origin", "none")  # no Origin: a GET, or a program


def test_browser_origins(server) -> None:
    n = 0
    for headers, ok in browser_headers(server.port):
        for method, path, body in (("POST", "/v1/completions", json.dumps(COMPLETION_BASE).encode()),
                                   ("GET", "/v1/models", None)):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            if ok:
                assert resp.status == 200, (headers, method, data)
            else:
                assert assert_openai_error(resp.status, data, 403, str(headers))["code"] == "origin_not_allowed"
            n += 1
    assert n > 100
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)  # /health stays open to all
    conn.request("GET", "/health", headers={"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"})
    assert conn.getresponse().status == 200
    conn.close()
