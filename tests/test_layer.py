"""The one-call native decoder layer (engine/native/layer.c through engine.ops.layer) against the op-by-op path.

A forward pass with a hook runs every layer op by op (the hooks see each intermediate); without one, a layer whose
every piece is native runs in one call. The two must give the same bits, pass for pass: prefill, decode steps, a
captured verify pass, a commit that keeps part of it, and the MTP head's layer; on every native backend, with any
thread count, on Q8_0, K-quant MoE (with a Q5_K down projection) and dense models, and on llama.cpp's Q4_K_M mix, whose
projections over one input differ in type (layer.c's Parts).
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from engine import ops
from engine.models.build import load_model
from engine.storage.modelfile import default_model_path, open_model
from tests.fixtures import KQUANT_DENSE, KQUANT_MOE, TINY_MOE, UD_Q4_K_M_MOE, fixture_path, restore, snapshot
from tests.quantized import quantized_path

NATIVE = [b for b in ops.available_backends() if b.native]
MODELS = {
    "embedded-q8_0": lambda: default_model_path(),
    "moe-q8_0": lambda: fixture_path(replace(TINY_MOE, qtype="Q8_0")),
    "moe-ud-q4_k_m": lambda: fixture_path(UD_Q4_K_M_MOE),
    "dense-q4_k": lambda: fixture_path(KQUANT_DENSE),
    # llama.cpp's own Q4_K_M: a GDN layer's qkv in Q8_0 beside Q4_K gate, β and α; attention q Q4_K, k and v Q8_0
    "moe-llama-q4_k_m": lambda: quantized_path(KQUANT_MOE, "Q4_K_M"),
}


def _passes(path, backend: ops.Backend, hooked: bool, observed: bool = True,
            steps: list | None = None) -> tuple[list[torch.Tensor], list[str], dict]:
    """Logits and hidden rows of a fixed sequence of passes, the op names the backend's observer saw, and the
    routing counts (`steps`: gets the model's one-call decode step, when it has one)."""
    seen: list[str] = []
    model = load_model(open_model(path), n_ctx=128,
                       backend=backend.with_observer(lambda e: seen.append(e.op)) if observed else backend)
    hook = (lambda name, il, t: None) if hooked else None
    cache = model.new_cache(128)
    outs = []

    def keep(r) -> None:  # type: ignore[no-untyped-def]
        outs.extend([r.hidden, r.logits])

    keep(model.forward(list(range(5, 30)), cache, logit_rows="all", hook=hook))
    for t in (40, 41, 42):
        keep(model.forward([t], cache, logit_rows="all", hook=hook))
    keep(model.forward([43, 44, 45], cache, logit_rows="last", hook=hook))  # a short pass without captured states
    verify = model.forward([7, 8, 9, 10], cache, logit_rows="all", capture=True, hook=hook)
    keep(verify)
    cache.commit(verify.captured, 1)  # type: ignore[arg-type]
    cache.truncate(cache.pos - 2)
    keep(model.forward([3], cache, logit_rows="all", hook=hook))
    keep(model.forward([11, 12, 13, 14], cache, logit_rows="all", hook=hook))  # the verify's size, uncaptured
    verify = model.forward([15, 16, 17, 18], cache, logit_rows="all", capture=True, hook=hook)
    keep(verify)
    cache.commit(verify.captured, 0)  # type: ignore[arg-type]
    cache.truncate(cache.pos - 3)
    keep(model.forward([19], cache, logit_rows="all", hook=hook))
    if model.mtp is not None:
        mc = model.mtp.new_cache(128)
        h = outs[0]
        keep(model.mtp.forward(list(range(5, 30)), h, mc, logit_rows="all", hook=hook))
        keep(model.mtp.forward([40, 41], outs[-2][-2:], mc, logit_rows="all", hook=hook))
    if steps is not None:
        steps.append(model.step)
    return outs, seen, {k: v.clone() for k, v in model.model.routing.counts.items()}


@pytest.mark.parametrize("backend", NATIVE, ids=lambda b: b.name)
@pytest.mark.parametrize("model", list(MODELS))
def test_one_call_layer_gives_the_op_by_op_bits(model: str, backend: ops.Backend) -> None:
    path = MODELS[model]()
    op_outs, op_seen, op_counts = _passes(path, replace(backend, threads=1), hooked=True)
    one_outs, one_seen, one_counts = _passes(path, replace(backend, threads=2), hooked=False)
    mixer_ops = {"linear_many", "delta_rule", "attention"}  # what a layer run op by op reports
    assert "layer" not in op_seen and {"delta_rule", "attention"} <= set(op_seen)
    assert "layer" in one_seen and not mixer_ops & set(one_seen)  # every layer ran in one call
    assert len(op_outs) == len(one_outs)
    for i, (a, b) in enumerate(zip(op_outs, one_outs)):
        assert torch.equal(a, b), f"output {i}: max difference {(a - b).abs().max().item()}"
    assert op_counts.keys() == one_counts.keys()
    for k in op_counts:
        assert torch.equal(op_counts[k], one_counts[k])


@pytest.mark.parametrize("backend", NATIVE[:1] + NATIVE[-1:], ids=lambda b: b.name)
@pytest.mark.parametrize("model", list(MODELS))
def test_a_decode_step_in_one_call_gives_the_per_layer_bits(model: str, backend: ops.Backend) -> None:
    """Without an observer a pass of up to 16 rows runs every layer, the final norm and the head in one native call
    (ops.FusedStep: conv states written in place, or a verify's kept for its commit; routing counted natively); its
    logits, hidden rows, captured states (through a commit and the decode after it) and routing counts are those of
    a layer per call."""
    path = MODELS[model]()
    per_layer, _, counts = _passes(path, replace(backend, threads=2), hooked=False)
    steps: list = []
    stepped, seen, step_counts = _passes(path, replace(backend, threads=2), hooked=False, observed=False, steps=steps)
    assert isinstance(steps[0], ops.FusedStep) and not seen
    for i, (a, b) in enumerate(zip(per_layer, stepped)):
        assert torch.equal(a, b), f"output {i}: max difference {(a - b).abs().max().item()}"
    assert counts.keys() == step_counts.keys() and all(torch.equal(counts[k], step_counts[k]) for k in counts)


def test_a_step_given_token_ids_makes_their_embedding_rows_and_refuses_an_id_outside_the_table() -> None:
    """A fused step given token ids makes their embedding rows in its own native call, with ops.embedding's bits (a
    tensor of ids, embedded in Python first, gives the same hidden rows and logits); an id outside the vocabulary is
    an IndexError raised before any layer runs, and the cache is left as it was."""
    model = load_model(open_model(fixture_path(UD_Q4_K_M_MOE)), n_ctx=64, backend=NATIVE[-1])
    cache = model.new_cache(64)
    model.forward(list(range(5, 30)), cache, logit_rows="none")
    assert isinstance(model.step, ops.FusedStep) and model.step.embeds  # decided when the model loads
    snap, pos = snapshot(cache), cache.pos
    by_ids = model.forward([41, 42], cache, logit_rows="all")
    restore(cache, snap, pos)
    by_rows = model.forward(torch.tensor([41, 42]), cache, logit_rows="all")
    assert torch.equal(by_ids.hidden, by_rows.hidden) and torch.equal(by_ids.logits, by_rows.logits)
    restore(cache, snap, pos)
    for bad in ([model.hp.n_vocab], [41, -1]):
        with pytest.raises(IndexError, match="embedding table"):
            model.forward(bad, cache, logit_rows="all")
        assert cache.pos == pos
        for i, (conv, ssm) in snap.items():
            assert torch.equal(cache.gdn[i].conv, conv) and torch.equal(cache.gdn[i].ssm, ssm)
    again = model.forward([41, 42], cache, logit_rows="all")
    assert torch.equal(again.logits, by_ids.logits)


def test_layers_that_cannot_run_in_one_call_run_op_by_op() -> None:
    """F32 matrices have no native product: such a model runs its layers op by op on a native backend, and the
    torch backend never fuses; the runner says why (what `inspect` prints), naming the first such layer's piece."""
    seen: list[str] = []
    b = NATIVE[0].with_observer(lambda e: seen.append(e.op)) if NATIVE else ops.TORCH
    model = load_model(open_model(fixture_path(TINY_MOE)), n_ctx=32, backend=b)
    model.forward([1, 2, 3], model.new_cache(32))
    assert "layer" not in seen
    assert model.step_path() == ("op by op: layer 0 (and 3 more layers): GDN qkv (F32) runs a dequant product, "
                                 "not a native one" if NATIVE else "op by op: layer 0 (and 3 more layers): the torch "
                                 "backend has no native layer")
    if NATIVE:
        fused = load_model(open_model(quantized_path(KQUANT_MOE, "Q4_K_M")), n_ctx=32, backend=NATIVE[0])
        assert fused.step_path() == "one native call (fused step)"
    seen.clear()
    model = load_model(open_model(default_model_path()), n_ctx=32,
                       backend=ops.TORCH.with_observer(lambda e: seen.append(e.op)))
    model.forward([1, 2, 3], model.new_cache(32))
    assert "layer" not in seen and "linear_many" in seen


@pytest.mark.skipif(not NATIVE, reason="no native backend")
def test_the_section_clock_accounts_for_a_fused_pass() -> None:
    """native.trace_start/stop (bench/step_profile.py's breakdown): a one-token pass of the UD-Q4_K_M MoE fixture
    marks every section a GDN and an attention layer run, within the pass's wall time, with the weight bytes the
    layers read: their dense projections', and per MoE layer its k routed experts' and the shared expert's."""
    from engine.ops import native

    model = load_model(open_model(fixture_path(UD_Q4_K_M_MOE)), n_ctx=64, backend=NATIVE[0])
    cache = model.new_cache(64)
    model.forward(list(range(5, 20)), cache, logit_rows="none")
    native.trace_start()
    t0 = time.perf_counter()
    model.forward([3], cache, logit_rows="none")
    wall = time.perf_counter() - t0
    sec = native.trace_stop()
    assert set(sec) == set(native.TRACE_SECTIONS)
    for name in ("norm", "act_quant", "projection", "gdn_inputs", "recurrence", "gated_norm", "attention", "router",
                 "expert_products", "expert_misc"):  # (pool_wait and prefetch: only with a second thread)
        assert sec[name].marks > 0 and sec[name].seconds > 0, name
    assert sum(s.seconds for k, s in sec.items() if k not in ("pool_wait", "prefetch")) <= wall
    proj = experts = 0
    for fused in model.fused:  # the stacks each fused layer's products read, as layer.c binds them
        w = fused.w
        mixer = w.attn if w.attention else w.gdn
        proj += mixer.in_.expert_bytes + mixer.out.expert_bytes
        f = w.ffn
        experts += f.k_used * (f.gate.expert_bytes + f.up.expert_bytes + f.down.expert_bytes)
        experts += f.sg.expert_bytes + f.su.expert_bytes + f.sd.expert_bytes  # zero without a shared expert
    assert sec["projection"].weight_bytes == proj > 0
    assert sec["expert_products"].weight_bytes == experts > 0
    native.trace_start()
    sec = native.trace_stop()
    assert all(s.seconds == 0 and s.marks == 0 for s in sec.values())  # start zeroes, and off nothing is counted


@pytest.mark.parametrize("backend", NATIVE[:1], ids=lambda b: b.name)
def test_prefetching_workers_never_disturb_a_call(backend: ops.Backend) -> None:
    """The fused layers hand the pool's workers ranges to prefetch between their products (pool.c pool_prefetch: a
    job nobody waits for, whose items are not counted done). Decode steps on 2, 3 and 5 threads (more than the cores:
    workers preempted mid-prefetch, until the pool runs calls alone) give the one-thread bits, step after step. The embedded model: big enough for
    its products to take the pool's threads (the test fixtures' run on one)."""
    path = default_model_path()

    def steps(threads: int) -> list[torch.Tensor]:
        model = load_model(open_model(path), n_ctx=96, backend=replace(backend, threads=threads))
        cache = model.new_cache(96)
        out = [model.forward(list(range(5, 20)), cache, logit_rows="all").logits]
        for t in range(40):
            out.append(model.forward([(7 * t) % 50 + 1], cache, logit_rows="all").logits)
        return out

    from engine.ops import native

    ref = steps(1)
    for threads in (2, 3, 5):
        got = steps(threads)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert torch.equal(a, b), (threads, i)
    # and the workers were handed ranges: in a process of its own, as an earlier test's busy process can leave this
    # one's pool running calls alone (solo mode, no prefetching) for a while; on a host whose other tenants take the
    # second core, solo mode can last seconds, so the steps go on (up to 20 s) until some step prefetched
    code = ("import time, engine; from dataclasses import replace; from engine import ops; from engine.ops import native; "
            "from engine.models.build import load_model; from engine.storage.modelfile import default_model_path, "
            "open_model; b = [x for x in ops.available_backends() if x.native][0]; "
            "m = load_model(open_model(default_model_path()), n_ctx=64, backend=replace(b, threads=2)); "
            "c = m.new_cache(64); m.forward(list(range(5, 20)), c); end = time.monotonic() + 20; marks = 0\n"
            "while marks == 0 and time.monotonic() < end:\n"
            "    c.truncate(15); native.trace_start(); [m.forward([t + 1], c) for t in range(20)]\n"
            "    marks = native.trace_stop()['prefetch'].marks\n"
            "print(marks)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) > 0, out.stdout
