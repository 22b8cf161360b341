"""The native element-wise functions (kernels.h exp_f, silu_f, sigmoid_f, and the loops over them): whichever vector
width the CPU's clone of a loop uses, every element gets the bits of the scalar definition, which numpy replays here
operation by operation in float32; and they stay within a few ulp of the exact functions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.ops import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no native library")
F = np.float32


def _exp_f(x: np.ndarray) -> np.ndarray:
    """kernels.h exp_f, step for step in float32 (numpy does no contraction into FMAs)."""
    with np.errstate(over="ignore", invalid="ignore"):
        big = x > F(88.72283935546875)
        x = np.minimum(x, F(88.3762626647949))
        x = np.maximum(x, F(-87.3365478515625))
        t = x * F(1.44269504088896341)
        n = (t + F(12582912.0)) - F(12582912.0)
        r = (x - n * F(0.693359375)) - n * F(-2.12194440e-4)
        p = F(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = p * r + F(c)
        p = (p * (r * r) + r) + F(1.0)
        scale = ((n.astype(np.int32) + 127) << 23).view(np.float32)
        return np.where(big, F(np.inf), p * scale).astype(np.float32)


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    edges = np.array([0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0, 20.0, -20.0, 87.0, -87.0, 87.5, -87.5, 88.5, -88.5, 88.8,
                      -88.8, 100.0, -100.0, 1e30, -1e30, np.inf, -np.inf], dtype=np.float32)
    # 1003 + 22 values: not a multiple of any vector width, so every clone's tail loop runs too
    return np.concatenate([rng.normal(0, 4, 1003).astype(np.float32), edges])


def test_silu_and_sigmoid_give_the_scalar_definitions_bits() -> None:
    x = _inputs()
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        silu_ref = x / (F(1.0) + _exp_f(-x))
        sig_ref = F(1.0) / (F(1.0) + _exp_f(-x))
    xt = torch.from_numpy(x.copy())
    assert np.array_equal(native.silu(xt).numpy(), silu_ref, equal_nan=True)
    u = torch.from_numpy(np.linspace(-2, 2, x.size, dtype=np.float32))
    assert np.array_equal(native.silu_mul(xt.clone(), u).numpy(), (silu_ref * u.numpy()).astype(np.float32),
                          equal_nan=True)
    ones = torch.ones(x.size)
    assert np.array_equal(native.sigmoid_mul(ones, xt).numpy(), sig_ref, equal_nan=True)


def test_exp_f_is_within_two_ulp_where_silu_and_sigmoid_use_it() -> None:
    x = np.linspace(-87.0, 88.0, 200001, dtype=np.float32)
    got = _exp_f(x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - exact) / ulp) <= 2.0
    # and the native functions built on it against float64 references
    xt = torch.from_numpy(np.linspace(-30, 30, 10001, dtype=np.float32))
    ref = (xt.double() * torch.sigmoid(xt.double())).float()
    assert torch.allclose(native.silu(xt), ref, rtol=4e-7, atol=1e-30)
