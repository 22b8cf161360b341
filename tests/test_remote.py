"""Remote engines (engine.remote) against real servers on 127.0.0.1: llama.cpp's own server in-process
(xllamacpp, the embedded model with draft-mtp and /metrics), Foretell's own server, and a stub for what vLLM
and SGLang report and for each fault: refused, unreachable, 401, unknown model, timeouts, a stream cut or
broken mid-reply, an error inside the stream, no usage, and stop."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

import engine.generate
from engine.chat import Message
from engine.cli import main
from engine.events import Done, GenerationConfig, Stats, Token
from engine.remote import (RemoteAuthError, RemoteConfig, RemoteError, RemoteModelError, RemoteTimeoutError,
                           RemoteUnreachableError, connect, list_models)
from engine.remote import spec_sources
from engine.remote.http import normalize_url
from engine.sampling import SamplingConfig
from engine.server.run import LocalServer
from tests.remote_stub import WORDS, Behaviour, Stub, llama_server

QUESTION = [Message("user", "Who made the heaven?")]


def run(eng, prompt=QUESTION, stop=None, **gen):
    """(text, final stats, done) of one reply."""
    text, final, done = [], None, None
    for ev in eng.generate(prompt, GenerationConfig(**gen), stop):
        if isinstance(ev, Token):
            text.append(ev.text)
        elif isinstance(ev, Stats) and ev.final:
            final = ev
        elif isinstance(ev, Done):
            done = ev
    return "".join(text), final, done


@pytest.fixture(scope="module")
def llama_url():
    server = llama_server()
    yield server.listening_address
    del server


@pytest.fixture(scope="module")
def foretell():
    eng = engine.generate.load(None)
    srv = LocalServer(eng, port=0)
    srv.start()
    yield eng, srv
    srv.stop()


# -- llama.cpp's server ------------------------------------------------------------------------------------------
def test_llama_server_streamed_chat_with_acceptance_from_timings(llama_url) -> None:
    eng = connect(RemoteConfig(llama_url))
    assert eng.server == "llama.cpp" and not eng.mtp_per_request and eng.counters_at_connect is not None
    text, st, done = run(eng, max_tokens=6)
    assert text and done.reason in ("max_tokens", "eos")
    assert st.final and 1 <= st.generated_tokens <= 6 and st.prompt_tokens > 5
    assert st.ttft_s > 0 and st.elapsed_s >= st.ttft_s
    sp = st.speculative
    assert sp is not None and sp.source.startswith("timings") and not sp.server_wide
    assert 0 < sp.accepted <= sp.drafted and sp.acceptance == pytest.approx(sp.accepted / sp.drafted)
    if sp.source == "timings + /metrics":  # the delta was this request alone: depths from the counters
        assert sum(sp.accepted_by_depth) == sp.accepted and len(sp.acceptance_by_depth) == 2


def test_llama_server_acceptance_from_metrics_deltas(llama_url) -> None:
    eng = connect(RemoteConfig(llama_url))
    before = spec_sources.counters(eng.wire.get_text("/metrics", root=True))
    _, st, _ = run(eng, max_tokens=6)
    after = spec_sources.counters(eng.wire.get_text("/metrics", root=True))
    delta = spec_sources.from_counter_delta(before, after)
    assert before.prefix == "llamacpp:" and delta is not None and delta.source == "/metrics" and delta.server_wide
    assert (delta.drafted, delta.accepted) == (st.speculative.drafted, st.speculative.accepted)
    assert sum(delta.accepted_by_depth) == delta.accepted and delta.verify_steps > 0


def test_cli_generate_remote_prints_the_local_json_shape(llama_url, capsys) -> None:
    assert main(["generate", "--remote", llama_url, "--prompt", "Who made the heaven?", "--max-tokens", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] and out["stats"]["generated_tokens"] <= 4 and out["stats"]["stop_reason"] == "max_tokens"
    for key in ("prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s", "mtp", "drafted", "accepted",
                "acceptance_by_depth"):
        assert key in out["stats"]
    assert out["stats"]["remote"]["server"] == "llama.cpp" and out["stats"]["source"].startswith("timings")


# -- Foretell's own server ---------------------------------------------------------------------------------------
def test_foretell_server_same_text_as_local_and_mtp_per_request(foretell) -> None:
    local_eng, srv = foretell
    local, _, _ = run(local_eng, max_tokens=10, draft=2)
    eng = connect(RemoteConfig(srv.url, model="foretell-demo"))
    assert eng.server == "foretell" and eng.models == ["foretell-demo"] and eng.n_ctx == local_eng.n_ctx
    text, st, done = run(eng, max_tokens=10, draft=2)
    assert text == local and done.reason == "max_tokens" and st.generated_tokens == 10
    sp = st.speculative
    assert sp.source == "timings + /metrics" and sp.drafted > 0 and sum(sp.accepted_by_depth) == sp.accepted
    assert 1 < sp.mean_accepted_length <= 3 and st.decode_tok_s > 0
    text_plain, st_plain, _ = run(eng, max_tokens=10, mtp=False)  # sent per request: the server drafts nothing
    assert text_plain == local and st_plain.speculative is None and not st_plain.mtp


def test_raw_text_and_token_prompts_use_completions(foretell) -> None:
    _, srv = foretell
    eng = connect(RemoteConfig(srv.url))
    text, st, _ = run(eng, "In the beginning", max_tokens=4)
    assert text and st.prompt_tokens == len(engine.generate.load(None).tokenizer.encode("In the beginning",
                                                                                       special=True))
    text_ids, st_ids, _ = run(eng, [1, 2, 3], max_tokens=3)
    assert text_ids and st_ids.prompt_tokens == 3


# -- what vLLM and SGLang report -------------------------------------------------------------------------------
def _check_vllm_numbers(sp) -> None:
    assert (sp.drafted, sp.accepted, sp.verify_steps) == (6, 4, 3)
    assert sp.accepted_by_depth == [3, 1] and sp.acceptance_by_depth == pytest.approx([1.0, 1 / 3])
    assert sp.mean_accepted_length == pytest.approx(1 + 4 / 3) and sp.acceptance == pytest.approx(4 / 6)


def test_vllm_per_request_metrics_preferred_over_counters() -> None:
    b = Behaviour(request_metrics=True, counters=True)
    with Stub(b) as stub:
        stub.drafts = 50  # other clients' history: the per-request figures must not include it
        eng = connect(RemoteConfig(stub.url))
        text, st, done = run(eng, max_tokens=5, draft=3, sampling=SamplingConfig(repeat_penalty=1.1))
    assert text == "".join(WORDS[:5]) and done.reason == "max_tokens" and st.generated_tokens == 5
    assert st.speculative.source == "request metrics" and not st.speculative.server_wide
    _check_vllm_numbers(st.speculative)
    sent = b.requests[0]
    assert "mtp" not in sent and "speculative.n_max" not in sent and sent["repetition_penalty"] == 1.1
    assert eng.notices and "server's own setting" in eng.notices[0]


def test_vllm_counter_deltas_are_server_wide() -> None:
    with Stub(Behaviour(counters=True)) as stub:
        stub.draft_tokens, stub.accepted, stub.drafts, stub.per_pos = 600, 400, 300, [300, 100]
        _, st, _ = run(connect(RemoteConfig(stub.url)), max_tokens=3)
    assert st.speculative.source == "/metrics" and st.speculative.server_wide
    _check_vllm_numbers(st.speculative)


def test_live_acceptance_from_metrics_while_streaming() -> None:
    """Before the last chunk, the charts get the /metrics delta so far (read at most once a second)."""
    with Stub(Behaviour(counters=True, count_midway=True, chunk_delay_s=0.25)) as stub:
        eng = connect(RemoteConfig(stub.url))
        live = [ev for ev in eng.generate(QUESTION, GenerationConfig(max_tokens=10))
                if isinstance(ev, Stats) and not ev.final]
    with_spec = [st.speculative for st in live if st.speculative is not None]
    assert live[0].speculative is None  # nothing drafted yet at the first read
    assert with_spec and with_spec[-1].source == "/metrics" and with_spec[-1].drafted == 6
    assert live[-1].generated_tokens >= 6 and live[-1].decode_tok_s > 0


def test_reasoning_content_arrives_as_a_thinking_block() -> None:
    """A server that splits thinking off (reasoning_content) gives the same text a local model writes."""
    with Stub(Behaviour(reasoning=2)) as stub:
        text, _, _ = run(connect(RemoteConfig(stub.url)), max_tokens=4)
        thinking_only, _, _ = run(connect(RemoteConfig(stub.url)), max_tokens=2)
    assert text == "<think>\nIn the\n</think>\n\n beginning was"
    assert thinking_only == "<think>\nIn the\n</think>\n\n"  # a reply that ends while thinking is closed


def test_sglang_gauges_then_server_info() -> None:
    with Stub(Behaviour(owner="sglang", gauges=True, server_info=True)) as stub:
        _, st, _ = run(connect(RemoteConfig(stub.url)), max_tokens=3)
    sp = st.speculative
    assert (sp.source, sp.server_wide, sp.acceptance, sp.mean_accepted_length) == ("sglang gauges", True, 0.7, 2.4)
    with Stub(Behaviour(owner="sglang", server_info=True)) as stub:
        _, st, _ = run(connect(RemoteConfig(stub.url)), max_tokens=3)
    assert (st.speculative.source, st.speculative.mean_accepted_length) == ("/server_info", 2.75)
    with Stub(Behaviour(owner="sglang")) as stub:  # nothing reported: no figures rather than made-up ones
        _, st, _ = run(connect(RemoteConfig(stub.url)), max_tokens=3)
    assert st.speculative is None and not st.mtp


# -- faults ------------------------------------------------------------------------------------------------------
def test_refused_and_unreachable() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(RemoteUnreachableError, match="refused"):
        connect(RemoteConfig(f"127.0.0.1:{port}"))
    # a listener whose accept queue is full drops new connection attempts: a host that does not answer
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    held = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(lst.getsockname())
        held.append(c)
    t0 = time.monotonic()
    with pytest.raises(RemoteUnreachableError, match="did not answer within 0.5 s"):
        connect(RemoteConfig(f"http://127.0.0.1:{lst.getsockname()[1]}/v1", connect_timeout_s=0.5))
    assert time.monotonic() - t0 < 5
    for c in held + [lst]:
        c.close()


def test_api_key_and_unknown_model() -> None:
    with Stub(Behaviour(api_key="k1", model="qwen3.5-397b")) as stub:
        with pytest.raises(RemoteAuthError, match="401.*Invalid API key"):
            connect(RemoteConfig(stub.url, api_key="wrong"))
        assert list_models(stub.url, "k1") == ["qwen3.5-397b"]
        with pytest.raises(RemoteModelError, match="does not serve 'qwen3.6'.*qwen3.5-397b"):
            connect(RemoteConfig(stub.url, api_key="k1", model="qwen3.6"))
    with Stub(Behaviour(status=404)) as stub:  # listed, then refused at request time (unloaded meanwhile)
        with pytest.raises(RemoteModelError, match="does not exist"):
            run(connect(RemoteConfig(stub.url)), max_tokens=3)


def test_timeout_before_the_first_token_raises() -> None:
    with Stub(Behaviour(delay_first_s=3)) as stub:
        eng = connect(RemoteConfig(stub.url, read_timeout_s=0.5))
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeoutError, match="sent nothing for 0.5 s"):
            run(eng, max_tokens=3)
        assert time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("behaviour, why", [
    (Behaviour(stall_after=3, stall_s=3), "sent nothing for 0.5 s"),
    (Behaviour(cut_after=3), "ended the stream before the reply was finished"),
    (Behaviour(abort_after=3), "ended the stream before the reply was finished"),  # the connection dropped
    (Behaviour(error_after=3), "CUDA out of memory"),
])
def test_a_reply_broken_mid_way_is_kept_and_marked(behaviour, why) -> None:
    with Stub(behaviour) as stub:
        text, st, done = run(connect(RemoteConfig(stub.url, read_timeout_s=0.5)), max_tokens=8)
    assert text == "".join(WORDS[:3]) and st.final and st.generated_tokens == 3
    assert done.reason == "interrupted" and why in done.message and "kept" in done.message


def test_no_usage_counts_chunks_and_says_so() -> None:
    with Stub(Behaviour(usage=False)) as stub:
        eng = connect(RemoteConfig(stub.url))
        text, st, done = run(eng, max_tokens=4)
    assert text == "".join(WORDS[:4]) and st.generated_tokens == 4 and st.prompt_tokens == 0
    assert done.reason == "max_tokens" and any("no token usage" in n for n in eng.notices)


def test_stop_is_honoured_at_once() -> None:
    with Stub(Behaviour(chunk_delay_s=0.05, stall_after=2, stall_s=20)) as stub:
        eng = connect(RemoteConfig(stub.url))
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        t0 = time.monotonic()
        text, st, done = run(eng, max_tokens=8, stop=stop)
        assert time.monotonic() - t0 < 2  # not the 20 s the server stalls for
    assert done.reason == "stopped" and text == "".join(WORDS[:2])


def test_cli_faults_are_one_line(capsys) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert main(["generate", "--remote", f"127.0.0.1:{port}", "--prompt", "hi", "--json"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "refused" in err
    with Stub(Behaviour(api_key="k")) as stub:
        assert main(["generate", "--remote", stub.url, "--prompt", "hi", "--json"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "API key" in err
    assert main(["generate", "--api-key", "k", "--prompt", "hi"]) == 2  # a remote option without --remote
    assert capsys.readouterr().err == "error: --api-key and --remote-model go with --remote URL\n"
    with Stub(Behaviour(cut_after=2)) as stub:
        assert main(["generate", "--remote", stub.url, "--prompt", "hi", "--json", "--max-tokens", "5"]) == 1
        cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["partial"] and out["text"] == "".join(WORDS[:2]) and out["stats"]["stop_reason"] == "interrupted"
    assert out["tokens"] == [100, 101]  # vLLM's token_ids, asked for with return_token_ids
    lines = cap.err.strip().splitlines()  # notes (the server's own MTP setting), then the one error line
    assert lines[-1].startswith("error: ") and "kept" in lines[-1] and all(ln.startswith("note: ") for ln in lines[:-1])


def test_base_url_forms() -> None:
    for given in ("gpu:8000", "http://gpu:8000", "http://gpu:8000/", "http://gpu:8000/v1", "http://gpu:8000/v1/"):
        assert normalize_url(given) == "http://gpu:8000/v1"
    with pytest.raises(RemoteError, match="not an http"):
        normalize_url("ftp://gpu")
