"""The metrics dock buffers stats from the worker and draws them on its timer."""
from __future__ import annotations

import numpy as np

from app.charts import MetricsDock, Ring
from engine.events import EngineConfig, GenerationConfig, Stats
from engine.generate import load
from tests.fixtures import TINY_MOE, fixture_path


def test_ring_keeps_the_newest_points_in_order() -> None:
    r = Ring(4)
    for i in range(6):
        r.push(float(i), float(i * 10))
    t, v = r.data()
    assert t.tolist() == [2, 3, 4, 5] and v.tolist() == [20, 30, 40, 50]


def test_charts_receive_engine_stats(qtbot) -> None:
    dock = MetricsDock()
    qtbot.addWidget(dock)
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=256))
    eng.tokenizer.eog_ids = frozenset()
    for ev in eng.generate([1, 2, 3], GenerationConfig(max_tokens=20, draft=2, stats_interval_s=0.0)):
        if isinstance(ev, Stats):
            dock.push_stats(ev)
    dock.set_mtp_off_reference(5.0)
    qtbot.waitUntil(lambda: dock.c_speed.getData()[0] is not None and len(dock.c_speed.getData()[0]) > 0, timeout=2000)
    x, y = dock.c_speed.getData()
    assert len(y) == dock.tok_s.n and np.all(y > 0)
    assert len(dock.c_acc.getData()[1]) > 0 and dock.ref_line.isVisible() and dock.ref_line.value() == 5.0
    img = dock.heat.image
    assert img is not None and img.shape == (TINY_MOE.n_expert, TINY_MOE.n_layer + 1)  # trunk + MTP layer
    assert "tok/s" in dock.summary.text() and "drafts" in dock.summary.text()
    qtbot.waitUntil(lambda: dock.mem.n >= 2, timeout=2000)  # the 100 ms timer samples memory


def test_expert_cache_charts_from_a_hybrid_run(qtbot) -> None:
    """A CUDA plan run with the CPU standing in for the GPU: its cache stats reach the dock."""
    import dataclasses

    from engine.storage.modelfile import open_model
    from engine.placement import ModelSizes, PlacementConfig, plan_placement

    mf = open_model(fixture_path(TINY_MOE))
    plan = plan_placement(ModelSizes.from_model(mf, 256), PlacementConfig(
        device="cuda", gpu_layers=TINY_MOE.n_layer, cpu_moe=True, expert_cache="3"), None)
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=256, plan=dataclasses.replace(plan, device="cpu")))
    eng.tokenizer.eog_ids = frozenset()
    dock = MetricsDock()
    qtbot.addWidget(dock)
    for ev in eng.generate([1, 2, 3], GenerationConfig(max_tokens=30, draft=2, stats_interval_s=0.0)):
        if isinstance(ev, Stats):
            dock.push_stats(ev)
    qtbot.waitUntil(lambda: not dock.p_cache.isHidden() and dock.c_hit.getData()[1] is not None, timeout=2000)
    hits = dock.c_hit.getData()[1]
    assert np.all((hits >= 0) & (hits <= 1)) and 0 < dock.occupancy.v[dock.occupancy.n - 1] <= 1
    assert dock.heat.image.shape[1] == TINY_MOE.n_layer and "hit rate per layer" in dock.p_usage.plotItem.titleLabel.text
