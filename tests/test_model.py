"""The forward pass against itself: any chunking of a prompt, the chunked GDN form and the one-token
recurrence must agree; the debug hook sees every named intermediate."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.storage.modelfile import open_model
from engine.models.build import load_model
from engine.models.runner import Runner
from tests.fixtures import KQUANT_MOE, TINY_DENSE, TINY_MOE, FixtureSpec, fixture_path, restore, snapshot

N_TOK = 96


def _model(spec: FixtureSpec) -> Runner:
    return load_model(open_model(fixture_path(spec)), n_ctx=1024)


def _tokens(spec: FixtureSpec, n: int = N_TOK, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, spec.n_vocab - 3, n).tolist()


def _run_chunks(m: Runner, toks: list[int], sizes: list[int], chunked: bool) -> torch.Tensor:
    cache = m.new_cache(1024)
    rows, s = [], 0
    i = 0
    while s < len(toks):
        n = sizes[i % len(sizes)]
        rows.append(m.forward(toks[s:s + n], cache, logit_rows="all", chunked=chunked).logits)
        s += n
        i += 1
    return torch.cat(rows)


@pytest.mark.parametrize("spec", [TINY_MOE, TINY_DENSE], ids=["moe", "dense"])
def test_prefill_chunkings_match_decode(spec: FixtureSpec) -> None:
    m = _model(spec)
    toks = _tokens(spec)
    decode = _run_chunks(m, toks, [1], chunked=False)
    std = decode.std().item()
    for sizes in ([N_TOK], [7], [64], [1, 30, 5], [13, 64]):
        got = _run_chunks(m, toks, sizes, chunked=True)
        rel = (got - decode).abs().max().item() / std
        assert rel <= 1e-4, (sizes, rel)


def test_chunked_delta_rule_crosses_chunk_boundaries() -> None:
    # 64-token chunks inside the GDN: a 150-token pass has two boundaries and a ragged tail.
    m = _model(TINY_MOE)
    toks = _tokens(TINY_MOE, 150, seed=3)
    a = _run_chunks(m, toks, [150], chunked=True)
    b = _run_chunks(m, toks, [1], chunked=False)
    assert (a - b).abs().max().item() / b.std().item() <= 1e-4


def test_chunked_differs_from_a_wrong_recurrence() -> None:
    # Negative control: breaking the decay (g → 0) must change the logits far beyond the tolerance.
    m = _model(TINY_MOE)
    toks = _tokens(TINY_MOE, 40)
    ref = _run_chunks(m, toks, [40], chunked=True)
    layer = m.model.layers[0].mixer
    saved = layer.w.a.clone()
    layer.w.a.zero_()
    try:
        broken = _run_chunks(m, toks, [40], chunked=True)
    finally:
        layer.w.a.copy_(saved)
    assert (broken - ref).abs().max().item() / ref.std().item() > 1e-2


def test_debug_hook_names() -> None:
    m = _model(TINY_MOE)
    seen: dict[tuple[str, int], tuple[int, ...]] = {}
    m.forward(_tokens(TINY_MOE, 5), m.new_cache(64), logit_rows="all",
              hook=lambda name, il, t: seen.__setitem__((name, il), tuple(t.shape)))
    hp = m.hp
    assert seen[("inp_embd", -1)] == (5, hp.n_embd)
    assert seen[("result_output", -1)] == (5, hp.n_vocab)
    for il in range(hp.n_layer):
        assert ("l_out", il) in seen and ("attn_norm", il) in seen and ("ffn_moe_logits", il) in seen
    assert ("conv_output_silu", 0) in seen and ("Qcur", 3) in seen
    assert seen[("ffn_moe_logits", 0)] == (5, hp.n_expert)


def test_cache_truncate_and_state_capture() -> None:
    m = _model(KQUANT_MOE)
    toks = _tokens(KQUANT_MOE, 12)
    c = m.new_cache(64)
    m.forward(toks[:8], c, logit_rows="none")
    snap = snapshot(c)
    res = m.forward(toks[8:], c, logit_rows="all", capture=True)
    # Commit the state after position 1 of the 4-token pass, truncate the attention cache to match,
    # and continue: the result equals a run that never saw tokens 10 and 11.
    c.commit(res.captured, 1)
    c.truncate(10)
    cont = m.forward([5], c, logit_rows="last").logits
    c2 = m.new_cache(64)
    m.forward(toks[:10], c2, logit_rows="none")
    ref = m.forward([5], c2, logit_rows="last").logits
    assert torch.equal(cont, ref)
    restore(c, snap, 8)
    again = m.forward(toks[8:], c, logit_rows="all").logits
    assert torch.equal(again, res.logits)
    with pytest.raises(ValueError):
        c.truncate(c.pos + 1)
    assert c.state_nbytes > 0 and c.nbytes > c.state_nbytes
