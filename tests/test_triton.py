"""The Triton backend (engine.ops.triton_q): every kernel against the torch dequantization of random blocks, batch
invariance of the GEMV, the grouped routed-expert GEMV over stacks and an expert cache's slots, greedy MTP identity
on a model built on it, and the ahead-of-time build for every GPU generation we ship for.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), on small shapes; on a GPU the same tests run the compiled kernels on the device."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine import ops
from engine.events import MAX_DRAFT, EngineConfig
from engine.expert_cache import ExpertCache
from engine.generate import load
from engine.metrics import cuda_status
from engine.ops import triton_norm, triton_q
from engine.ops.backend import TRITON, triton_runs
from engine.ops.experts import Experts, bind_experts, moe_experts
from engine.ops.linear import GEMV_ROWS
from engine.storage.qtensor import QTensor
from tests.fixtures import UD_Q4_K_M_MOE, fixture_path
from tests.generation import collect
from tests.test_quant import random_tensor

DEV = torch.device("cuda" if triton_runs("cuda") else "cpu")
TYPES = [pytest.param(t, id=t.name) for t in triton_q.TYPES]


def _blocks(qt: QT, shape: tuple[int, ...], seed: int = 0) -> QTensor:
    """Random valid blocks with moderate float16 scales (tests/test_quant.py's maker)."""
    raw = random_tensor(qt, (int(np.prod(shape[:-1])), shape[-1]), seed, wide=False)
    return QTensor(torch.from_numpy(raw).reshape(*shape[:-1], -1), qt, shape)


def _cols(qt: QT) -> int:
    return 352 if qt == QT.Q8_0 else 512  # Q8_0: 11 blocks, a unit and a part of one


@pytest.mark.parametrize("qt", TYPES)
def test_gemv_matches_the_dequantized_product_and_is_batch_invariant(qt: QT) -> None:
    rows, cols = 37, _cols(qt)  # 37: the last program's rows partly masked
    w = _blocks(qt, (rows, cols))
    ref_w = w.dequantize().double()
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    raw, xd = w.raw.to(DEV), x.to(DEV)
    at = torch.arange(5, device=DEV)
    y = triton_q.gemv_pairs(raw, qt, rows, cols, xd, torch.zeros_like(at), at).cpu()
    want = x.double() @ ref_w.T
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for i in range(5):  # a row of a 5-row pass has the bits of a one-row pass, and of the same row in another order
        one = triton_q.gemv_pairs(raw, qt, rows, cols, xd[i:i + 1], at[:1] * 0, at[:1]).cpu()
        assert torch.equal(one[0], y[i])
    rev = triton_q.gemv_pairs(raw, qt, rows, cols, xd, torch.zeros_like(at), at.flip(0)).cpu()
    assert torch.equal(rev, y.flip(0))


@pytest.mark.parametrize("qt", TYPES)
def test_pairs_read_each_pairs_matrix_of_a_stack(qt: QT) -> None:
    e, rows, cols = 3, 16, _cols(qt)
    w = _blocks(qt, (e, rows, cols), seed=2)
    ref_w = w.dequantize().view(e, rows, cols).double()
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(3))
    sel, xrow = torch.tensor([2, 0, 2, 1]), torch.tensor([0, 1, 1, 0])
    y = triton_q.gemv_pairs(w.raw.reshape(e, -1).to(DEV), qt, rows, cols, x.to(DEV), sel.to(DEV), xrow.to(DEV)).cpu()
    for p in range(4):
        want = ref_w[sel[p]] @ x[xrow[p]].double()
        assert torch.allclose(y[p].double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("qt", TYPES)
def test_fused_glu_and_slot_sums_have_the_plain_products_bits_and_are_batch_invariant(qt: QT) -> None:
    e, rows, cols = 3, 21, _cols(qt)
    gate, up = _blocks(qt, (e, rows, cols), seed=11), _blocks(qt, (e, rows, cols), seed=12)
    g, u = gate.raw.reshape(e, -1).to(DEV), up.raw.reshape(e, -1).to(DEV)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(13)).to(DEV)
    sel, xrow = torch.tensor([2, 0, 1, 2], device=DEV), torch.tensor([0, 1, 1, 2], device=DEV)
    h = triton_q.gemv_glu_pairs(g, u, qt, rows, cols, x, sel, xrow)
    pg, pu = (triton_q.gemv_pairs(m, qt, rows, cols, x, sel, xrow) for m in (g, u))
    assert torch.allclose(h, torch.nn.functional.silu(pg) * pu, rtol=1e-5, atol=1e-6 * float(h.abs().max()))
    one = triton_q.gemv_glu_pairs(g, u, qt, rows, cols, x, sel[3:], xrow[3:])
    assert torch.equal(one[0], h[3])  # a pair's bits whatever the other pairs
    # two tokens of two slots each: the down products and their weighted sum in one launch, in slot order; the same
    # products made apart and summed by slot_sum (an expert cache's path) have its bits
    wt = torch.tensor([[0.7, 0.3], [-0.25, 1.5]], device=DEV)
    ids = sel.view(2, 2)
    y = triton_q.gemv_slots(g, qt, rows, cols, x[xrow], ids, wt)
    apart = triton_q.gemv_pairs(g, qt, rows, cols, x, sel, xrow).view(2, 2, rows)
    assert torch.equal(triton_q.slot_sum(apart, wt), y)
    want = (apart * wt.unsqueeze(-1)).sum(1)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(triton_q.gemv_slots(g, qt, rows, cols, x[xrow][2:], ids[1:], wt[1:])[0], y[1])


@pytest.mark.parametrize("n_expert,k", [(256, 8), (60, 6)])
def test_routing_kernels_match_torchs_routing_and_are_batch_invariant(n_expert: int, k: int) -> None:
    from engine.ops import triton_route
    from engine.ops.experts import route

    gen = torch.Generator().manual_seed(14)
    d = 512
    router, shared = torch.randn(n_expert, d, generator=gen) * 0.05, torch.randn(1, d, generator=gen) * 0.05
    x = torch.randn(5, d, generator=gen)
    gates = triton_route.gate_matrix(router.to(DEV), shared.to(DEV))
    logits, w, idx, sg = (t.cpu() for t in triton_route.route(x.to(DEV), gates, n_expert, k))
    ref_logits = x.double() @ router.double().T
    assert torch.allclose(logits.double(), ref_logits, rtol=1e-5, atol=1e-5)
    ref_w, ref_idx = route(logits, k)
    assert torch.equal(idx, ref_idx) and torch.allclose(w, ref_w, rtol=1e-5, atol=1e-7)
    assert torch.allclose(sg.double(), torch.sigmoid(x.double() @ shared.double().T), rtol=1e-5, atol=1e-7)
    one = triton_route.route(x[3:4].to(DEV), gates, n_expert, k)
    assert torch.equal(one[1][0].cpu(), w[3]) and torch.equal(one[2][0].cpu(), idx[3])
    assert triton_route.route(x.to(DEV), gates[:n_expert], n_expert, k)[3] is None  # no shared expert


@pytest.mark.parametrize("qt", TYPES)
def test_dequantize_bf16_rounds_the_reference_values(qt: QT) -> None:
    rows, cols = 21, _cols(qt)
    w = _blocks(qt, (rows, cols), seed=4)
    got = triton_q.dequantize_bf16(w.raw.to(DEV), qt, rows, cols).cpu()
    assert torch.equal(got, w.dequantize().to(torch.bfloat16))  # round to nearest even, as torch rounds


def test_self_check_passes_where_the_kernels_run() -> None:
    assert triton_q.self_check(DEV) is None


def test_backend_choice_by_device() -> None:
    assert TRITON.on(DEV) == TRITON  # runs where this test machine runs it (compiled on CUDA, else interpreted)
    native = ops.default_backend()
    gpu = native.on("cuda")
    assert gpu.kind == ("triton" if triton_runs("cuda") else "torch")
    assert ops.TORCH.on("cuda") == ops.TORCH  # an explicit torch backend stays torch
    ok, why = cuda_status()
    if torch.version.cuda is None:  # the CPU build: the app's GPU controls say how to get the CUDA one
        assert not ok and "make setup-cuda" in why
    if not torch.cuda.is_available():
        assert not triton_runs("cuda")  # no GPU here: nothing claims CUDA
    else:
        assert ok and (why == "") == triton_runs("cuda")


def test_linear_binds_the_triton_types_and_runs_long_passes_in_bfloat16() -> None:
    w = _blocks(QT.Q4_K, (40, 512), seed=5)
    lin = ops.bind(QTensor(w.raw.to(DEV), QT.Q4_K, (40, 512)), TRITON)
    assert lin.kind == "triton"
    q3 = _blocks(QT.Q3_K, (16, 256))  # a type it has no kernel for
    assert ops.bind(QTensor(q3.raw.to(DEV), QT.Q3_K, (16, 256)), TRITON).kind == "dequant"
    ref = w.dequantize().double()
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(6))
    short = ops.linear(x[:3].to(DEV), lin).cpu()  # ≤ GEMV_ROWS: float32 GEMV
    assert torch.allclose(short.double(), x[:3].double() @ ref.T, rtol=1e-5, atol=1e-4)
    # a verify at the deepest draft is still a GEMV: each of its rows has a one-row pass's bits
    assert GEMV_ROWS >= MAX_DRAFT + 1
    verify = ops.linear(x[:MAX_DRAFT + 1].to(DEV), lin).cpu()
    assert torch.equal(verify[MAX_DRAFT], ops.linear(x[MAX_DRAFT:MAX_DRAFT + 1].to(DEV), lin).cpu()[0])
    long = ops.linear(x.to(DEV), lin).cpu()  # a prefill chunk: bfloat16 weights and activations into matmul
    want = x.to(torch.bfloat16).double() @ w.dequantize().to(torch.bfloat16).double().T
    assert torch.allclose(long.double(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def _experts(cache: int | None) -> tuple[Experts, tuple[QTensor, QTensor, QTensor]]:
    n_e, d, f = 6, 256, 256
    ws = (_blocks(QT.Q4_K, (n_e, f, d), 7), _blocks(QT.Q4_K, (n_e, f, d), 8), _blocks(QT.Q5_K, (n_e, d, f), 9))
    dev_ws = tuple(QTensor(t.raw.to(DEV) if cache is None else t.raw, t.qtype, t.shape) for t in ws)
    ec = ExpertCache(*dev_ws, capacity=cache, device=DEV) if cache is not None else None  # type: ignore[arg-type]
    return bind_experts(*dev_ws, TRITON, device=DEV, cache=ec), ws  # type: ignore[arg-type]


def test_routed_experts_grouped_gemv_matches_the_reference_and_the_cache() -> None:
    ex, (g, u, dn) = _experts(None)
    assert ex.kind == "triton"
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(4, 256, generator=gen)
    idx = torch.tensor([[0, 3], [3, 5], [1, 0], [5, 2]])
    wts = torch.rand(4, 2, generator=gen)
    y = moe_experts(x.to(DEV), idx.to(DEV), wts.to(DEV), ex).cpu()
    gw, uw, dw = (t.dequantize().view(t.shape).double() for t in (g, u, dn))
    for t in range(4):
        want = sum(wts[t, s].double() * (dw[e] @ (torch.nn.functional.silu(gw[e] @ x[t].double()) * (uw[e] @ x[t].double())))
                   for s, e in enumerate(idx[t].tolist()))
        assert torch.allclose(y[t].double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    one = moe_experts(x[2:3].to(DEV), idx[2:3].to(DEV), wts[2:3].to(DEV), ex).cpu()
    assert torch.equal(one[0], y[2])  # batch invariance through the experts
    # the same experts from an expert cache's slots (3 slots: misses, hits and evictions), read in place
    cex, _ = _experts(3)
    if DEV.type == "cpu":  # CPU stand-ins: the slots are CPU tensors the interpreted kernels read
        assert cex.cache_triton
    for _ in range(2):
        got = torch.cat([moe_experts(x[t:t + 1].to(DEV), idx[t:t + 1].to(DEV), wts[t:t + 1].to(DEV), cex).cpu()
                         for t in range(4)])
        assert torch.equal(got, y)
    st = cex.cache.stats  # type: ignore[union-attr]
    assert st.hits > 0 and st.misses > 0 and st.evictions > 0


def test_greedy_mtp_equals_plain_on_the_triton_backend() -> None:
    # Q4_K matrices, Q5_K routed down projections, a Q6_K head; few tokens: the interpreter runs ~5 s a step
    eng = load(fixture_path(UD_Q4_K_M_MOE), EngineConfig(n_ctx=256, backend=TRITON, device=str(DEV)))
    eng.tokenizer.eog_ids = frozenset()
    kinds = {lin.kind for lin in _linears(eng.model)}
    assert "triton" in kinds and not kinds & {"native", "int8"}
    prompt = np.random.default_rng(1).integers(0, 380, 5).tolist()

    plain = collect(eng, prompt, max_tokens=7, mtp=False)[0]
    assert len(plain) == 7
    eng.reset()
    spec_toks, _, final, _ = collect(eng, prompt, max_tokens=7, mtp=True, draft=2)
    assert spec_toks == plain and final.speculative.verify_steps > 0  # verify passes of 3 rows ran


def _linears(model) -> list:  # type: ignore[no-untyped-def]
    out, seen, todo = [], set(), [model]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (torch.Tensor, QTensor, str, int, float)):
            continue
        seen.add(id(o))
        if isinstance(o, ops.Linear):
            out.append(o)
            continue
        items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else \
            vars(o).values() if hasattr(o, "__dict__") else ()
        todo.extend(items)
    return out


def test_every_kernel_compiles_ahead_of_time_for_every_gpu_generation() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels, not interpreted
    r = subprocess.run([sys.executable, "-m", "engine.ops.triton_q"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    built = json.loads(r.stdout)
    assert sorted(map(int, built)) == sorted(triton_q.ARCHS) == [80, 86, 89, 90, 120]
    for arch, kernels in built.items():
        # every launch form for FULL_ARCH, one per kernel and type for the others, each under its own name
        forms = triton_q.launch_forms() if int(arch) == triton_q.FULL_ARCH else triton_q.kernel_forms()
        assert len(kernels) == len(forms), arch
        assert all(n > 1000 for n in kernels.values()), arch


@pytest.mark.parametrize("l2,weight,gate,d", [(False, True, False, 256), (False, True, True, 128),
                                              (True, False, False, 128), (False, True, False, 96)])
def test_norm_rows_match_the_torch_twins_and_are_batch_invariant(l2: bool, weight: bool, gate: bool, d: int) -> None:
    from engine.ops import norms

    g = torch.Generator().manual_seed(d)
    x = torch.randn(5, 3, d, generator=g) * 3
    w = 1 + 0.1 * torch.randn(d, generator=g) if weight else None
    gt = torch.rand(5, 3, d, generator=g) if gate else None
    post = 0.125 if l2 else 1.0
    got = triton_norm.norm_rows(x.to(DEV), None if w is None else w.to(DEV), None if gt is None else gt.to(DEV),
                                1e-6, l2, post).cpu()
    if l2:
        want = norms.l2_norm_torch(x.double(), 1e-6) * post
    else:
        want = norms.rms_norm_torch(x.double(), w.double(), 1e-6) * (gt.double() if gate else 1)  # type: ignore[union-attr]
    assert got.shape == x.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    one = triton_norm.norm_rows(x[2:3, 1:2].to(DEV), None if w is None else w.to(DEV),
                                None if gt is None else gt[2:3, 1:2].to(DEV), 1e-6, l2, post).cpu()
    assert torch.equal(one[0, 0], got[2, 1])  # a row of a pass has its one-row pass's bits
    # the ops the Triton backend's layers call go through it
    y = norms.rms_norm(x.to(DEV), (w if w is not None else torch.ones(d)).to(DEV), 1e-6, TRITON).cpu()
    assert torch.equal(y, triton_norm.norm_rows(x.to(DEV), (w if w is not None else torch.ones(d)).to(DEV), None,
                                                1e-6, False).cpu())


def test_gemv_sweep_script_runs_and_checks_every_shape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, "bench/gemv_sweep.py", "--quick", "--device", str(DEV), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"}
                       if DEV.type == "cpu" else None)
    assert r.returncode == 0, r.stderr[-2000:]
    cases = json.loads(out.read_text())["models"]["qwen36-35b"]["cases"]
    assert cases and all(sum(e["current"] for e in c["shapes"]) == 1 for c in cases)  # the table's shape always runs
    assert all(e["ok"] and e["max_rel_diff"] < 1e-4 for c in cases for e in c["shapes"] if e["current"])
    if DEV.type == "cpu":  # the interpreter computes every shape right (compiled, some gave wrong sums: triton_q.GEMV)
        assert all(e["ok"] for c in cases for e in c["shapes"])
