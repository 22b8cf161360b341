"""How a model's passes are executed; the model files (qwen35.py, mtp.py) hold the math only.

A Runner is made once per loaded model (engine.models.build.load_model) and decides then, not on a first pass:
  - each decoder layer's native one-call form (ops.fuse_layer), where its backend runs the whole layer;
  - the decode step's one-call form (ops.fuse_step: every layer, the final norm and the head in one native call),
    where every layer is fused on the CPU and the head is there too;
  - CUDA graphs of the decode step, each verify size and the MTP head's draft passes (step_graph.StepGraphs), where
    the trunk is wholly on one CUDA device and every layer is capturable (Qwen35Model.capturable), or always with
    "on" (tests: the recorded form run eagerly on the CPU).
Each pass then takes the first form that runs it; all of them give the op-by-op bits (tests/test_layer.py,
tests/test_step_graph.py). A pass with a hook runs op by op: a hook sees every intermediate.

The engine and the drafter call `Runner.forward` and `HeadRunner.forward`, nothing else of the model's execution.
"""
from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque
from typing import Sequence

import torch

from engine import ops
from engine.cache import Cache, CapturedStates, GDNState
from engine.models.mtp import MTPHead
from engine.models.qwen35 import (STEP_ROWS, DecoderLayer, ForwardResult, Hook, Qwen35Model, SeqRows, _noop,
                                  check_room, id_tensor)
from engine.models.step_graph import StepGraphs

log = logging.getLogger(__name__)

GRAPH_MODES = ("auto", "on", "off")  # EngineConfig.step_graphs


def run_layer(layer: DecoderLayer, fused: ops.FusedLayer | None, x: torch.Tensor, cache: Cache, at: ops.Positions,
              rope: tuple[torch.Tensor, torch.Tensor], capture: CapturedStates | None, chunked: bool) -> torch.Tensor:
    """One decoder layer over rows x: in its one native call where it has one and the pass allows it (positions on
    the host, the recurrence's sequential form), else op by op."""
    if fused is None or chunked or at.start is None:
        return layer(x, cache, at, rope, _noop, capture, chunked)
    state = layer.state(cache)
    out, idx = fused(x, state, at.start, rope, capture, layer.il)
    if capture is None and isinstance(state, GDNState):  # a verify's window stays: its ConvSteps view it
        state.own_conv()
    if idx is not None:
        layer.routed(idx)
    return out


class ManyChoice:
    """Per number of sequences k, which form of Runner.forward_many runs: one pass over all rows ("together") or each
    sequence's own pass. Each form is measured on its first TRY passes, then the faster (median of its last RECENT)
    runs and the other is tried again after EVERY passes, so a change in the host's or the model's speed is
    followed; each retry that finds the other form still FAR slower doubles the wait before the next (up to
    EVERY_MAX: on a model whose pass is mostly weights read, a retry of the separate passes cost k passes for one,
    ~3 % of a 4-sequence decode at EVERY). Both forms give the same bits: the choice follows the timings alone.
    Without `apart` only the shared pass runs (with step graphs, which hold one cache's buffers: a pass on another
    cache would record them anew)."""

    TRY, RECENT, EVERY, EVERY_MAX, FAR = 3, 8, 64, 1024, 1.25

    def __init__(self, apart: bool = True) -> None:
        self.apart = apart
        self.times: dict[tuple[int, bool], deque] = {}
        self.passes: dict[int, int] = {}
        self.every: dict[int, int] = {}  # passes between retries of the slower form, per k
        self._retry: dict[int, bool] = {}  # k -> the form being retried this pass

    def pick(self, k: int) -> bool:
        if not self.apart:
            return True
        n = self.passes[k] = self.passes.get(k, 0) + 1
        t, a = (self.times.setdefault((k, form), deque(maxlen=self.RECENT)) for form in (True, False))
        if len(t) < self.TRY or len(a) < self.TRY:
            return len(t) <= len(a)
        faster = statistics.median(t) <= statistics.median(a)
        if n % self.every.get(k, self.EVERY) == 0:
            self._retry[k] = not faster
            return not faster
        return faster

    def observe(self, k: int, together: bool, ns: int) -> None:
        if self._retry.get(k) is together:  # a retry of the slower form: wait longer where it is still far behind
            del self._retry[k]
            other = self.times.get((k, not together))
            far = bool(other) and ns > self.FAR * statistics.median(other)  # type: ignore[arg-type]
            self.every[k] = min(2 * self.every.get(k, self.EVERY), self.EVERY_MAX) if far else self.EVERY
        self.times.setdefault((k, together), deque(maxlen=self.RECENT)).append(ns)


class HeadRunner:
    """The MTP head's passes: its layer in one native call where it can be, its draft passes replayed from CUDA
    graphs where the trunk's are."""

    def __init__(self, head: MTPHead, graphs: StepGraphs | None):
        self.head, self.hp, self.device, self.graphs = head, head.hp, head.device, graphs
        self.trunk_device = head.model.device  # where the trunk's hidden rows are
        fused = ops.fuse_layer(head.layer.spec(), head.layer.backend)
        self.fused = fused if isinstance(fused, ops.FusedLayer) else None
        # a draft pass in one native call where every piece is native and on the CPU (its input rows, the layer, the
        # shared head norm): the dozen small ops around the layer were most of a draft's time on small models
        self.step = ops.fuse_mtp_step(self.fused, head.il, head.layer.routing_counter(), head.eh_proj, head.enorm,
                                      head.hnorm, head.head_norm, head.hp.rms_eps, head.embed, head.head) \
            if head.device.type == "cpu" and not head.enorm.requires_grad else None
        ops.prepare_draft_logits(head.head)  # the head's sketch, made with the model (1 s for a 248k vocabulary)

    def new_cache(self, n_ctx: int) -> Cache:
        return self.head.new_cache(n_ctx)

    def forward(self, tokens: torch.Tensor | Sequence[int], hidden: torch.Tensor, cache: Cache, *,
                logit_rows: str = "last", hook: Hook | None = None) -> ForwardResult:
        """Rows (tokens[i], hidden[i]) at positions cache.pos… (MTPHead.forward), advancing the cache. The result's
        hidden rows are those `logit_rows` asks for: every row's ("all"), the last row's ("last", "draft"), none
        ("none": the rows only leave their keys and values in the cache, all the later drafts read of them; the
        fused step computes nothing else for them)."""
        head = self.head
        if hook is None and self.step is not None and self.graphs is None and len(tokens) <= STEP_ROWS:
            return self._step(tokens, hidden, cache, logit_rows)
        if hook is not None:  # the model's own pass, every op reported
            res = head.forward(tokens, hidden, cache, logit_rows=logit_rows, hook=hook)
            return ForwardResult(res.hidden[_unread(len(res.hidden), logit_rows):], res.logits, None)
        ids = id_tensor(tokens).reshape(-1)  # type: ignore[arg-type]
        n, pos = ids.numel(), cache.pos
        check_room(cache, pos, n)
        e = head.normed_embeddings(ids)
        if self.graphs is not None and n <= STEP_ROWS:
            res = self.graphs.run((e, hidden.to(self.device)), cache, logit_rows, False)
        else:
            x = run_layer(head.layer, self.fused, head.project(e, hidden), cache, ops.Positions(n, pos),
                          head.model.rope(self.device), None, False)
            res = head.finish(x, logit_rows)
        cache.pos = pos + n
        return ForwardResult(res.hidden[_unread(n, logit_rows):], res.logits, None)

    def _step(self, tokens: torch.Tensor | Sequence[int], hidden: torch.Tensor, cache: Cache,
              logit_rows: str) -> ForwardResult:
        """The head's pass in one native call (`step`), then the logits `logit_rows` asks for (MTPHead.finish's)."""
        head, step = self.head, self.step
        assert step is not None
        ids = [int(t) for t in tokens] if not isinstance(tokens, list) else tokens
        n, pos = len(ids), cache.pos
        check_room(cache, pos, n)
        rows = hidden.to(device=self.device, dtype=torch.float32).contiguous()
        # the rows no one reads: their keys and values only (on the mid MoE a draft's first pass was 4 rows of the
        # head's experts for 1 row's logits)
        out, logits = step(ids, cache, pos, head.model.rope(self.device), logit_rows != "none", hidden=rows,
                           skip=_unread(n, logit_rows))
        cache.pos = pos + n
        if logits is not None:  # the head's product came with the call, for the rows asked for
            return ForwardResult(out, logits, None)
        if logit_rows == "draft":
            logits = ops.draft_logits(out.to(head.head.device), head.head)
        elif logit_rows != "none":
            logits = ops.linear(out.to(head.head.device), head.head)
        return ForwardResult(out, logits, None)


def _unread(n: int, logit_rows: str) -> int:
    """How many of a head pass's n rows come first and are not asked for (HeadRunner.forward)."""
    return 0 if logit_rows == "all" else n if logit_rows == "none" else n - 1


class Runner:
    """A loaded model's passes (see the module docstring). `model` is the math; `mtp` runs its MTP head (None when
    the file has none)."""

    def __init__(self, model: Qwen35Model, step_graphs: str = "auto"):
        if step_graphs not in GRAPH_MODES:
            raise ValueError(f"step_graphs must be one of {', '.join(GRAPH_MODES)}, not {step_graphs!r}")
        self.model, self.hp = model, model.hp
        bound = [ops.fuse_layer(layer.spec(), layer.backend) for layer in model.layers]
        self.fused = [b if isinstance(b, ops.FusedLayer) else None for b in bound]
        self.unfused = {layer.il: b for layer, b in zip(model.layers, bound) if isinstance(b, str)}  # il → why
        self.step = self._fuse_step()
        ops.link_layers(self.fused, model.output)
        self.graphs, head_graphs = self._graphs(step_graphs)
        self.mtp = HeadRunner(model.mtp, head_graphs) if model.mtp is not None else None
        self.many = ManyChoice(apart=self.graphs is None)  # forward_many's form per number of sequences

    def _fuse_step(self) -> ops.FusedStep | None:
        """Every layer, the final norm and the head as one call per decode step, where every layer is fused on the
        CPU and the head is there too."""
        m, cpu = self.model, torch.device("cpu")
        if any(layer.device != cpu for layer in m.layers) or m.device != cpu:
            return None
        return ops.fuse_step(self.fused, [layer.il for layer in m.layers],
                             [layer.routing_counter() for layer in m.layers], m.output_norm, m.hp.rms_eps, m.output,
                             m.tok_embd)

    def step_path(self) -> str:
        """How a decode step or a verify pass runs, and where it is op by op, why (`inspect`, the benchmarks)."""
        if self.graphs is not None:
            return "CUDA step graphs"
        if self.step is not None:
            return "one native call (fused step)"
        m = self.model
        if self.unfused:
            il, why = next(iter(self.unfused.items()))
            more = f" (and {len(self.unfused) - 1} more layers)" if len(self.unfused) > 1 else ""
            return f"op by op: layer {il}{more}: {why}"
        if any(layer.device.type != "cpu" for layer in m.layers) or m.device.type != "cpu":
            return "op by op: layers or the head are on an accelerator without step graphs"
        return "op by op: an op observer is attached, or the output norm is not a float32 CPU tensor"

    def _graphs(self, mode: str) -> tuple[StepGraphs | None, StepGraphs | None]:
        """The trunk's and the head's step graphs as `mode` says: "auto" where the trunk is wholly on a CUDA device
        and capturable, "on" also on the CPU (the recorded form run eagerly: tests), "off" never."""
        m = self.model
        if mode == "off":
            return None, None
        why = m.capturable()
        if why is not None:
            if mode == "on":
                raise ValueError(f"step graphs cannot run this model: {why}")
            if m.device.type == "cuda":
                log.info("decode steps run op by op: %s", why)
            return None, None
        if mode != "on" and m.device.type != "cuda":
            return None, None
        trunk = StepGraphs(m.device, lambda ins, at, cache, rows, capture: m.rows_pass(ins[0], cache, at, rows, capture))
        head = m.mtp
        if head is None or head.capturable() is not None:
            return trunk, None
        return trunk, StepGraphs(head.device, lambda ins, at, cache, rows, capture:
                                 head.rows_pass(ins[0], ins[1], cache, at, rows))

    @property
    def sequential_prefill(self) -> bool:
        """Whether prefill should run the GDN recurrence token by token instead of the chunk-parallel form: where
        every layer's delta rule is native, one sweep per token with the state in cache is the faster form
        (bench/results/verify.json: 512-token prefill, sequential vs chunked), and prefill gets decoding's bits."""
        return all(layer.backend.native for layer in self.model.layers)

    def graph_counts(self) -> dict[str, int]:
        """Captures and replays so far of the trunk's step graphs and the MTP head's (0 where it has none)."""
        head = self.mtp.graphs if self.mtp is not None else None
        return {f"{who}{k}": getattr(g, k) if g is not None else 0
                for who, g in (("", self.graphs), ("head_", head)) for k in ("captures", "replays")}

    def new_cache(self, n_ctx: int) -> Cache:
        """A sequence's state; with step graphs, in fixed buffers (the graphs record their addresses). With an MTP head
        its recurrent layers' spare states (where a verify writes) are made and written now: made by the first verify,
        their pages' first writes took that pass from ~1.4 to ~2 decode steps and more (the mid MoE), and auto
        weighed speculation by it."""
        cache = self.model.new_cache(n_ctx, fixed=self.graphs is not None)
        if self.mtp is not None:
            for st in cache.gdn.values():
                st.spare = torch.zeros_like(st.ssm)
        return cache

    def forward(self, tokens: torch.Tensor | Sequence[int], cache: Cache, *, logit_rows: str = "last",
                capture: bool = False, chunked: bool = False, hook: Hook | None = None) -> ForwardResult:
        """Run N new tokens at positions cache.pos … cache.pos+N−1 and advance the cache (Qwen35Model.forward's
        arguments and bits)."""
        if hook is not None:
            return self.model.forward(tokens, cache, logit_rows=logit_rows, capture=capture, chunked=chunked,
                                      hook=hook)
        m, step = self.model, self.step
        # a list stays one: a fused step that embeds takes the ids as they are (no tensor of them per decode step)
        ids = tokens if isinstance(tokens, list) else id_tensor(tokens).reshape(-1)  # type: ignore[arg-type]
        n, pos = len(ids), cache.pos
        check_room(cache, pos, n)
        short = n <= STEP_ROWS and not chunked  # a decode step or a verify pass
        if short and self.graphs is not None and cache.fixed:
            res = self.graphs.run((m.embed(ids),), cache, logit_rows, capture)
        elif short and step is not None:
            want, cap = logit_rows != "none", CapturedStates({}, {}) if capture else None
            rows = ids if step.embeds and isinstance(ids, list) else m.embed(ids)
            h, logits = step(rows, cache, pos, m.rope(m.device), want, cap)
            if want and logits is None:
                logits = ops.linear(h if logit_rows == "all" else h[-1:], m.output)
            elif logits is not None and logit_rows == "last" and n > 1:
                logits = logits[-1:]
            res = ForwardResult(h, logits, cap)
        else:
            res = self._rows(m.embed(ids), cache, ops.Positions(n, pos), logit_rows, capture, chunked)
        cache.pos = pos + n
        return res

    @property
    def shares_verify(self) -> bool:
        """Whether forward_many runs a verify among other sequences' rows in their one shared pass (its states
        captured there): with the one-call step on the CPU. Elsewhere a verify would run apart from the others."""
        return self.step is not None and self.graphs is None

    def forward_many(self, tokens: Sequence[Sequence[int]], caches: Sequence[Cache],
                     captures: Sequence[CapturedStates | None] | None = None, all_rows: bool = False) -> ForwardResult:
        """Several sequences' new tokens, each at its cache's positions; advances every cache. The hidden rows of all
        tokens in order, and the logits after each sequence's last token (`all_rows`: after every token, in the same
        order). `captures[j]`, where given, receives sequence j's GDN states after each of its rows, as forward's
        `capture` (a verify among the sequences). Two forms, the same bits: one pass over all rows
        (Qwen35Model.several: norms, projections, MoE and the head read their weights once; op by op, since a fused
        layer holds one sequence's state; or the one-call step over several sequences), or each sequence's own pass in
        its one-call forms. Which one runs is chosen per number of sequences from their measured times (ManyChoice):
        where a pass is mostly the interpreter's per-op time (a small model), the separate fused passes win; where it
        is mostly weights read, the shared pass. A verify among them runs in the one-call shared pass where there is
        one (`shares_verify`), else apart."""
        rows = "all" if all_rows else "last"
        if len(caches) == 1:
            cap = captures[0] if captures is not None else None
            res = self.forward(list(tokens[0]), caches[0], logit_rows=rows, capture=cap is not None)
            _fill(cap, res.captured)
            return res
        verify = captures is not None and any(c is not None for c in captures)
        m, step = self.model, self.step
        one_call = step is not None and all(len(t) <= STEP_ROWS for t in tokens)
        together = (one_call and self.shares_verify) if verify else self.many.pick(len(caches))
        t0 = time.perf_counter_ns()
        if together:
            for toks, cache in zip(tokens, caches):
                check_room(cache, cache.pos, len(toks))
            if one_call:
                assert step is not None
                ids = [list(t) for t in tokens]
                x = None if step.embeds else m.embed([t for toks in ids for t in toks]).float().contiguous()
                h, logits = step.many(ids, list(caches), m.rope(m.device), True, x,
                                      list(captures) if verify else None)  # type: ignore[arg-type]
                if logits is None:
                    logits = ops.linear(h, m.output)
                if not all_rows and len(h) > len(tokens):  # a sequence of several rows: the logits after its last
                    logits = logits[[end - 1 for end in itertools.accumulate(len(t) for t in tokens)]]
                res = ForwardResult(h, logits, None)
            else:
                parts, start = [], 0
                for toks, cache in zip(tokens, caches):
                    parts.append(SeqRows(cache, ops.Positions(len(toks), cache.pos), slice(start, start + len(toks))))
                    start += len(toks)
                res = self.model.several(m.embed([t for toks in tokens for t in toks]), parts, all_rows)
            for toks, cache in zip(tokens, caches):
                cache.pos += len(toks)
        else:
            caps = list(captures) if captures is not None else [None] * len(caches)
            each = [self.forward(list(toks), cache, logit_rows=rows, capture=cap is not None)
                    for toks, cache, cap in zip(tokens, caches, caps)]
            for cap, r in zip(caps, each):
                _fill(cap, r.captured)
            res = ForwardResult(torch.cat([r.hidden for r in each]), torch.cat([r.logits for r in each]), None)
        if not verify:
            self.many.observe(len(caches), together, time.perf_counter_ns() - t0)
        return res

    def _rows(self, x: torch.Tensor, cache: Cache, at: ops.Positions, logit_rows: str, capture: bool,
              chunked: bool) -> ForwardResult:
        """The trunk over embedded rows layer by layer, each in one call where it can be."""
        m = self.model
        cap = CapturedStates({}, {}) if capture else None
        for layer, fused in zip(m.layers, self.fused):
            if x.device != layer.device:
                x = x.to(layer.device)
            x = run_layer(layer, fused, x, cache, at, m.rope(layer.device), cap, chunked)
        return m.finish(x, logit_rows, cap)


def _fill(into: CapturedStates | None, got: CapturedStates | None) -> None:
    """A pass's captured states into the holder its caller gave."""
    if into is not None and got is not None:
        into.conv.update(got.conv)
        into.ssm.update(got.ssm)
