"""The metrics dock buffers stats from the worker and draws them on its timer."""
from __future__ import annotations

import numpy as np

import pyqtgraph as pg

from app.charts import MODE_COLOURS, MetricsDock, Ring
from app.speedup import SERVER
from engine.events import EngineConfig, GenerationConfig, SpeculativeStats, Stats
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
    dock.begin_reply(mode, "tiny · this computer")
    for ev in eng.generate([1, 2, 3], GenerationConfig(max_tokens=40, stats_interval_s=0.0, **gen)):
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
    assert [r.kind for r in dock.replies] == ["off", "auto", "fixed"] and dock.replies[2].tokens == 40
    ref = dock.replies[0].tok_s
    assert dock.ref_line.isVisible() and dock.ref_line.value() == ref
    k2 = dock.replies[2]
    want = f"×{k2.tok_s / ref:.1f}"
    assert any(lab.textItem.toPlainText() == f"{want}\nK=2" for lab in dock.bar_labels)
    assert f"{want} vs MTP off ({k2.tok_s:.1f} against {ref:.1f} tokens/s, one MTP-off reply of this model)" \
        in dock.summary.text()
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


def _final(tok_s: float, tokens: int, mtp: bool = True, drafted: int | None = None) -> Stats:
    """A reply's last Stats, as an engine sends it."""
    spec = SpeculativeStats(drafted=drafted, accepted=drafted // 2) if drafted is not None else None
    return Stats(prompt_tokens=10, prefill_tokens=10, generated_tokens=tokens, ttft_s=0.1, prefill_tok_s=100.0,
                 decode_tok_s=tok_s, elapsed_s=1.0, cache_bytes=0, state_bytes=0, final=True, mtp=mtp,
                 speculative=spec)


def _label(dock: MetricsDock, i: int) -> str:
    dock.refresh()
    return dock.bar_labels[i].textItem.toPlainText()


def test_speed_ups_are_claimed_only_where_measured(qtbot) -> None:
    dock = MetricsDock()
    qtbot.addWidget(dock)
    local, remote = "tiny · this computer", "qwen @ gpu:8080 · remote llama.cpp server"
    dock.begin_reply("auto", local)
    dock.push_stats(_final(60.0, 100, drafted=40))
    assert dock.engine_row.isVisibleTo(dock) and not dock.engine_box.isEnabled()  # one engine: nothing to choose
    assert _label(dock, 0) == "auto" and "no MTP-off reply yet to compare with" in dock.summary.text()
    assert not dock.ref_line.isVisible()  # no estimate stands in for a measurement
    dock.begin_reply("auto", local)
    dock.push_stats(_final(45.0, 100, drafted=0))  # auto chose not to draft: no speed-up to credit
    assert _label(dock, 1) == "no drafts\nauto" and "MTP auto drafted nothing" in dock.summary.text()
    dock.begin_reply("K=2", local)
    dock.push_stats(_final(80.0, 12, drafted=10))
    assert _label(dock, 2) == "short" and "12 tokens: too short to compare" in dock.summary.text()
    assert [pg.mkBrush(b).color().alpha() for b in dock.bars.opts["brushes"]] == [255, 255, 90]  # faded
    dock.begin_reply("off", local)
    dock.push_stats(_final(30.0, 20, mtp=False))  # too short to be a baseline either
    assert _label(dock, 0) == "auto" and _label(dock, 3) == "short"
    dock.begin_reply("off", local)
    dock.push_stats(_final(40.0, 64, mtp=False))
    assert _label(dock, 0) == "×1.5\nauto" and _label(dock, 1) == "no drafts\nauto" and _label(dock, 4) == "off"
    assert dock.ref_line.isVisible() and dock.ref_line.value() == 40.0
    tip = dock.bar_labels[0].toolTip()
    assert "×1.5 vs MTP off (60.0 against 40.0 tokens/s, one MTP-off reply of this model)" in tip
    # A remote server's replies: their own series, never compared with this computer's, "server" not "auto".
    dock.begin_reply(SERVER, remote)
    dock.push_stats(_final(175.7, 100, mtp=True, drafted=50))
    dock.refresh()
    assert dock.engine_box.isEnabled() and dock.engine_box.currentText() == remote
    assert len(dock.bar_labels) == 1 and _label(dock, 0) == "server" and not dock.ref_line.isVisible()
    assert "server's own setting" in dock.summary.text() and "vs MTP off" not in dock.summary.text()
    assert dock.engine_box.count() == 2
    assert [pg.mkBrush(b).color().name() for b in dock.bars.opts["brushes"]] == [MODE_COLOURS[SERVER]]
    dock.engine_box.setCurrentText(local)  # back to this computer's replies, unchanged
    assert _label(dock, 0) == "×1.5\nauto" and len(dock.bar_labels) == 5


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
