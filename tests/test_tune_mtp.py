"""engine.training.tune_mtp: the head learns chained drafting, the trunk's bytes do not change."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from engine.events import GenerationConfig, Token
from engine.generate import load
from engine.storage.modelfile import open_model
from engine.training.train import TrainConfig, losses
from engine.training.tune_mtp import check_trunk_identical, head_prefix, load_params, tune, write_tuned
from tests.fixtures import TINY_MOE, fixture_path

Q8 = dataclasses.replace(TINY_MOE, qtype="Q8_0")


def test_loaded_parameters_reproduce_the_file() -> None:
    mf = open_model(fixture_path(TINY_MOE))
    params = load_params(mf)
    for name in ("blk.0.ssm_a", "blk.4.nextn.eh_proj.weight", "output.weight"):
        assert torch.equal(params.tensor(name).detach(), mf.tensor(name).dequantize().float())


def test_tuning_changes_only_the_head_and_lowers_its_chained_loss(tmp_path) -> None:
    src = fixture_path(Q8)
    mf = open_model(src)
    params = load_params(mf)
    prefix = head_prefix(mf)
    rng = np.random.default_rng(0)
    # A learnable stream: a fixed random sequence repeated, so the tokens two and three ahead are determined.
    base = rng.integers(0, Q8.n_vocab - 3, 37)
    stream = torch.tensor(np.tile(base, 40)[:16 * 33], dtype=torch.long).view(16, 33)
    data = (stream, torch.ones(stream.shape))
    cfg = TrainConfig(seq_len=32, batch=4, mtp_chain=(0.8, 0.6))
    before = [float(x) for x in losses(params, stream[:4], cfg, trunk_loss=False, per_depth=True)[3]]
    trunk_before = {n: p.detach().clone() for n, p in params.p.items() if not n.startswith(prefix.replace(".", "__"))}
    hist = tune(params, data, cfg, prefix, seconds=120, lr=3e-3, max_steps=30, log=lambda s: None)
    after = [float(x) for x in losses(params, stream[:4], cfg, trunk_loss=False, per_depth=True)[3]]
    assert hist[-1]["step"] == 30
    assert after[1] < 0.8 * before[1] and after[2] < 0.8 * before[2], (before, after)
    assert all(torch.equal(params.p[n], v) for n, v in trunk_before.items())  # frozen
    out = tmp_path / "tuned.gguf"
    changed = write_tuned(src, out, params, prefix)
    assert changed and all(n.startswith(prefix) for n in changed)
    check_trunk_identical(src, out, prefix)  # raises when a trunk tensor or the metadata differ
    a, b = GGUFReader(src), GGUFReader(out)
    assert any(not np.array_equal(x.data, y.data) for x, y in zip(a.tensors, b.tensors) if x.name.startswith(prefix))
    eng = load(out)
    toks = [ev for ev in eng.generate([1, 2, 3], GenerationConfig(max_tokens=8, mtp=True, draft=2))
            if isinstance(ev, Token)]
    assert toks


def test_check_trunk_identical_catches_a_changed_trunk(tmp_path) -> None:
    src = fixture_path(Q8)
    mf = open_model(src)
    params = load_params(mf)
    with torch.no_grad():
        params.p["blk__0__attn_norm__weight"].add_(1.0)
    out = tmp_path / "bad.gguf"
    write_tuned(src, out, params, "blk.0.")  # rewrites a trunk tensor on purpose
    with pytest.raises(AssertionError, match="blk.0"):
        check_trunk_identical(src, out, head_prefix(mf))
