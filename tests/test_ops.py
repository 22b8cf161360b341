"""engine.ops as a door: backends, binding, the activation memo and the observer."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine import ops
from engine.ops.activations import LastInputs
from engine.storage.qtensor import QTensor
from tests.conftest import backend_params
from tests.test_quant import random_tensor


def test_backends_are_listed_fastest_first_and_named() -> None:
    bs = ops.available_backends()
    assert bs[-1] == ops.TORCH and ops.default_backend() == bs[0]
    assert all(ops.backend_named(b.name) == b for b in bs)
    with pytest.raises(ValueError, match="not available"):
        ops.backend_named("native-sse2")
    with pytest.raises(ValueError):
        ops.Backend("native", "torch")
    assert ops.Backend("native", "portable").on("cuda").name == "torch"  # native kernels run on the CPU only


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_activation_memo_keeps_the_last_inputs_only(size: int) -> None:
    memo: LastInputs[int] = LastInputs(size)
    xs = [torch.zeros(4) for _ in range(6)]
    for i, x in enumerate(xs):
        memo.put(x, i)
    assert len(memo._items) == size
    assert [memo.get(x) for x in xs] == [None] * (6 - size) + list(range(6 - size, 6))
    xs[-1].add_(1)  # an in-place change is a miss
    assert memo.get(xs[-1]) is None


def test_weights_are_bound_once_to_a_kind_of_product() -> None:
    q8 = QTensor(random_tensor(QT.Q8_0, (32, 64), seed=0, wide=False), QT.Q8_0, (32, 64))
    q5 = QTensor(random_tensor(QT.Q5_K, (4, 256), seed=1, wide=False), QT.Q5_K, (4, 256))
    f16 = QTensor(random_tensor(QT.F16, (4, 48), seed=2), QT.F16, (4, 48))  # rows not whole 32-value chunks
    f32 = QTensor(random_tensor(QT.F32, (4, 64), seed=3), QT.F32, (4, 64))  # no native product
    native = [b for b in ops.available_backends() if b.native]
    for b in native:
        assert [ops.bind(w, b).kind for w in (q8, q5, f16, f32)] == ["native", "native", "dequant", "dequant"]
    assert [ops.bind(w, ops.TORCH).kind for w in (q8, q5, f16)] == ["int8", "dequant", "dequant"]
    assert ops.bind(torch.randn(3, 64), ops.default_backend()).kind == "float"


def test_the_observer_sees_every_product_with_its_bytes() -> None:
    events: list[ops.OpEvent] = []
    b = ops.default_backend().with_observer(events.append)
    ws = [QTensor(random_tensor(QT.Q8_0, (32, 64), seed=s, wide=False), QT.Q8_0, (32, 64)) for s in range(3)]
    lins = tuple(ops.bind(w, b) for w in ws)
    x = torch.randn(5, 64)
    y = ops.linear(x, lins[0])
    parts = ops.linear_many(x, lins)
    assert [(e.op, e.nbytes, e.rows) for e in events] == [("linear", ws[0].nbytes, 5),
                                                         ("linear_many", sum(w.nbytes for w in ws), 5)]
    assert torch.equal(parts[0], y)  # a stacked product gives each weight's own bits
    quiet = ops.bind(ws[0], replace(b, observer=None))
    assert torch.equal(ops.linear(x, quiet), y) and len(events) == 2


@pytest.mark.parametrize("backend", backend_params())
def test_norms_match_a_double_reference_and_are_per_row(backend: ops.Backend) -> None:
    """RMS (with and without a gate) and L2 norms: within float rounding of a float64 reference, and each row of
    an 8-row call bit-identical to the same row alone (what verify and prefill rely on)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 96, generator=g) * 3
    w = torch.randn(96, generator=g)
    gate = torch.rand(8, 3, 96, generator=g)
    eps = 1e-6
    xd = x.double()
    rms = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    l2 = xd / xd.pow(2).sum(-1, keepdim=True).sqrt().clamp(min=eps) * 0.25
    cases = [(lambda t, gt: ops.rms_norm(t, w, eps, backend), rms),
             (lambda t, gt: ops.rms_norm(t, w, eps, backend, gate=gt), rms * gate.double()),
             (lambda t, gt: ops.l2_norm(t, eps, backend, scale=0.25), l2)]
    for fn, ref in cases:
        y = fn(x, gate)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6), (y.double() - ref).abs().max()
        for i in (0, 5):
            assert torch.equal(fn(x[i:i + 1], gate[i:i + 1]), y[i:i + 1])
    assert torch.equal(ops.l2_norm(torch.zeros(2, 8), eps, backend), torch.zeros(2, 8))  # eps keeps zero rows finite


@pytest.mark.parametrize("backend", backend_params())
def test_gdn_inputs_match_the_op_by_op_form_and_are_per_token(backend: ops.Backend) -> None:
    """The recurrence's inputs (conv, silu, L2-normed q and k, β, g) against the torch backend's op-by-op form, to
    float rounding; every token of a 6-token pass bit-identical to a pass over that token alone (with its conv
    window)."""
    g0 = torch.Generator().manual_seed(3)
    K, C, n, hk, dk, h = 4, 2 * 2 * 16 + 4 * 16, 6, 2, 16, 4
    window = torch.randn(K - 1 + n, C, generator=g0)
    taps = torch.randn(K, C, generator=g0) * 0.5
    b, a = torch.randn(n, h, generator=g0), torch.randn(n, h, generator=g0) * 8 + 6  # a + dt_bias over 20 in places
    A, dt_bias = -torch.rand(h, generator=g0) * 4, torch.randn(h, generator=g0) * 4
    got = ops.gdn_inputs(window, taps, b, a, A, dt_bias, hk, dk, 1e-6, backend)
    ref = ops.gdn_inputs(window, taps, b, a, A, dt_bias, hk, dk, 1e-6, ops.TORCH)
    for x, r in zip(got, ref):
        assert x.shape == r.shape
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6)
    for t in (0, 4):
        one = ops.gdn_inputs(window[t:t + K], taps, b[t:t + 1], a[t:t + 1], A, dt_bias, hk, dk, 1e-6, backend)
        assert all(torch.equal(x1, x[t:t + 1]) for x1, x in zip(one, got))


@pytest.mark.parametrize("backend", backend_params())
def test_rope_is_the_torch_rotation_and_per_token(backend: ops.Backend) -> None:
    """RoPE (NEOX pairing on the first n_rot of 24 dims) gives the torch twin's bits (the same multiplies and adds),
    leaves its input alone, and rotates each token as a one-token call would."""
    from engine.models.qwen35 import rope_tables
    cos, sin = rope_tables(16, 16, 10000.0)
    x = torch.randn(5, 3, 24, generator=torch.Generator().manual_seed(4))
    before = x.clone()
    y = ops.rope(x, cos[7:12], sin[7:12], 16, backend)
    assert torch.equal(x, before) and torch.equal(y[..., 16:], x[..., 16:])
    assert torch.equal(y, ops.rope(x, cos[7:12], sin[7:12], 16, ops.TORCH))
    assert torch.equal(ops.rope(x[2:3], cos[9:10], sin[9:10], 16, backend), y[2:3])
