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
from typing import TYPE_CHECKING, Callable

import torch

from engine import ops
from engine.cache import Cache

if TYPE_CHECKING:
    from engine.models.qwen35 import DecoderLayer, ForwardResult, Qwen35Model

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")  # EngineConfig.step_graphs


def unsupported(model: Qwen35Model) -> str | None:
    """Why the model's decode step cannot be captured (None: it can): every layer and the LM head on one device,
    every kernel Triton's, routed experts resident (an expert cache's lookups run on the host), no op observer (its
    events read results on the host). The MTP head's passes are captured where its own block passes the same test
    on that device."""
    dev = model.device
    if any(d != dev for d in model.layer_devices) or model.output.device != dev:
        return "the trunk is split between devices"
    for layer in model.layers:
        why = _layer_unsupported(layer)
        if why is not None:
            return why
    return None


def _layer_unsupported(layer: DecoderLayer) -> str | None:
    from engine.models.qwen35 import MoE

    if layer.backend.kind != "triton":
        return f"layer {layer.il} runs on the {layer.backend.name} backend, not Triton's"
    if layer.backend.observer is not None:
        return "op observers read results on the host"
    if isinstance(layer.ffn, MoE):
        ex = layer.ffn.w.experts
        if ex.cache is not None or ex.kind != "triton":
            return f"layer {layer.il}'s routed experts are not resident in Triton's kernels"
    return None


def counts(model: Qwen35Model) -> dict[str, int]:
    """Captures and replays so far of the trunk's step graphs and the MTP head's (0 where it has none)."""
    head = model.mtp.step_graphs if model.mtp is not None else None
    return {f"{who}{k}": getattr(g, k) if g is not None else 0
            for who, g in (("", model.step_graphs), ("head_", head)) for k in ("captures", "replays")}


def attach(model: Qwen35Model, mode: str) -> None:
    """Give the model (and its MTP head, where it can) step graphs as `mode` says: "auto" where the trunk is wholly
    on a CUDA device and capturable, "on" also on the CPU (the recorded form run eagerly: tests), "off" never."""
    if mode not in MODES:
        raise ValueError(f"step_graphs must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return
    why = unsupported(model)
    if why is None and (mode == "on" or model.device.type == "cuda"):
        model.step_graphs = StepGraphs(model.device, lambda ins, at, cache, rows, capture:
                                       model.rows_pass(ins[0], cache, at, rows, capture))
        head = model.mtp
        if head is not None and head.device == model.device and head.head.device == model.device \
                and _layer_unsupported(head.layer) is None:
            head.step_graphs = StepGraphs(head.device, lambda ins, at, cache, rows, capture:
                                          head.rows_pass(ins[0], ins[1], cache, at, rows))
    elif mode == "on":
        raise ValueError(f"step graphs cannot run this model: {why}")
    elif model.device.type == "cuda":
        log.info("decode steps run op by op: %s", why)


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
Record = Callable[[tuple[torch.Tensor, ...], ops.Positions, Cache, str, bool], "ForwardResult"]


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
