"""CPU/CUDA hybrid without a GPU: placement arithmetic against a fake VRAM budget, the SLRU policy, and
identical outputs between placements when every "device" is the CPU (the expert cache's slots, copies and
bookkeeping run on CPU tensors standing in for device memory)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.errors import EngineError, OutOfMemoryError
from engine.expert_cache import SLRU
from engine.events import EngineConfig, GenerationConfig, Stats
from engine.generate import load
from engine.storage.modelfile import open_model
from engine.models.build import load_model
from engine.models.runner import Runner
from engine.placement import MiB, ModelSizes, PlacementConfig, Plan, plan_placement
from tests.fixtures import KQUANT_MOE, TINY_DENSE, TINY_MOE, UD_Q4_K_M_MOE, FixtureSpec, fixture_path

# --- SLRU ------------------------------------------------------------------------------------------


def test_slru_evicts_probationary_lru_first_and_protects_reused_keys() -> None:
    c = SLRU(4, protected_fraction=0.5)  # 2 protected slots
    slots = {k: c.put(k)[0] for k in (1, 2, 3, 4)}
    assert sorted(slots.values()) == [0, 1, 2, 3]
    assert c.get(1) == slots[1] and c.get(2) == slots[2]  # 1, 2 → protected
    slot, evicted = c.put(5)
    assert evicted == 3 and slot == slots[3]  # probationary LRU, not the older but reused 1 and 2
    assert 1 in c and 2 in c and 3 not in c and len(c) == 4


def test_slru_scan_does_not_flush_the_protected_segment() -> None:
    c = SLRU(8)  # 6 protected
    for k in range(6):
        c.put(k)
        c.get(k)
    for k in range(100, 140):  # a burst of once-used keys
        c.put(k)
    assert all(k in c for k in range(6))


def test_slru_protected_overflow_demotes_to_probation() -> None:
    c = SLRU(3, protected_fraction=0.34)  # 1 protected slot
    for k in (1, 2, 3):
        c.put(k)
    c.get(1)
    c.get(2)  # 2 protected, 1 demoted to probation's MRU end
    assert list(c.protected) == [2] and list(c.probation) == [3, 1]
    assert c.put(4)[1] == 3


def test_slru_never_evicts_pinned_keys() -> None:
    c = SLRU(2)
    c.put(1)
    c.put(2)
    assert c.put(3, pinned={1, 2}) is None
    assert c.put(3, pinned={1})[1] == 2
    assert SLRU(0).put(1) is None


# --- placement arithmetic ----------------------------------------------------------------------------

def _sizes(n_layer: int = 8, trunk: int = 100 * MiB, experts: int = 1000 * MiB, n_expert: int = 100) -> ModelSizes:
    return ModelSizes(n_layer, [trunk] * n_layer, [experts] * n_layer, [experts // n_expert] * n_layer, n_expert,
                      [8 * MiB if i % 4 == 3 else 0 for i in range(n_layer)],
                      [0 if i % 4 == 3 else 2 * MiB for i in range(n_layer)], 300 * MiB, 300 * MiB, 150 * MiB)


def _cfg(**kw) -> PlacementConfig:  # type: ignore[no-untyped-def]
    return PlacementConfig(device="cuda", margin_bytes=500 * MiB, **kw)


def test_everything_on_the_gpu_when_it_fits() -> None:
    s = _sizes()
    need = sum(s.trunk) + sum(s.experts) + sum(s.kv) + sum(s.state) + s.output + s.mtp
    p = plan_placement(s, _cfg(), need + 500 * MiB)
    assert p.gpu_layers == 8 and all(p.experts_on_gpu) and p.mtp_on_gpu and p.cache_experts == [0] * 8
    assert sum(p.gpu_bytes.values()) == need
    assert p.summary().startswith("8/8 layers on GPU, experts on GPU")


def test_auto_keeps_experts_on_cpu_and_fills_the_rest_with_cache() -> None:
    s = _sizes()
    free = 3000 * MiB  # budget 2500: all 8 trunk layers (828 with KV + state) + output (300) + MTP (150) fit, experts do not
    p = plan_placement(s, _cfg(), free)
    assert p.gpu_layers == 8 and not any(p.experts_on_gpu)
    left = 2500 * MiB - (sum(s.trunk) + sum(s.kv) + sum(s.state) + s.output + s.mtp)
    per_layer = left // (10 * MiB * 8)
    assert p.cache_experts == [per_layer] * 8 and per_layer == 15  # (2500 − 1278) MiB / (8 × 10 MiB)
    assert sum(p.gpu_bytes.values()) <= 2500 * MiB
    assert "do not fit" in p.reason or "does not fit" in p.reason
    assert "cache 15 experts/layer" in p.summary()


def test_auto_with_a_small_budget_offloads_the_last_layers() -> None:
    s = _sizes()
    p = plan_placement(s, _cfg(), 500 * MiB + 300 * MiB + 3 * 102 * MiB + 50 * MiB)
    assert p.layer_on_gpu == [False] * 5 + [True] * 3
    assert not p.mtp_on_gpu  # the MTP block follows only when every layer is on the GPU
    assert p.summary().startswith("3/8 layers on GPU")


def test_nothing_fits_means_cpu_with_the_reason() -> None:
    p = plan_placement(_sizes(), _cfg(), 600 * MiB)
    assert not p.uses_gpu and "no layer fits" in p.reason


def test_explicit_choices_are_checked_against_the_budget() -> None:
    s = _sizes()
    p = plan_placement(s, _cfg(gpu_layers=2, cpu_moe=True, expert_cache="4"), 10_000 * MiB)
    assert p.gpu_layers == 2 and p.cache_experts == [0] * 6 + [4, 4]
    assert p.gpu_bytes["expert_cache"] == 2 * 4 * 10 * MiB
    p = plan_placement(s, _cfg(gpu_layers=8, cpu_moe=True, expert_cache="160MiB"), 10_000 * MiB)
    assert p.cache_experts == [2] * 8  # 160 MiB over 8 layers of 10 MiB experts
    with pytest.raises(OutOfMemoryError, match="need"):
        plan_placement(s, _cfg(gpu_layers=8), 2000 * MiB)
    with pytest.raises(OutOfMemoryError, match="expert cache"):
        plan_placement(s, _cfg(gpu_layers=8, cpu_moe=True, expert_cache="100"), 3000 * MiB)
    with pytest.raises(EngineError, match="0…8"):
        plan_placement(s, _cfg(gpu_layers=9), None)
    with pytest.raises(EngineError, match="free VRAM is unknown"):
        plan_placement(s, _cfg(), None)
    with pytest.raises(EngineError, match="needs a GPU"):
        plan_placement(s, PlacementConfig(device="cpu", gpu_layers=3), None)
    with pytest.raises(EngineError, match="number of experts"):
        plan_placement(s, _cfg(gpu_layers=8, cpu_moe=True, expert_cache="lots"), None)


def test_model_sizes_add_up_to_the_file() -> None:
    mf = open_model(fixture_path(KQUANT_MOE))
    s = ModelSizes.from_model(mf, n_ctx=256)
    total = sum(t.n_bytes for t in mf.tensors.values())
    kv_mtp = 256 * mf.hparams.n_head_kv * (mf.hparams.head_dim_k + mf.hparams.head_dim_v) * 4
    assert sum(s.trunk) + sum(s.experts) + s.output + s.embedding + s.mtp - kv_mtp == total
    assert s.expert_one[0] * s.n_expert == s.experts[0] > 0
    assert sum(1 for k in s.kv if k) == len(mf.hparams.attention_layers)


# --- the CPU twin: same outputs whatever the placement ----------------------------------------------

def _plan(spec: FixtureSpec, **kw) -> Plan:  # type: ignore[no-untyped-def]
    """A plan made for a CUDA device with plenty of VRAM, then run with the CPU standing in for it."""
    mf = open_model(fixture_path(spec))
    p = plan_placement(ModelSizes.from_model(mf, 256), PlacementConfig(device="cuda", margin_bytes=0, **kw),
                       1 << 40 if kw.get("gpu_layers") is None else None)
    return dataclasses.replace(p, device="cpu")


PLACEMENTS = {
    "resident": {},
    "last-2-layers": {"gpu_layers": 2},
    "cpu-moe-no-cache": {"gpu_layers": 4, "cpu_moe": True, "expert_cache": "0"},
    "cache-3-load": {"gpu_layers": 4, "cpu_moe": True, "expert_cache": "3"},
    "cache-3-cpu": {"gpu_layers": 4, "cpu_moe": True, "expert_cache": "3", "miss_policy": "cpu"},
    "cache-all": {"gpu_layers": 4, "cpu_moe": True, "expert_cache": "8"},
}


def _logits(m: Runner, toks: list[int]) -> torch.Tensor:
    cache = m.new_cache(256)
    out = [m.forward(toks[:20], cache, logit_rows="all").logits]  # a prefill
    out += [m.forward(toks[i:i + 3], cache, logit_rows="all").logits for i in range(20, 32, 3)]  # verifies
    out += [m.forward([t], cache).logits for t in toks[32:40]]  # decode steps
    return torch.cat(out)


@pytest.mark.parametrize("spec", [TINY_MOE, KQUANT_MOE, TINY_DENSE, dataclasses.replace(TINY_MOE, qtype="Q8_0"),
                                  UD_Q4_K_M_MOE], ids=["moe-f32", "moe-q4k", "dense-f32", "moe-q8", "moe-ud-q4km"])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_outputs_identical_between_placements(spec: FixtureSpec, name: str) -> None:
    toks = np.random.default_rng(3).integers(0, spec.n_vocab - 3, 40).tolist()
    mf = open_model(fixture_path(spec))
    base = _logits(load_model(mf, n_ctx=256), toks)
    m = load_model(mf, n_ctx=256, plan=_plan(spec, **PLACEMENTS[name]))
    assert torch.equal(_logits(m, toks), base)
    if spec.arch == "qwen35moe" and "cache-3" in name:
        st = [c.stats for c in m.model.expert_caches.values()]
        assert len(st) == 4 and all(s.misses > 0 and s.hits > 0 and s.evictions > 0 for s in st)
        one = m.model.expert_caches[0].expert_bytes
        assert all(s.bytes_moved % one == 0 and s.bytes_moved // one >= 3 for s in st)
        assert all(len(c.lru) == 3 for c in m.model.expert_caches.values())


def test_cache_counts_every_routed_expert_once_per_pass() -> None:
    mf = open_model(fixture_path(TINY_MOE))
    m = load_model(mf, n_ctx=256, plan=_plan(TINY_MOE, gpu_layers=4, cpu_moe=True, expert_cache="8"))
    cache = m.new_cache(256)
    m.forward([1, 2, 3, 4, 5], cache)
    c = m.model.expert_caches[0]
    assert c.stats.hits == 0 and c.stats.misses == len(c.lru) > 0  # cold: every distinct expert missed once
    n0 = c.stats.misses
    m.forward([1, 2, 3, 4, 5], cache)  # the same tokens at later positions: mostly the same experts
    assert c.stats.misses - n0 <= 8 - n0 and c.stats.evictions == 0  # capacity 8 = every expert: no eviction


def test_generation_reports_placement_and_cache_stats() -> None:
    mf_path = fixture_path(TINY_MOE)
    eng = load(mf_path, EngineConfig(n_ctx=256, plan=_plan(TINY_MOE, gpu_layers=4, cpu_moe=True, expert_cache="3")))
    assert eng.plan is not None and eng.plan.gpu_layers == 4
    final = None
    for ev in eng.generate([5, 6, 7, 8], GenerationConfig(max_tokens=12, draft=2)):
        if isinstance(ev, Stats) and ev.final:
            final = ev
    assert final is not None and final.expert_cache is not None
    assert set(final.expert_cache) == {0, 1, 2, 3}
    assert all(v["hits"] + v["misses"] > 0 for v in final.expert_cache.values())
    ref = load(mf_path, EngineConfig(n_ctx=256))
    toks = [ev.ids for ev in ref.generate([5, 6, 7, 8], GenerationConfig(max_tokens=12, draft=2))
            if hasattr(ev, "ids")]
    eng.reset()
    again = [ev.ids for ev in eng.generate([5, 6, 7, 8], GenerationConfig(max_tokens=12, draft=2))
             if hasattr(ev, "ids")]
    assert again == toks


def test_cpu_experts_of_a_gpu_layer_run_in_the_native_kernels() -> None:
    """cpu_moe: a layer on the GPU whose routed experts stay in RAM runs them in the native kernels (the pass's rows
    copied over), not in torch's dequantizing path."""
    import engine.ops as ops
    from engine.storage.qtensor import QTensor
    from engine.storage.quantize import random_blocks
    from gguf import GGMLQuantizationType as QT

    backend = ops.default_backend()
    if not backend.native:
        pytest.skip("the native library is not built")
    rng = np.random.default_rng(0)
    ws = [QTensor(torch.from_numpy(random_blocks(s, QT.Q4_K, rng, 0.02)), QT.Q4_K, s)
          for s in ((4, 256, 256), (4, 256, 256), (4, 256, 256))]
    assert ops.bind_experts(*ws, backend, device="cuda").kind == "native"
