"""Parallel requests (`serve --parallel N`): sequences decoded together, each with its own cache, joining and leaving
between steps. Every greedy reply equals the one it gets alone (the multi-sequence pass is batch-invariant), a client
that leaves mid-batch frees its place at once, and the engine-level batch keeps each sequence's tokens as they join,
leave and reuse a slot's cached prefix."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import openai
import pytest
import torch

import engine.generate
from engine import ops
from engine.batch import Batch
from engine.consume import collect
from engine.events import Done, GenerationConfig, Stats, Token
from engine.models.runner import ManyChoice, Runner
from engine.server.run import LocalServer
from tests.test_server import LONG_PROMPT, client, metric, stream_then_leave

PROMPTS = ["In the beginning", "And God said, Let there be light", "The LORD is my shepherd", "Blessed are the meek",
           "Now the serpent was more subtil", "And Noah begat", "Honour thy father", "In my Father's house"]


@pytest.fixture(scope="module")
def eng():
    return engine.generate.load(None)


@pytest.fixture(scope="module")
def server(eng):
    srv = LocalServer(eng, port=0, parallel=4, max_waiting=4)
    srv.start()
    yield srv
    srv.stop()


def complete(c: openai.OpenAI, prompt: str, **kw) -> openai.types.Completion:
    return c.completions.create(model="m", prompt=prompt, temperature=0, **kw)


def test_eight_concurrent_clients_get_their_one_at_a_time_replies(server) -> None:
    c = client(server)
    alone = [complete(c, p, max_tokens=40) for p in PROMPTS]
    batched0 = server.scheduler.batch.batched_steps
    start = threading.Barrier(len(PROMPTS))

    def one(p: str) -> openai.types.Completion:
        start.wait(10)
        return complete(c, p, max_tokens=40)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(one, PROMPTS))
    assert time.perf_counter() - t0 < 30
    for a, b in zip(alone, together):
        assert b.choices[0].text == a.choices[0].text
        assert b.usage.completion_tokens == a.usage.completion_tokens
        assert b.choices[0].finish_reason == a.choices[0].finish_reason
    assert server.scheduler.batch.batched_steps > batched0  # some steps ran several sequences in one pass
    assert metric(server, "num_requests_running") == 0 and metric(server, "num_requests_waiting") == 0


def test_a_client_leaving_mid_batch_frees_its_place(eng) -> None:
    """Two places and no queue: while one reply goes on, another's client leaves, and a third request is then taken
    (not refused with 429) and answered."""
    srv = LocalServer(eng, port=0, parallel=2, max_waiting=0)
    srv.start()
    try:
        c = client(srv)
        long_reply = ThreadPoolExecutor(1)
        going = long_reply.submit(lambda: list(complete(c, LONG_PROMPT, max_tokens=2000, stream=True)))
        deadline = time.monotonic() + 10
        while srv.metrics.running < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        body = b'{"prompt": "And God said", "max_tokens": 2000, "temperature": 0, "stream": true}'

        def both_running() -> None:
            assert srv.metrics.running == 2

        stream_then_leave(srv, body, both_running)
        deadline = time.monotonic() + 10
        while srv.metrics.finished["abort"] < 1:
            assert time.monotonic() < deadline, "the generation went on after the client left"
            time.sleep(0.01)
        assert not going.done()  # the long reply is still being decoded
        third = complete(c, "Honour thy father", max_tokens=8)
        assert third.choices[0].finish_reason in ("stop", "length") and third.usage.completion_tokens >= 1
        chunks = going.result(60)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        long_reply.shutdown()
        assert srv.metrics.rejected == 0 and srv.metrics.running == 0
    finally:
        srv.stop()


def test_batch_sequences_join_leave_and_reuse_a_prefix(eng) -> None:
    """Sequences joining a batch at different steps, alone (with MTP) or together, and a request extending a finished
    one's sequence (prefilled from where that one stopped): each gets the tokens it gets from `Engine.generate`."""
    gens = [GenerationConfig(max_tokens=n, mtp=mtp) for n, mtp in ((30, True), (12, False), (24, True))]
    prompts = [eng.encode_prompt(p) for p in PROMPTS[:3]]
    want = [collect(eng.generate(p, g)).tokens for p, g in zip(prompts, gens)]
    batch = Batch(eng, 2)
    got: dict[object, list[int]] = {}
    final: dict[object, Stats] = {}
    seqs = []
    for step in range(200):
        if step in (0, 3) or step > 3 and not batch.full and len(seqs) < 3:
            seqs.append(batch.add(prompts[len(seqs)], gens[len(seqs)]))
        if not batch.active:
            break
        for s, ev in batch.step():
            assert not isinstance(ev, Exception)
            if isinstance(ev, Token):
                got.setdefault(s, []).extend(ev.ids)
            elif isinstance(ev, Stats) and ev.final:
                final[s] = ev
    assert [got[s] for s in seqs] == want and batch.batched_steps > 0
    follow = prompts[2] + want[2] + eng.encode_prompt(" And")  # the last reply's sequence, extended
    again = batch.add(follow, gens[1])
    events = [ev for _ in range(100) if batch.active for _, ev in batch.step()]
    # in the slot: the prompt and every token generated (an end token too) but the last, which was not yet run
    assert again.n_prefill == len(follow) - len(prompts[2]) - final[seqs[2]].generated_tokens + 1
    assert [i for ev in events if isinstance(ev, Token) for i in ev.ids] == collect(eng.generate(follow, gens[1])).tokens
    assert isinstance(events[-1], Done)


def _batched_replies(eng, prompts: list[list[int]], gens: list[GenerationConfig]) -> tuple[list[list[int]], Batch]:
    batch = Batch(eng, len(prompts), verify=True)
    seqs = [batch.add(p, g) for p, g in zip(prompts, gens)]
    got: dict[object, list[int]] = {s: [] for s in seqs}
    for _ in range(400):
        if not batch.active:
            break
        for s, ev in batch.step():
            assert not isinstance(ev, Exception), ev
            if isinstance(ev, Token):
                got[s].extend(ev.ids)
    return [got[s] for s in seqs], batch


def test_drafts_verified_among_other_sequences_rows_keep_every_reply(eng) -> None:
    """Sequences with MTP in a batch (depths 2 and 4, auto, one without MTP, one under a JSON schema) verify their
    drafts in the pass shared with the others' rows: each greedy reply is its one-at-a-time reply without MTP; a
    seeded sampled one is its one-at-a-time reply with the same MTP settings."""
    from engine.constrain import Constraint
    from engine.sampling import SamplingConfig

    schema = Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    gens = [GenerationConfig(max_tokens=40, mtp=True, draft=2), GenerationConfig(max_tokens=32, mtp=True, draft=4),
            GenerationConfig(max_tokens=36, mtp=True), GenerationConfig(max_tokens=24, mtp=False),
            GenerationConfig(max_tokens=40, mtp=True, draft=3, constraint=schema)]
    prompts = [eng.encode_prompt(p) for p in PROMPTS[:len(gens)]]
    want = [collect(eng.generate(p, replace(g, mtp=False))).tokens for p, g in zip(prompts, gens)]
    got, batch = _batched_replies(eng, prompts, gens)
    assert got == want
    assert batch.shared_verifies > 10  # verifies ran among the other sequences' rows
    sampled = [GenerationConfig(max_tokens=40, mtp=True, draft=3, sampling=SamplingConfig(temperature=0.8, seed=s))
               for s in (3, 4)] + [GenerationConfig(max_tokens=30, mtp=False)]
    prompts = prompts[:len(sampled)]
    want = [collect(eng.generate(p, g)).tokens for p, g in zip(prompts, sampled)]
    got, batch = _batched_replies(eng, prompts, sampled)
    assert got == want and batch.shared_verifies > 0


def test_forced_runs_share_a_pass_with_other_sequences_rows(eng) -> None:
    """Sequences under a nested schema run their forced runs (several rows a sequence, logits after each one's last)
    in the pass shared with the others' single rows: each greedy reply is its one-at-a-time reply, and a seeded
    sampled one too."""
    from bench.constrain import SCHEMA
    from engine.constrain import Constraint
    from engine.sampling import SamplingConfig

    schema = Constraint.json_schema(SCHEMA)
    gens = [GenerationConfig(max_tokens=120, mtp=False, constraint=schema), GenerationConfig(max_tokens=48, mtp=False),
            GenerationConfig(max_tokens=120, mtp=False, constraint=schema,
                             sampling=SamplingConfig(temperature=0.8, seed=5)),
            GenerationConfig(max_tokens=80, mtp=True, draft=2, constraint=schema)]
    prompts = [eng.encode_prompt(p) for p in PROMPTS[:len(gens)]]
    want = [collect(eng.generate(p, g)).tokens for p, g in zip(prompts, gens)]
    passes: list[list[int]] = []
    many = eng.runner.forward_many

    def counted(tokens, *a, **kw):  # type: ignore[no-untyped-def]
        passes.append([len(t) for t in tokens])
        return many(tokens, *a, **kw)
    eng.runner.forward_many = counted
    try:
        got, _ = _batched_replies(eng, prompts, gens)
    finally:
        del eng.runner.forward_many
    assert got == want
    assert any(len(rows) > 1 and max(rows) > 2 for rows in passes)  # a forced run beside other sequences' rows


def test_verify_choice_tries_verifying_now_and_then_and_keeps_the_faster_form() -> None:
    """Batched steps with drafts verified yield 3 tokens in 2 s where plain ones yield 1 token in 1 s (or 1 token in
    2 s, slower than plain): plain runs first, verifying is tried at the 16th window; then the faster form runs and
    the slower is retried after 16, 32, 64, 128, 256, 256 ... windows."""
    from engine.batch import VerifyChoice

    for verify_faster in (True, False):
        choice, forms = VerifyChoice(), []
        for _ in range(1200 * VerifyChoice.WINDOW):
            form = choice.verify(4)
            forms.append(form)
            choice.observe(4, 3 if form and verify_faster else 1, 2.0 if form else 1.0)
        windows = forms[::VerifyChoice.WINDOW]
        assert all(w == windows[0] for w in forms[:VerifyChoice.WINDOW])
        assert windows[:16] == [False] * 15 + [True]
        slower = [i + 1 for i, w in enumerate(windows) if w != verify_faster and i >= 16]
        gaps = [b - a for a, b in zip(slower, slower[1:])]
        assert slower[0] == 32 and gaps[:5] == [32, 64, 128, 256, 256], slower


def test_forward_many_gives_every_rows_logits_op_by_op() -> None:
    """On a backend without the one-call step (torch), the shared pass op by op (Qwen35Model.several): with all_rows,
    the logits of every row of sequences of 1, 3 and 2 rows, each row's those of its sequence's own pass."""
    from engine.generate import EngineConfig

    eng = engine.generate.load(None, EngineConfig(backend=ops.backend_named("torch")))
    runner = Runner(eng.model, step_graphs="off")
    assert runner.step is None
    prompts = [eng.encode_prompt(p) for p in PROMPTS[:3]]
    news = [[11], [12, 13, 14], [15, 16]]

    def started() -> list:
        caches = [runner.new_cache(256) for _ in prompts]
        for p, c in zip(prompts, caches):
            runner.forward(p, c)
        return caches
    caches = started()
    runner.many.pick = lambda k: True  # the shared pass (not each sequence's own)
    got = runner.forward_many(news, caches, all_rows=True).logits
    want = torch.cat([runner.forward(n, c, logit_rows="all").logits for n, c in zip(news, started())])
    assert got.shape[0] == 6 and torch.equal(got, want)


def test_parallel_flag_is_checked() -> None:
    out = subprocess.run([sys.executable, "-m", "engine", "serve", "--parallel", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: argument --parallel: parallel 0 is out of range: it must be 1…64 (see foretell-cli serve --help)"]


def test_forward_many_gives_each_sequence_its_own_bits_in_both_forms(eng) -> None:
    """Runner.forward_many over three sequences, step after step, in the form its timings choose (each form is tried
    first): the logits each sequence gets alone."""
    runner = Runner(eng.model, step_graphs="off")
    prompts = [eng.encode_prompt(p) for p in PROMPTS[3:6]]

    def alone(ids: list[int]) -> list[torch.Tensor]:
        cache = runner.new_cache(256)
        out = [runner.forward(ids, cache).logits[-1]]
        for _ in range(9):
            out.append(runner.forward([int(out[-1].argmax())], cache).logits[-1])
        return out

    want = [alone(p) for p in prompts]
    caches = [runner.new_cache(256) for _ in prompts]
    rows = [runner.forward(p, c).logits[-1] for p, c in zip(prompts, caches)]
    for step in range(1, 10):
        res = runner.forward_many([[int(r.argmax())] for r in rows], caches)
        rows = list(res.logits)
        assert all(torch.equal(r, w[step]) for r, w in zip(rows, want)), step
    assert all(len(runner.many.times[(3, form)]) >= ManyChoice.TRY for form in (True, False))


def _retries(choice: ManyChoice, passes: int, cost: dict[bool, int], k: int = 4) -> list[int]:
    """The passes at which `choice` ran its slower form (apart), each form timed at `cost[form]` ns."""
    out = []
    for n in range(passes):
        form = choice.pick(k)
        if not form:
            out.append(n)
        choice.observe(k, form, cost[form])
    return out


def test_many_choice_retries_a_far_slower_form_ever_less_often_and_follows_a_change() -> None:
    """Separate passes 4x slower than the shared one (a model whose pass is weights read): after the first tries they
    are retried ever less often (64, 128, 256 ... passes apart, at most 1,024); a form only a little slower keeps its 64-pass retries;
    and when the separate passes become the faster, a retry finds it and they run from then on."""
    far = _retries(ManyChoice(), 6000, {True: 1_000, False: 4_000})
    tried, retries = far[:ManyChoice.TRY], far[ManyChoice.TRY:]
    assert tried == [1, 3, 5]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert gaps[:5] == [64, 128, 256, 512, 1024] and all(g == ManyChoice.EVERY_MAX for g in gaps[5:]), gaps
    near = _retries(ManyChoice(), 1000, {True: 1_000, False: 1_100})
    assert all(b - a == ManyChoice.EVERY for a, b in zip(near[ManyChoice.TRY + 1:], near[ManyChoice.TRY + 2:]))
    choice = ManyChoice()
    _retries(choice, 3000, {True: 1_000, False: 4_000})
    later = _retries(choice, 2000, {True: 1_000, False: 500})  # the host changed: apart is now twice as fast
    assert len(later) > 1000 and later[-1] == 1999


def test_one_native_call_over_sequences_of_several_rows_gives_each_its_own_bits(eng) -> None:
    """The fused step over several sequences at once (layer.c decoder_layers_many), sequences of 1, 3 and 2 new rows
    at different positions: each row's hidden state and logits are those of its sequence's own pass, and every cache
    holds what its own passes leave (the next step from it gives the same logits again)."""
    runner = Runner(eng.model, step_graphs="off")
    step = runner.step
    assert step is not None and step.embeds
    prompts = [eng.encode_prompt(p) for p in PROMPTS[:3]]
    news = [[11], [12, 13, 14], [15, 16]]

    def alone() -> tuple[list, list]:
        caches = [runner.new_cache(256) for _ in prompts]
        for p, c in zip(prompts, caches):
            runner.forward(p, c)
        return [runner.forward(t, c, logit_rows="all") for t, c in zip(news, caches)], caches

    want, want_caches = alone()
    caches = [runner.new_cache(256) for _ in prompts]  # the same states again, then the new rows of all in one call
    for p, c in zip(prompts, caches):
        runner.forward(p, c)
    h, logits = step.many(news, caches, eng.model.rope(eng.model.device), True)
    assert logits is not None
    at = 0
    for w, t in zip(want, news):
        assert torch.equal(h[at:at + len(t)], w.hidden) and torch.equal(logits[at:at + len(t)], w.logits)
        at += len(t)
    for c, t, wc in zip(caches, news, want_caches):
        c.pos += len(t)
        nxt = [int(logits[0].argmax())]
        assert torch.equal(runner.forward(nxt, c).logits, runner.forward(nxt, wc).logits)
    # a step that does not embed takes the rows made by the model's embedding, with the same bits
    m = eng.model
    plain = ops.fuse_step(runner.fused, [layer.il for layer in m.layers], [None] * len(m.layers), m.output_norm,
                          m.hp.rms_eps, m.output)
    assert plain is not None and not plain.embeds
    caches = [runner.new_cache(256) for _ in prompts]
    for p, c in zip(prompts, caches):
        runner.forward(p, c)
    x = m.embed([t for toks in news for t in toks]).float().contiguous()
    h2, logits2 = plain.many(news, caches, m.rope(m.device), True, x)
    assert torch.equal(h2, h) and torch.equal(logits2, logits)  # type: ignore[arg-type]
