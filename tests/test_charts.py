"""The metrics dock buffers stats from the worker and draws them on its timer."""
from __future__ import annotations

import numpy as np

import pyqtgraph as pg

from app.charts import MODE_COLOURS, MetricsDock, Ring
from engine.events import EngineConfig, GenerationConfig, Stats
from engine.generate import load
from tests.fixtures import TINY_MOE, fixture_path


def test_ring_keeps_the_newest_points_in_order() -> None:
    r = Ring(4)
    for i in range(6):
        r.push(float(i), float(i * 10))
    t, v = r.data()
    assert t.tolist() == [2, 3, 4, 5] and v.tolist() == [20, 30, 40, 50]


def test_ring_gaps_break_the_line() -> None:
    r = Ring(8)
    r.push(0.0, 1.0)
    r.gap(1.0)
    r.gap(1.5)  # one break is enough
    r.push(2.0, 2.0)
    assert np.isnan(r.data()[1]).sum() == 1 and r.n == 3


def _reply(dock: MetricsDock, eng, mode: str, **gen) -> None:
    dock.begin_reply(mode)
    for ev in eng.generate([1, 2, 3], GenerationConfig(max_tokens=20, stats_interval_s=0.0, **gen)):
        if isinstance(ev, Stats):
            dock.push_stats(ev)


def test_charts_answer_whether_mtp_helps(qtbot) -> None:
    dock = MetricsDock()
    qtbot.addWidget(dock)
    dock.refresh()
    # Before any reply: sentences, not empty axes.
    assert not dock.c_replies.has_data and not dock.c_acc.has_data and not dock.c_usage.has_data
    assert not dock.c_depth.has_data and "MTP" in dock.c_replies.empty.text()
    eng = load(fixture_path(TINY_MOE), EngineConfig(n_ctx=256))
    eng.tokenizer.eog_ids = frozenset()
    _reply(dock, eng, "off", mtp=False)
    _reply(dock, eng, "auto")
    _reply(dock, eng, "K=2", draft=2)
    dock.refresh()
    assert [r.kind for r in dock.replies] == ["off", "auto", "fixed"]
    ref, source = dock.reference()
    assert ref == dock.replies[0].tok_s and "1 reply without MTP" in source
    assert dock.ref_line.isVisible() and dock.ref_line.value() == ref
    k2 = dock.replies[2]
    want = f"×{k2.tok_s / ref:.1f}"
    assert any(lab.textItem.toPlainText() == f"{want}\nK=2" for lab in dock.bar_labels)
    assert f"{want} vs MTP off" in dock.summary.text()
    brushes = dock.bars.opts["brushes"]
    assert [pg.mkBrush(b).color().name() for b in brushes] == [MODE_COLOURS[k] for k in ("off", "auto", "fixed")]
    # Time series: separate charts with units, a break between replies, acceptance in percent.
    t, v = dock.tok_s.data()
    assert np.isnan(v).sum() == 2 and np.nanmin(v) > 0
    acc = dock.acceptance.data()[1]
    assert acc[-1] == 100 * dock.last.speculative.acceptance  # percent, not a 0-1 fraction
    assert dock.c_acc.plot.getAxis("left").labelText == "accepted drafts (%)"
    assert dock.c_len.plot.getAxis("left").labelText == "tokens per step"
    assert dock.c_speed.has_data and dock.c_len.has_data
    assert "drafted tokens accepted" in dock.c_depth.plot.toolTip() and "depth 1:" in dock.c_depth.plot.toolTip()
    img = dock.heat.image
    assert img is not None and img.shape == (TINY_MOE.n_expert, TINY_MOE.n_layer + 1)  # trunk + MTP layer
    qtbot.waitUntil(lambda: dock.cpu.n >= 2, timeout=2000)  # the 100 ms timer samples memory and CPU (percent)
    assert dock.c_cpu.plot.getAxis("left").labelText == "CPU, all cores (%)" and dock.c_mem.has_data
    assert 0 <= np.nanmin(dock.cpu.data()[1]) and np.nanmax(dock.cpu.data()[1]) <= 100
    assert "x0.001" not in dock.c_mem.plot.getAxis("bottom").labelString()


def test_reference_estimate_until_a_reply_without_mtp(qtbot) -> None:
    dock = MetricsDock()
    qtbot.addWidget(dock)
    assert dock.reference() == (None, "")
    dock.set_mtp_off_reference(5.0)
    assert dock.reference()[0] == 5.0 and "estimated" in dock.reference()[1]


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
    qtbot.waitUntil(lambda: not dock.c_cache.isHidden() and dock.l_hit.getData()[1] is not None, timeout=2000)
    hits = dock.l_hit.getData()[1]
    assert np.all((hits >= 0) & (hits <= 1)) and 0 < dock.occupancy.v[dock.occupancy.n - 1] <= 1
    assert dock.heat.image.shape[1] == TINY_MOE.n_layer and "hit rate per layer" in dock.c_usage.plot.plotItem.titleLabel.text
