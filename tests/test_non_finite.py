"""Damaged weights that still load (finite but absurd values) give non-finite logits at run time: the engine stops with
a typed error naming the file and the first layer that went non-finite, and greedy sampling never turns a NaN row into
token 0 (issue 48)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import NonFiniteLogitsError
from engine.events import EngineConfig, GenerationConfig
from engine.generate import load
from engine.sampling import Sampler, SamplingConfig
from tests.fixtures import TINY_MOE, fixture_path
from tests.gguf_mutate import layout


def _damaged_copy(tmp_path: Path, tensor: str, value: float) -> Path:
    """The F32 MoE fixture with every value of one tensor set to `value` (finite: the reader accepts it)."""
    out = tmp_path / "damaged.gguf"
    shutil.copy(fixture_path(TINY_MOE), out)
    buf = bytearray(out.read_bytes())
    t = next(t for t in layout(bytes(buf)).tensors if t.name == tensor)
    n = int(np.prod(t.ne))
    buf[t.offset:t.offset + 4 * n] = np.full(n, value, dtype=np.float32).tobytes()
    out.write_bytes(bytes(buf))
    return out


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_a_model_whose_logits_go_non_finite_is_reported_as_damaged(tmp_path: Path, mtp: bool) -> None:
    path = _damaged_copy(tmp_path, "blk.2.ffn_down_exps.weight", 3e38)
    eng = load(str(path), EngineConfig(n_ctx=64))
    with pytest.raises(NonFiniteLogitsError, match=r"damaged\.gguf is damaged: .* not finite .*layer 2\b"):
        list(eng.generate([5, 6, 7, 8], GenerationConfig(max_tokens=8, mtp=mtp)))
    assert eng.consistent() and not eng.busy  # the engine is left usable (and empty)


def test_sampling_refuses_a_non_finite_row_instead_of_naming_a_token() -> None:
    row = torch.randn(50)
    for bad in (float("nan"), float("inf")):
        r = row.clone()
        r[7] = bad
        for cfg in (SamplingConfig(), SamplingConfig(temperature=0.8, top_k=5, seed=1)):
            with pytest.raises(NonFiniteLogitsError):
                Sampler(cfg).sample(r, [])
    with pytest.raises(NonFiniteLogitsError):  # every logit -inf: nothing to pick
        Sampler(SamplingConfig()).sample(torch.full((50,), float("-inf")), [])
    assert Sampler(SamplingConfig()).sample(row, []) == int(row.argmax())
