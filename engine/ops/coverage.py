"""Which of a built model's weights miss a native product: the loader's report of tensors that fall back.

Read from the bound model itself (every `Linear` and `Experts` reachable from it), so it says what `bind` and
`bind_experts` chose, never what a list of types predicts. A weight falls back when its product runs on a native
backend (on the CPU) but is not a native kernel: it is dequantized tile by tile instead, several times slower.
F32 weights are not counted (they are float math already, nothing to dequantize), nor weights placed on an
accelerator (their products are the torch backend's by design), nor anything on the torch backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from engine.ops.experts import Experts
from engine.ops.linear import Linear
from engine.storage.qtensor import QTensor


@dataclass(frozen=True)
class Fallback:
    """One stored type's weights that fall back: how many tensors and their stored bytes."""

    qtype: str
    tensors: int
    nbytes: int


@dataclass(frozen=True)
class Coverage:
    backend: str  # the backend the model was built with
    weight_bytes: int  # stored bytes of every weight bound to a product
    fallback: tuple[Fallback, ...]  # by bytes, largest first; empty when every product is native

    def share(self, f: Fallback) -> float:
        return f.nbytes / self.weight_bytes if self.weight_bytes else 0.0

    def notice(self) -> str | None:
        """One line for the user, or None when nothing falls back."""
        if not self.fallback:
            return None
        parts = ", ".join(f"{f.qtype} ({f.tensors} tensor{'s' if f.tensors != 1 else ''}, "
                          f"{self.share(f):.0%} of weights)" for f in self.fallback)
        return (f"no native {self.backend} kernels for {parts}: these run dequantized, several times slower "
                "than the native types")

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "weight_bytes": self.weight_bytes,
                "fallback": [{"type": f.qtype, "tensors": f.tensors, "bytes": f.nbytes, "share": self.share(f)}
                             for f in self.fallback]}


def _bound(root: object) -> Iterator[Linear | Experts]:
    """Every Linear and Experts reachable from `root` through engine objects, lists, tuples and dicts, once each."""
    seen: set[int] = set()
    stack: list[object] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, QTensor, str, bytes, int, float)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, (Linear, Experts)):
            yield obj
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())


def _weights(b: Linear | Experts) -> Iterator[tuple[object, bool]]:
    """(stored weight, falls back) for each weight a bound product reads."""
    if isinstance(b, Linear):
        yield b.weight, b.backend.native and b.kind != "native"
    else:  # routed experts with an accelerator cache run by placement, not by type: not a fallback
        falls = b.backend.native and b.kind != "native" and b.cache is None
        for w in (b.gate, b.up, b.down):
            yield w, falls


def product_coverage(model: object, backend_name: str) -> Coverage:
    """The weights of `model` (built with the backend named `backend_name`) that miss a native product."""
    total = 0
    by_type: dict[str, list[int]] = {}
    for b in _bound(model):
        for w, falls in _weights(b):
            if not isinstance(w, QTensor):
                continue  # a float parameter being trained
            total += w.nbytes
            if falls and w.qtype.name != "F32":
                row = by_type.setdefault(w.qtype.name, [0, 0])
                row[0] += 1
                row[1] += w.nbytes
    fb = sorted((Fallback(t, n, nb) for t, (n, nb) in by_type.items()), key=lambda f: (-f.nbytes, f.qtype))
    return Coverage(backend_name, total, tuple(fb))
