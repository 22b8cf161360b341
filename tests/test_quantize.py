"""Our float → ggml encoders produce valid blocks that ggml's decoder reads back close to the input."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from engine.storage.quantize import quantize, random_blocks

# RMS error bounds relative to the data's std for plain round-to-nearest with per-sub-block scales.
BOUNDS = {T.Q4_K: 0.10, T.Q5_K: 0.05, T.Q6_K: 0.025, T.Q8_0: 0.01, T.F16: 1e-3}


@pytest.mark.parametrize("qtype", list(BOUNDS), ids=lambda t: t.name)
def test_roundtrip_error(qtype: T) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 512)) * 0.05 + rng.normal(0, 0.01, (16, 1))).astype(np.float32)
    y = gq.dequantize(quantize(x, qtype), qtype) if qtype != T.F16 else quantize(x, qtype).astype(np.float32)
    rel = np.sqrt(((y - x) ** 2).mean()) / x.std()
    assert rel < BOUNDS[qtype], rel
    # Constant rows and all-zero rows must not produce NaN/inf (zero scales).
    z = np.zeros((2, 256), np.float32)
    z[1] = 0.3
    assert np.isfinite(gq.dequantize(quantize(z, qtype), qtype) if qtype != T.F16 else quantize(z, qtype)).all()


def test_k_quants_need_256_wide_rows() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 128), np.float32), T.Q4_K)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_random_blocks_are_valid_and_scaled(qtype: T) -> None:
    raw = random_blocks((32, 1024), qtype, np.random.default_rng(1), std=0.02)
    y = gq.dequantize(raw, qtype)
    assert y.shape == (32, 1024) and np.isfinite(y).all()
    assert 0.01 < y.std() < 0.04 and abs(y.mean()) < 0.005
