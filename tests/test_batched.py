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

from engine.experts import ExpertWeights, route, run_experts
from engine.modelfile import open_model
from engine.models.qwen35 import Qwen35Model
from tests.fixtures import KQUANT_MOE, TINY_DENSE, TINY_MOE, FixtureSpec, fixture_path

Q8_MOE = FixtureSpec(qtype="Q8_0")
# Q4_K/Q6_K/Q8_0 run in the native kernels (engine.kquant: AVX512 here, and its portable C twin) or, where the
# library is missing, in the torch paths (Q8_0 in torch integer ops, K-quants in dequantized tiles, and the GDN
# recurrence as torch ops): all three must be batch-invariant.
SPECS = [(TINY_MOE, None), (TINY_DENSE, None), (KQUANT_MOE, "native"), (KQUANT_MOE, "portable"),
         (KQUANT_MOE, "torch"), (Q8_MOE, "native"), (Q8_MOE, "portable"), (Q8_MOE, "torch")]
IDS = ["moe-f32", "dense-f32", "moe-q4k", "moe-q4k-portable", "moe-q4k-torch", "moe-q8", "moe-q8-portable",
       "moe-q8-torch"]


def _kquant_mode(monkeypatch, mode: str | None) -> None:
    import engine.kquant as kq
    import engine.nativelib as nl

    assert nl.available(), "the native library was not built (pip install -e . builds it)"
    if mode == "portable":
        monkeypatch.setattr(kq, "PORTABLE", True)
    elif mode == "torch":  # and the GDN recurrence as torch ops
        monkeypatch.setattr(kq, "usable", lambda w, x: False)
        monkeypatch.setattr(nl, "floats_usable", lambda *t: False)


def _model(spec: FixtureSpec) -> Qwen35Model:
    return Qwen35Model(open_model(fixture_path(spec)), n_ctx=1100)


def _toks(spec: FixtureSpec, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, spec.n_vocab - 3, n).tolist()


def _per_token(m: Qwen35Model, toks: list[int], cache=None) -> torch.Tensor:
    cache = cache or m.new_cache(1100)
    return torch.cat([m.forward([t], cache, logit_rows="all").logits for t in toks])


@pytest.mark.parametrize("spec,mode", SPECS, ids=IDS)
def test_verify_sized_passes_are_bit_identical(monkeypatch, spec: FixtureSpec, mode: str | None) -> None:
    _kquant_mode(monkeypatch, mode)
    m = _model(spec)
    prefix = _toks(spec, 20, seed=1)
    tail = _toks(spec, 8, seed=2)
    base = m.new_cache(1100)
    m.forward(prefix, base, logit_rows="none")
    snap = base.snapshot()
    ref = _per_token(m, tail, base)
    for n in range(2, 9):
        base.restore(snap, len(prefix))
        got = m.forward(tail[:n], base, logit_rows="all", capture=True).logits
        assert torch.equal(got, ref[:n]), n


@pytest.mark.parametrize("spec,mode", SPECS, ids=IDS)
def test_prefill_chunks_are_bit_identical(monkeypatch, spec: FixtureSpec, mode: str | None) -> None:
    _kquant_mode(monkeypatch, mode)
    m = _model(spec)
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
def test_q8_expert_and_block_layouts_give_the_same_bits(monkeypatch, dense_macs: int, down_blockdiag_macs: int,
                                                        gate_up_blockdiag_macs: int) -> None:
    """The integer path picks a layout by size (block-diagonal or per-block GEMMs, all selected experts at
    once or a loop over experts); every layout must give the per-token bits. The shared expert is twice a
    routed expert's width here, so it runs as two extra slots of every token."""
    import engine.q8dot as q8

    spec = replace(Q8_MOE, n_ff_shexp=2 * Q8_MOE.n_ff_exp)
    m = _model(spec)
    toks = _toks(spec, 40, seed=6)
    ref = _per_token(m, toks)
    monkeypatch.setattr(q8, "DENSE_EXPERT_MACS", dense_macs)
    monkeypatch.setattr(q8, "_DOWN_BLOCKDIAG_MACS", down_blockdiag_macs)
    monkeypatch.setattr(q8, "_GATE_UP_BLOCKDIAG_MACS", gate_up_blockdiag_macs)
    for rows in (0, 1 << 20):  # per-block GEMMs for every pass, or block-diagonal for every pass
        monkeypatch.setattr(q8, "_BLOCKDIAG_ROWS", rows)
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
    snap = c.snapshot()
    cap = m.forward(toks, c, logit_rows="none", capture=True).captured
    c.restore(snap, 5)
    for i, t in enumerate(toks):
        m.forward([t], c, logit_rows="none")
        for il, st in c.gdn.items():
            assert torch.equal(cap.conv[il][i], st.conv), (il, i)
            assert torch.equal(cap.ssm[il][i], st.ssm), (il, i)


@pytest.mark.parametrize("mode", ["native", "torch"])
def test_grouped_experts_equal_per_token_and_read_each_expert_once(monkeypatch, mode: str) -> None:
    _kquant_mode(monkeypatch, mode)
    mf = open_model(fixture_path(KQUANT_MOE))
    p = "blk.1."
    ew = ExpertWeights(mf.tensor(p + "ffn_gate_exps.weight"), mf.tensor(p + "ffn_up_exps.weight"),
                       mf.tensor(p + "ffn_down_exps.weight"))
    router = mf.tensor(p + "ffn_gate_inp.weight").dequantize()
    x = torch.randn(9, KQUANT_MOE.n_embd, generator=torch.Generator().manual_seed(0))
    w, idx = route(x @ router.T, KQUANT_MOE.n_expert_used)
    gathered: list[tuple[int, ...]] = []
    import engine.experts as ex
    import engine.kquant as kq

    if mode == "torch":
        real = ex.gather_experts
        monkeypatch.setattr(ex, "gather_experts", lambda t, e: gathered.append(tuple(e)) or real(t, e))
    else:  # one kernel call per projection; each selected expert is one group (its blocks read once)
        real_pairs = kq.matmul_pairs
        monkeypatch.setattr(kq, "matmul_pairs", lambda xr, t, rows, e, s: gathered.append(tuple(e.tolist()))
                            or real_pairs(xr, t, rows, e, s))
    grouped = run_experts(x, idx, w, ew)
    # gate, up and down are each gathered once, for exactly the selected experts, each expert once.
    assert len(gathered) == 3 and all(g == tuple(sorted(torch.unique(idx).tolist())) for g in gathered)
    single = torch.cat([run_experts(x[i:i + 1], idx[i:i + 1], w[i:i + 1], ew) for i in range(9)])
    assert torch.equal(grouped, single)


def test_native_grouping_equals_a_stable_argsort() -> None:
    """nativelib.group_pairs gives the order, experts and counts of the torch grouping it replaces."""
    import engine.nativelib as nl

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
