"""engine.ops as a door: backends, binding, the activation memo and the observer."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine import ops
from engine.ops.activations import LastInputs
from engine.storage.qtensor import QTensor
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
    native = [b for b in ops.available_backends() if b.native]
    for b in native:
        assert ops.bind(q8, b).kind == "native" and ops.bind(q5, b).kind == "dequant"
    assert ops.bind(q8, ops.TORCH).kind == "int8" and ops.bind(q5, ops.TORCH).kind == "dequant"
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
