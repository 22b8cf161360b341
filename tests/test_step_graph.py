"""The captured decode step (engine.models.step_graph) and the attention it needs (engine.ops.triton_attention).

Without a GPU the Triton kernels run in the interpreter (tests/conftest.py) and a step graph runs its recorded form
every time; what makes that form capturable is checked here directly: the same ops on the same shapes at every
position, none that reads a result on the host, every state buffer left where it was. On a GPU the same tests
capture real CUDA graphs and replay them.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import ops
from engine.cache import Cache
from engine.events import EngineConfig
from engine.generate import Engine, load
from engine.models import step_graph
from engine.ops import triton_attention
from engine.ops.attention import attention_torch
from engine.ops.backend import TRITON, triton_runs
from engine.errors import InvalidParameterError
from tests.fixtures import TINY_MOE, fixture_path
from tests.generation import collect

DEV = torch.device("cuda" if triton_runs("cuda") else "cpu")
CUDA = DEV.type == "cuda"
Q8_MOE = replace(TINY_MOE, qtype="Q8_0")  # every matrix in a type the Triton kernels read: routed experts resident


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 1, 48)], ids=["gqa2-d64", "gqa8-d48"])
def test_attention_over_device_positions_matches_the_twin_and_is_batch_invariant(heads: int, kv_heads: int,
                                                                                  dim: int) -> None:
    g = torch.Generator().manual_seed(heads)
    k, v = (torch.randn(90, kv_heads, dim, generator=g) for _ in range(2))
    q = torch.randn(5, heads, dim, generator=g)
    pos = 37  # keys 0 … 41: a walk over 2 blocks, the second partly masked
    y = triton_attention.attention_rows(q.to(DEV), k.to(DEV), v.to(DEV), torch.arange(pos, pos + 5, device=DEV),
                                        0.2).cpu()
    assert torch.allclose(y, attention_torch(q, k, v, pos, 0.2), rtol=1e-5, atol=1e-5)
    for i in range(5):  # each row of the 5-row pass has the bits of its own one-row pass
        yi = triton_attention.attention_rows(q[i:i + 1].to(DEV), k.to(DEV), v.to(DEV),
                                             torch.tensor([pos + i], device=DEV), 0.2).cpu()
        assert torch.equal(yi[0], y[i])
    # the ops door: host positions and device positions give the same bits on the Triton backend
    at = ops.Positions(5, None, torch.arange(pos, pos + 5, device=DEV))
    assert torch.equal(ops.attention(q.to(DEV), k.to(DEV), v.to(DEV), at, 0.2, TRITON).cpu(), y)
    assert torch.equal(ops.attention(q.to(DEV), k.to(DEV), v.to(DEV), pos, 0.2, TRITON).cpu(), y)


def test_device_positions_need_the_triton_backend() -> None:
    q, k = torch.zeros(1, 2, 8), torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="Triton"):
        ops.attention(q, k, k, ops.Positions(1, None, torch.tensor([2])), 1.0, ops.TORCH)


def _engines() -> tuple[Engine, Engine]:
    graphed = load(fixture_path(Q8_MOE), EngineConfig(n_ctx=64, backend=TRITON, device=str(DEV), step_graphs="on"))
    eager = load(fixture_path(Q8_MOE), EngineConfig(n_ctx=64, backend=TRITON, device=str(DEV), step_graphs="off"))
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    assert graphed.runner.mtp is not None and graphed.runner.mtp.graphs is not None
    assert graphed.cache.fixed and not eager.cache.fixed
    return graphed, eager


def _steps(eng: Engine) -> list[torch.Tensor]:
    """Prefill, two decode steps, a 3-row verify committed at its second row, a decode step, another verify
    committed whole: the logits of each pass."""
    m, c = eng.runner, eng.cache
    c.reset()
    m.forward(list(range(5)), c, chunked=True)
    out = [m.forward([7], c).logits, m.forward([8], c).logits]
    for seq, keep in (([9, 10, 11], 1), ([12], None), ([13, 14, 15], 2), ([16, 17, 18], 0)):
        if keep is None:
            out.append(m.forward(seq, c).logits)
            continue
        pos0 = c.pos
        res = m.forward(seq, c, logit_rows="all", capture=True)
        out.append(res.logits)
        c.commit(res.captured, keep)  # type: ignore[arg-type]
        c.truncate(pos0 + keep + 1)
    return [t.cpu() for t in out]  # type: ignore[union-attr]


def test_graphed_steps_equal_eager_steps_bit_for_bit_through_commits() -> None:
    graphed, eager = _engines()
    buffers = {id(t): t.data_ptr() for s in graphed.cache.gdn.values() for t in (s.conv, s.ssm)}
    buffers.update({id(t): t.data_ptr() for kv in graphed.cache.kv.values() for t in (kv.k, kv.v)})
    a, b = _steps(graphed), _steps(eager)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == 6
    after = [t for s in graphed.cache.gdn.values() for t in (s.conv, s.ssm)] + \
        [t for kv in graphed.cache.kv.values() for t in (kv.k, kv.v)]
    assert {id(t): t.data_ptr() for t in after} == buffers  # the same tensors at the same addresses throughout
    graphs = graphed.runner.graphs
    assert graphs is not None
    if CUDA:  # decode (1 row, last logits) and the 3-row verify each captured once and replayed after
        assert graphs.captures == 2 and graphs.replays >= 3


def _drafts(eng: Engine) -> list[torch.Tensor]:
    """The MTP head's passes as a drafter runs them: 2 rows (a kept row and the first draft), then chained single
    rows, then a truncation back and again: their logits."""
    head = eng.runner.mtp
    assert head is not None
    c = head.new_cache(64)
    g = torch.Generator().manual_seed(5)
    hid = torch.randn(12, head.hp.n_embd, generator=g).to(DEV)
    out = []
    for toks, rows in (([3, 4], hid[0:2]), ([5], hid[2:3]), ([6], hid[3:4]), ([7, 8], hid[4:6]), ([9], hid[6:7])):
        res = head.forward(toks, rows, c)
        out.append(res.logits.cpu())  # type: ignore[union-attr]
        if toks == [6]:
            c.truncate(c.pos - 2)  # the chained drafts dropped, as after a verify
    return out


def test_graphed_draft_passes_equal_eager_ones_bit_for_bit() -> None:
    graphed, eager = _engines()
    a, b = _drafts(graphed), _drafts(eager)
    assert len(a) == 5 and all(torch.equal(x, y) for x, y in zip(a, b))
    graphs = graphed.runner.mtp.graphs  # type: ignore[union-attr]
    assert graphs is not None and {k[0] for k in graphs.kinds} == {1, 2}
    if CUDA:
        assert graphs.captures == 2 and graphs.replays >= 2


# Ops whose result size or value the host must read (a sync on CUDA, and not capturable); boolean-mask indexing is
# checked apart. `.tolist()` and `.numpy()` do not dispatch: a capture on a GPU is what catches those.
SYNCS = {"_local_scalar_dense", "item", "nonzero", "bincount", "masked_select", "_unique2", "unique_consecutive",
         "unique_dim", "equal", "is_nonzero", "allclose"}


class _Ops(TorchDispatchMode):
    """Every aten op a pass runs, with its tensor arguments' shapes and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        shapes = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


def test_recorded_passes_are_capturable() -> None:
    """What a CUDA graph needs of a pass, checked on any device: the decode step and a verify pass run the same
    ops on the same shapes at every position (no control flow on the position or on results), and none of them
    reads a result on the host; the same for the MTP head's draft pass."""
    eng, _ = _engines()
    r, m, c = eng.runner, eng.model, eng.cache
    c.reset()
    r.forward(list(range(5)), c, chunked=True)
    traces = []
    for toks, rows, capture in (([7], "last", False), ([8], "last", False), ([9, 10, 11], "all", True),
                                ([12, 13, 14], "all", True)):
        traces.append(_trace(r.graphs, (m.embed(torch.tensor(toks)),), c, rows, capture))
        c.pos += len(toks)
    head = m.mtp
    assert head is not None and r.mtp is not None
    hc = head.new_cache(64)
    for t in range(3):  # chained draft rows at positions 0, 1, 2
        traces.append(_trace(r.mtp.graphs, (head.normed_embeddings(torch.tensor([t])),
                                                torch.zeros(1, head.hp.n_embd, device=DEV)), hc, "last", False))
        hc.pos += 1
    assert traces[0] == traces[1] and traces[2] == traces[3] and traces[4] == traces[5] == traces[6]
    assert len(traces[0]) > 50 and any(name == "index_copy_" for name, _ in traces[0] + traces[4])
    # index rows and the IQ4_NL codebook are kept (engine.ops.indices, triton_q._kvalues): made in no pass, so a
    # replay launches no kernel (or host copy) for them
    assert not {name for t in traces for name, _ in t} & {"arange", "zeros_like", "repeat_interleave", "lift_fresh",
                                                         "lift_fresh_copy"}


def _trace(graphs: step_graph.StepGraphs | None, inputs: tuple[torch.Tensor, ...], cache: Cache, rows: str,
           capture: bool) -> list[tuple[str, tuple]]:
    """The aten ops of the pass a StepGraphs records for these inputs at cache.pos, checked for host reads."""
    assert graphs is not None
    graphs.run(inputs, cache, rows, capture)  # makes the pass's static buffers (on CUDA: its warm-up)
    with _Ops() as rec:  # the recorded form itself, what a capture records
        graphs.record_eagerly(inputs[0].shape[0], rows, capture, cache)
    assert not {name for name, _ in rec.ops} & SYNCS
    assert not [op for op in rec.ops if op[0] in ("index", "index_put_") and any(dt is torch.bool for _, dt in op[1])]
    return rec.ops


def test_greedy_mtp_equals_plain_with_step_graphs() -> None:
    graphed, eager = _engines()
    for e in (graphed, eager):
        e.tokenizer.eog_ids = frozenset()
    prompt = np.random.default_rng(3).integers(0, 380, 4).tolist()

    plain = collect(graphed, prompt, max_tokens=6, mtp=False)[0]
    assert len(plain) == 6 and collect(eager, prompt, max_tokens=6, mtp=False)[0] == plain
    graphed.reset()
    spec, _, final, _ = collect(graphed, prompt, max_tokens=6, mtp=True, draft=2)
    assert spec == plain and final is not None and final.speculative.verify_steps > 0


def test_step_graphs_are_chosen_where_the_trunk_allows_them() -> None:
    native = ops.default_backend()
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=64, backend=native))
    assert eng.runner.graphs is None and not eng.cache.fixed  # auto: CUDA only
    assert eng.model.capturable() == f"layer 0 runs on the {native.name} backend, not Triton's"
    with pytest.raises(ValueError, match="cannot run this model: layer 0 runs on the"):
        load(fixture_path(TINY_MOE), EngineConfig(n_ctx=64, backend=native, step_graphs="on"))
    with pytest.raises(ValueError, match="not resident in Triton's kernels"):  # F32 experts: no Triton product
        load(fixture_path(TINY_MOE), EngineConfig(n_ctx=64, backend=TRITON, device=str(DEV), step_graphs="on"))
    with pytest.raises(InvalidParameterError, match="step graphs must be"):
        load(fixture_path(TINY_MOE), EngineConfig(n_ctx=64, step_graphs="always"))
