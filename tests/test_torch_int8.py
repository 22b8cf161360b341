"""engine.ops.torch_int8: the torch backend's Q8_0 products in integers (the path without the native library)
against llama.cpp's formula and the dequantizing path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine import ops
from engine.ops import torch_int8 as q8dot
from engine.ops.linear import Int8Linear
from engine.storage.qtensor import QTensor
from tests.test_quant import random_tensor

LAYOUTS = ops.Int8Layouts()


def _quantize(x: torch.Tensor) -> ops.QuantRows:
    return ops.quantize(x, "Q8_0", on_native=False)


def _lin(w: QTensor) -> ops.Linear:
    return ops.bind(w, ops.TORCH)


def _weight(out: int, k: int, seed: int = 0) -> QTensor:
    return QTensor(random_tensor(QT.Q8_0, (out, k), seed=seed, wide=False), QT.Q8_0, (out, k))


def _ggml_reference(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """ggml_vec_dot_q8_0_q8_0 in float64: per block an integer dot, times d_w · d_x, summed over blocks."""
    xr = _quantize(x.clone())
    p = q8dot.unpack(w.raw, w.shape)
    isum = torch.einsum("mbj,obj->mob", xr.blocks().double(), p.qs.view(w.n_rows, -1, 32).double())
    return (isum * p.d.double().unsqueeze(0) * xr.d.double().unsqueeze(1)).sum(-1)


@pytest.mark.parametrize("m", [1, 4, 33, 100], ids=lambda m: f"{m}rows")
def test_matmul_equals_llama_cpp_formula(m: int) -> None:
    w = _weight(40, 256)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    y = ops.linear(x, _lin(w))
    ref = _ggml_reference(x, w)
    # integer sums are exact; only the float32 scaling and the sum over 8 blocks round
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


def test_activation_quantization_matches_ggml_q8_0() -> None:
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    xr = _quantize(x)
    blocks = xr.blocks().float() * xr.d.unsqueeze(-1)
    # gguf-py's quantize/dequantize of Q8_0 is the same rounding (f16 scale amax/127, q = round(x / d))
    import gguf.quants as gq
    ref = gq.dequantize(gq.quantize(x.numpy(), QT.Q8_0), QT.Q8_0)
    np.testing.assert_allclose(blocks.reshape(3, 128).numpy(), ref, rtol=0, atol=1e-6)


def test_linear_takes_the_integer_path_and_stays_close_to_float() -> None:
    w = _weight(24, 64, seed=3)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    lin = _lin(w)
    assert isinstance(lin, Int8Linear) and lin._planes is None
    y = ops.linear(x, lin)
    planes = lin._planes
    assert planes is not None and planes.qs.dtype == torch.int8  # made once, kept by the bound weight
    ops.linear(x, lin)
    assert lin._planes is planes
    xr = _quantize(x)
    ref = (xr.blocks().float() * xr.d.unsqueeze(-1)).reshape(5, 64) @ w.dequantize().T
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # rows computed in a batch carry exactly the bits of one-row products
    assert torch.equal(y, torch.cat([ops.linear(x[i:i + 1].clone(), lin) for i in range(5)]))


def test_integer_path_only_for_q8_0_on_cpu() -> None:
    assert _lin(QTensor(random_tensor(QT.Q4_K, (2, 256), seed=0), QT.Q4_K, (2, 256))).kind == "dequant"
    assert ops.bind(torch.randn(2, 256), ops.TORCH).kind == "float"
    assert _lin(_weight(2, 256)).kind == "int8"
    # wide rows stay on the float path (the integer layouts lose there), whatever the number of rows
    assert _lin(_weight(2, 2 * LAYOUTS.max_cols)).kind == "dequant"


@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 4, 9])
def test_shared_expert_runs_with_the_routed_experts(slices: int, n: int) -> None:
    """The shared expert, cut into routed-expert-sized slices and run as extra slots, gives the routed
    experts plus σ(gate)·shared expert computed apart (to float rounding: its down sum is split per slice)."""
    from engine.ops.experts import route

    e_n, f, d = 6, 32, 64
    stacks = [QTensor(random_tensor(QT.Q8_0, s, seed=i, wide=False), QT.Q8_0, s)
              for i, s in enumerate([(e_n, f, d), (e_n, f, d), (e_n, d, f)])]
    trio = (_weight(slices * f, d, 7), _weight(slices * f, d, 8), _weight(d, slices * f, 9))
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(n))
    ex = ops.bind_experts(*stacks, ops.TORCH, shared=trio)
    routed = ops.bind_experts(*stacks, ops.TORCH)
    assert ex.shared_slices == slices and not routed.runs_shared
    w, idx = route(torch.randn(n, e_n, generator=torch.Generator().manual_seed(3)), 2)
    gate = torch.sigmoid(torch.randn(n, 1, generator=torch.Generator().manual_seed(4)))
    fused = ops.moe_experts(x, idx, w, ex, gate)
    sg, su = ops.linear(x, _lin(trio[0])), ops.linear(x, _lin(trio[1]))
    apart = ops.moe_experts(x, idx, w, routed) + ops.linear(torch.nn.functional.silu(sg) * su, _lin(trio[2])) * gate
    torch.testing.assert_close(fused, apart, rtol=1e-5, atol=1e-5 * float(apart.abs().max()))
    # one token at a time: the same bits as the batch
    rows = [ops.moe_experts(x[i:i + 1], idx[i:i + 1], w[i:i + 1], ex, gate[i:i + 1]) for i in range(n)]
    assert torch.equal(torch.cat(rows), fused)


def test_shared_expert_stays_apart_when_it_cannot_join() -> None:
    routed = tuple(QTensor(random_tensor(QT.Q8_0, s, seed=i, wide=False), QT.Q8_0, s)
                   for i, s in enumerate([(4, 64, 64), (4, 64, 64), (4, 64, 64)]))
    x = LAYOUTS
    assert q8dot.shared_slices(routed, (_weight(128, 64), _weight(128, 64), _weight(64, 128)), x) == 2
    assert q8dot.shared_slices(routed, (_weight(96, 64), _weight(96, 64), _weight(64, 96)), x) == 0  # 96 % 64
    f32 = QTensor(torch.randn(64, 64).numpy(), QT.F32, (64, 64))
    assert q8dot.shared_slices(routed, (f32, _weight(64, 64), _weight(64, 64)), x) == 0  # not Q8_0
    q4_down = QTensor(random_tensor(QT.Q4_K, (4, 64, 256), seed=5, wide=False), QT.Q4_K, (4, 64, 256))
    assert q8dot.shared_slices((routed[0], routed[1], q4_down), (_weight(64, 64), _weight(64, 64), _weight(64, 64)),
                               x) == 0  # a routed weight off the integer path
