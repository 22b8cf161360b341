"""The metrics dock buffers stats from the worker and draws them on its timer."""
from __future__ import annotations

import numpy as np

from app.charts import MetricsDock, Ring
from engine.generate import EngineConfig, GenerationConfig, Stats, load
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
