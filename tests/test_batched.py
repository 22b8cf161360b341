"""Multi-token passes (prefill, speculative verify) are bit-identical to one token at a time.

Grouped-by-expert MoE reduced in slot order, rowwise projections, per-query attention and the
sequential GDN recurrence make a pass over N tokens give each token exactly the bits of N one-token
passes; the per-position GDN states it captures equal the states reached token by token.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import ops
from engine.ops.experts import route
from engine.storage.modelfile import open_model
from engine.models.build import load_model
from engine.models.runner import Runner
from tests.conftest import backend_params
from tests.fixtures import KQUANT_MOE, TINY_DENSE, TINY_MOE, FixtureSpec, fixture_path, restore, snapshot

Q8_MOE = FixtureSpec(qtype="Q8_0")
# Every backend the machine runs must be batch-invariant: the native kernels in each instruction-set form (Q4_K /
# Q6_K / Q8_0 products, attention, the GDN recurrence) and the torch backend (Q8_0 in torch integer ops, K-quants in
# dequantized tiles, attention and the recurrence as torch ops).
BACKENDS = backend_params()
SPECS = [pytest.param(TINY_MOE, None, id="moe-f32"), pytest.param(TINY_DENSE, None, id="dense-f32")] + [
    pytest.param(spec, p.values[0], id=f"{name}-{p.id}", marks=p.marks)
    for spec, name in ((KQUANT_MOE, "moe-q4k"), (Q8_MOE, "moe-q8")) for p in BACKENDS]


def _model(spec: FixtureSpec, backend: ops.Backend | None = None) -> Runner:
    return load_model(open_model(fixture_path(spec)), n_ctx=1100, backend=backend)


def _toks(spec: FixtureSpec, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, spec.n_vocab - 3, n).tolist()


def _per_token(m: Runner, toks: list[int], cache=None) -> torch.Tensor:
    cache = cache or m.new_cache(1100)
    return torch.cat([m.forward([t], cache, logit_rows="all").logits for t in toks])


@pytest.mark.parametrize("spec,backend", SPECS)
def test_verify_sized_passes_are_bit_identical(spec: FixtureSpec, backend: ops.Backend | None) -> None:
    m = _model(spec, backend)
    prefix = _toks(spec, 20, seed=1)
    tail = _toks(spec, 8, seed=2)
    base = m.new_cache(1100)
    m.forward(prefix, base, logit_rows="none")
    snap = snapshot(base)
    ref = _per_token(m, tail, base)
    for n in range(2, 9):
        restore(base, snap, len(prefix))
        got = m.forward(tail[:n], base, logit_rows="all", capture=True).logits
        assert torch.equal(got, ref[:n]), n


@pytest.mark.parametrize("spec,backend", SPECS)
def test_prefill_chunks_are_bit_identical(spec: FixtureSpec, backend: ops.Backend | None) -> None:
    m = _model(spec, backend)
    toks = _toks(spec, 512, seed=3)
    ref = _per_token(m, toks)
    for size in (1, 7, 64, 512):
        cache = m.new_cache(1100)
        got = torch.cat([m.forward(toks[s:s + size], cache, logit_rows="all").logits for s in range(0, 512, size)])
        assert torch.equal(got, ref), size


@pytest.mark.parametrize("dense_macs,down_blockdiag_macs,gate_up_blockdiag_macs",
                         [(0, 0, 0), (1 << 40, 1 << 40, 1 << 40), (1 << 40, 0, 1 << 40), (1 << 40, 1 << 40, 0)],
                         ids=["expert-loop", "dense-experts", "dense-experts-per-block-down",
                              "dense-experts-per-block-gate-up"])
def test_q8_expert_and_block_layouts_give_the_same_bits(dense_macs: int, down_blockdiag_macs: int,
                                                        gate_up_blockdiag_macs: int) -> None:
    """The torch backend's integer Q8_0 products pick a layout by size (block-diagonal or per-block GEMMs, all
    selected experts at once or a loop over experts); every layout must give the per-token bits. The shared expert
    is twice a routed expert's width here, so it runs as two extra slots of every token."""
    spec = replace(Q8_MOE, n_ff_shexp=2 * Q8_MOE.n_ff_exp)
    toks = _toks(spec, 40, seed=6)
    ref = _per_token(_model(spec, ops.TORCH), toks)
    for rows in (0, 1 << 20):  # per-block GEMMs for every pass, or block-diagonal for every pass
        layouts = ops.Int8Layouts(blockdiag_rows=rows, dense_expert_macs=dense_macs,
                                  down_blockdiag_macs=down_blockdiag_macs,
                                  gate_up_blockdiag_macs=gate_up_blockdiag_macs)
        m = _model(spec, replace(ops.TORCH, int8=layouts))
        assert m.model.layers[0].ffn.w.experts.runs_shared
        for size in (1, 3, 40):
            cache = m.new_cache(64)
            got = torch.cat([m.forward(toks[s:s + size], cache, logit_rows="all").logits for s in range(0, 40, size)])
            assert torch.equal(got, ref), (dense_macs, rows, size)


@pytest.mark.parametrize("spec", [TINY_MOE, KQUANT_MOE], ids=["f32", "q4k"])
def test_captured_states_equal_token_by_token_states(spec: FixtureSpec) -> None:
    m = _model(spec)
    toks = _toks(spec, 6, seed=4)
    c = m.new_cache(64)
    m.forward(_toks(spec, 5, seed=5), c, logit_rows="none")
    snap = {il: (st.conv.clone(), st.ssm.clone()) for il, st in c.gdn.items()}
    cap = m.forward(toks, c, logit_rows="none", capture=True).captured
    for il, (conv, ssm) in snap.items():  # back to the state before the pass: replay it token by token
        c.gdn[il].conv, c.gdn[il].ssm = conv, ssm.clone()
    c.truncate(5)
    for i, t in enumerate(toks):
        m.forward([t], c, logit_rows="none")
        for il, st in c.gdn.items():
            assert torch.equal(cap.conv[il][i], st.conv), (il, i)
            assert torch.equal(cap.ssm[il][i], st.ssm), (il, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_experts_equal_per_token_and_read_each_expert_once(backend: ops.Backend) -> None:
    """A pass's experts grouped by expert give each token the bits of a one-token pass, and the pass reads each
    selected expert once (the backend's observer reports the distinct experts and their bytes)."""
    mf = open_model(fixture_path(KQUANT_MOE))
    p = "blk.1."
    events: list[ops.OpEvent] = []
    b = backend.with_observer(events.append)
    ex = ops.bind_experts(*(mf.tensor(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down")), b)
    assert ex.kind == ("native" if backend.native else "dequant")
    router = mf.tensor(p + "ffn_gate_inp.weight").dequantize()
    x = torch.randn(9, KQUANT_MOE.n_embd, generator=torch.Generator().manual_seed(0))
    w, idx = route(x @ router.T, KQUANT_MOE.n_expert_used)
    grouped = ops.moe_experts(x, idx, w, ex)
    distinct = torch.unique(idx).numel()
    assert [(e.op, e.experts, e.nbytes, e.rows) for e in events] == \
        [("moe_experts", distinct, distinct * ex.expert_bytes(), 9)]
    single = torch.cat([ops.moe_experts(x[i:i + 1], idx[i:i + 1], w[i:i + 1], ex) for i in range(9)])
    assert torch.equal(grouped, single)


def test_native_grouping_equals_a_stable_argsort() -> None:
    """The native grouping gives the order, experts and counts of the torch grouping it replaces."""
    from engine.ops import native as nl

    assert nl.available(), "the native library was not built (pip install -e . builds it)"
    idx = torch.tensor(np.random.default_rng(3).integers(0, 16, (9, 4)), dtype=torch.long)
    idx[2] = torch.tensor([15, 0, 7, 3])
    g = nl.group_pairs(idx, 16)
    flat = idx.reshape(-1)
    ref = torch.argsort(flat, stable=True)
    e_ref, c_ref = torch.unique_consecutive(flat[ref], return_counts=True)
    assert torch.equal(g.order, ref) and torch.equal(g.tokens, ref // 4)
    assert torch.equal(g.experts, e_ref) and torch.equal(g.counts, c_ref)
    assert torch.equal(g.starts, torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(c_ref, 0)]))
    with pytest.raises(ValueError):
        nl.group_pairs(torch.tensor([[0, 16]]), 16)


@pytest.mark.parametrize("backend", backend_params(native_only=True))
def test_native_experts_pass_equals_the_torch_twin(backend: ops.Backend) -> None:
    """The one-call native pass (engine/native/moe.c: grouping, gate/up, silu·up, down, slot sum) computes what the
    torch backend computes from the dequantized experts with llama.cpp's activation rounding, to float32 rounding of
    the products' scaling (6e-7 of the largest output here; a slot weight on the wrong expert is off by order 1)."""
    mf = open_model(fixture_path(KQUANT_MOE))
    p = "blk.1."
    ws = [mf.tensor(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down")]
    router = mf.tensor(p + "ffn_gate_inp.weight").dequantize()
    x = torch.randn(6, KQUANT_MOE.n_embd, generator=torch.Generator().manual_seed(1))
    w, idx = route(x @ router.T, KQUANT_MOE.n_expert_used)
    native = ops.moe_experts(x, idx, w, ops.bind_experts(*ws, backend))
    twin = ops.moe_experts(x, idx, w, ops.bind_experts(*ws, ops.TORCH))
    torch.testing.assert_close(native, twin, rtol=0, atol=1e-5 * twin.abs().max().item())


@pytest.mark.parametrize("backend", backend_params(native_only=True))
def test_one_call_moe_layer_equals_the_layer_op_by_op(backend: ops.Backend) -> None:
    """The whole MoE layer in one native call (router, softmax, top-k, routed experts, shared expert and its gate:
    ops.moe_ffn) against the model's own description of it run op by op (MoE.math) on the same weights: the same
    experts in the same slots, routing weights and output to float32 rounding (a sum order differs: the router's
    dot products; an expert in the wrong slot or a missing shared expert is off by order 1)."""
    model = load_model(open_model(fixture_path(KQUANT_MOE)), n_ctx=64, backend=backend)
    ffn = model.model.layers[1].ffn
    assert ffn.w.experts.one_call(ffn.w.router, ffn.w.shared) is not None  # this layer runs in one call
    x = torch.randn(5, KQUANT_MOE.n_embd, generator=torch.Generator().manual_seed(2))
    noop = lambda name, il, t: None  # noqa: E731
    one = ops.moe_ffn(x, ffn.w.router, ffn.w.experts, ffn.w.shared, KQUANT_MOE.n_expert_used,
                      twin=lambda t: pytest.fail("the twin ran"))
    ref = ffn.math(x, noop)
    assert torch.equal(one.idx, ref.idx)
    torch.testing.assert_close(one.logits, ref.logits, rtol=0, atol=1e-5 * ref.logits.abs().max().item())
    torch.testing.assert_close(one.weights, ref.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one.y, ref.y, rtol=0, atol=1e-5 * ref.y.abs().max().item())
    for i in (0, 3):  # each token's row is a one-token call's row
        single = ops.moe_ffn(x[i:i + 1], ffn.w.router, ffn.w.experts, ffn.w.shared, KQUANT_MOE.n_expert_used,
                             twin=lambda t: pytest.fail("the twin ran"))
        assert torch.equal(single.y, one.y[i:i + 1]) and torch.equal(single.idx, one.idx[i:i + 1])
