"""Decode steps and verify passes replayed from CUDA graphs: one launch per step instead of one per op.

`StepGraphs` records the trunk's pass over n rows (Qwen35Model.rows_pass) once per kind of pass — rows, which logits,
whether GDN states are kept for a commit: the decode step, and the verify pass of each draft depth — and replays it
for every later pass of that kind. Nothing a replay cannot repeat happens inside the pass:
  - positions live on the device (ops.Positions without a host start): RoPE rows gathered, KV rows written by
    index, attention walking each row's keys up to its own position (engine.ops.triton_attention);
  - the GDN conv and recurrent states are updated in their own buffers (a fixed Cache); a verify's per-position
    states are tensors of the graph that a commit reads after the replay, on the device;
  - routed experts run as (token, slot) pairs with nothing read back, routing counts accumulate on the device.
Before a replay the pass's embedded rows are copied into the graph's input and its first position filled in; after
it, hidden rows and logits are copied out, so what a caller keeps (the drafter keeps hidden rows across steps) is not
overwritten by the next replay.

The first pass of a kind runs eagerly on a side stream (compiling the Triton kernels; capture needs that done), the
second is captured and replayed, later ones are replayed. Without CUDA (the tests: a model on the Triton interpreter
with step_graphs="on") every pass runs the recorded form itself — the same static buffers and device positions —
so its bits and its op sequence are what the graph would replay.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine import ops
from engine.cache import Cache
from engine.models.qwen35 import ForwardResult

log = logging.getLogger(__name__)


@dataclass
class _Pass:
    """One kind of pass: its static inputs and first position, and (on CUDA) its graph and outputs."""
    inputs: tuple[torch.Tensor, ...]  # the rows it reads ([n, ·] each)
    start: torch.Tensor  # [1] int64: the first row's position
    offsets: torch.Tensor  # [n] int64: 0 … n−1
    graph: torch.cuda.CUDAGraph | None = None
    out: ForwardResult | None = None
    runs: int = 0
    failed: str | None = None  # why its capture failed: it runs op by op

    def positions(self) -> ops.Positions:
        return ops.Positions(self.offsets.shape[0], None, self.start + self.offsets)


# (static inputs, positions, cache, logit rows, capture) → the pass's result: what a StepGraphs records
Record = Callable[[tuple[torch.Tensor, ...], ops.Positions, Cache, str, bool], ForwardResult]


class StepGraphs:
    """A module's captured passes (the trunk's, or the MTP head's) for one cache: a new cache drops them, they hold
    its buffers' addresses."""

    def __init__(self, device: torch.device, record: Record):
        self.device, self.record = device, record
        self._cache: Cache | None = None
        self._passes: dict[tuple[int, str, bool], _Pass] = {}
        self.captures = 0  # graphs captured (tests, logs)
        self.replays = 0

    def run(self, inputs: tuple[torch.Tensor, ...], cache: Cache, logit_rows: str, capture: bool) -> ForwardResult:
        """The pass over rows `inputs` (each [n, ·]) at cache.pos (the caller advances it), replayed where
        recorded."""
        if cache.gdn and not cache.fixed:
            raise ValueError("step graphs need a cache in fixed buffers (Qwen35Model.new_cache)")
        if cache is not self._cache:
            self._passes.clear()
            self._cache = cache
        n = inputs[0].shape[0]
        key = (n, logit_rows, capture)
        p = self._passes.get(key)
        if p is None:
            p = self._passes[key] = _Pass(tuple(torch.empty(t.shape, dtype=t.dtype, device=self.device)
                                                for t in inputs),
                                          torch.zeros(1, dtype=torch.long, device=self.device),
                                          torch.arange(n, device=self.device))
        for dst, src in zip(p.inputs, inputs):
            dst.copy_(src)
        p.start.fill_(cache.pos)
        out = self._run(p, lambda: self.record(p.inputs, p.positions(), cache, logit_rows, capture))
        return type(out)(out.hidden.clone(), None if out.logits is None else out.logits.clone(), out.captured)

    @property
    def kinds(self) -> list[tuple[int, str, bool]]:
        """The kinds of pass made so far: (rows, logit rows, capture)."""
        return list(self._passes)

    def record_eagerly(self, n: int, logit_rows: str, capture: bool, cache: Cache) -> ForwardResult:
        """The recorded form of a kind of pass already made, run eagerly on its static inputs and device positions:
        what a capture records (tests check that it reads nothing on the host)."""
        p = self._passes[(n, logit_rows, capture)]
        return self.record(p.inputs, p.positions(), cache, logit_rows, capture)

    def _run(self, p: _Pass, body: Callable[[], ForwardResult]) -> ForwardResult:
        p.runs += 1
        if self.device.type != "cuda" or p.failed is not None:
            return body()
        if p.graph is not None:
            p.graph.replay()
            self.replays += 1
            return p.out  # type: ignore[return-value]
        main = torch.cuda.current_stream(self.device)
        if p.runs == 1:  # warm-up: kernels compiled and loaded, the allocator's blocks made, off the capture
            side = torch.cuda.Stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                out = body()
            main.wait_stream(side)
            return out
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = body()
        except RuntimeError as e:  # an op that cannot be captured: this kind of pass runs op by op from now on
            log.warning("decode step capture failed (%s): these passes run op by op", e)
            p.failed = str(e)
            return body()
        p.graph, p.out = graph, out
        self.captures += 1
        graph.replay()
        self.replays += 1
        return out
