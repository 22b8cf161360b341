"""Live metrics dock: decode speed, speculation, memory, expert cache and expert usage (pyqtgraph).

Following pyqtgraph's scrolling-plot example: the worker only emits small Stats objects; they land in
fixed-size ring buffers on the GUI thread, and a 100 ms QTimer redraws by `setData` on existing items.
"""
from __future__ import annotations

import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer, Slot
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from engine.events import Stats
from engine.metrics import SystemMonitor

HISTORY = 600  # points per series: one minute at the 100 ms tick
HEAT_STEPS = 120  # columns of the per-layer cache hit-rate map


class Ring:
    """A fixed-size ring buffer of (t, value) pairs; `data()` returns them oldest first."""

    def __init__(self, size: int = HISTORY):
        self.t = np.zeros(size)
        self.v = np.zeros(size)
        self.n = 0
        self.size = size

    def push(self, t: float, v: float) -> None:
        i = self.n % self.size
        self.t[i], self.v[i] = t, v
        self.n += 1

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n <= self.size:
            return self.t[:self.n], self.v[:self.n]
        i = self.n % self.size
        return np.concatenate([self.t[i:], self.t[:i]]), np.concatenate([self.v[i:], self.v[:i]])


class MetricsDock(QWidget):
    def __init__(self, parent: QWidget | None = None, monitor: SystemMonitor | None = None):
        super().__init__(parent)
        self.setAccessibleName("Live metrics")
        self.monitor = monitor or SystemMonitor()
        self.t0 = time.monotonic()
        self.tok_s, self.acceptance, self.mean_len = Ring(), Ring(), Ring()
        self.mem, self.cpu = Ring(), Ring()
        self.usage: np.ndarray | None = None
        self.hit_rate, self.occupancy = Ring(), Ring()
        self.layer_hits: np.ndarray | None = None  # [HEAT_STEPS, layers] windowed hit rate per layer, a ring
        self.layer_hits_n = 0
        self._cache_last: dict[int, tuple[int, int]] = {}
        self.by_depth: list[float] = []
        self.mtp_off_reference: float | None = None
        self.dirty = False

        lay = QVBoxLayout(self)
        self.summary = QLabel("No generation yet")
        self.summary.setAccessibleName("Metrics summary")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        grid = QGridLayout()
        lay.addLayout(grid)
        self.p_speed = self._plot("Decode tok/s")
        self.c_speed = self.p_speed.plot(pen=pg.mkPen("#2b8cbe", width=2), symbol="o", symbolSize=4,
                                         symbolBrush="#2b8cbe", symbolPen=None)  # a short reply is one point
        self.ref_line = pg.InfiniteLine(angle=0, pen=pg.mkPen("#999", style=pg.QtCore.Qt.PenStyle.DashLine),
                                        label="MTP off", labelOpts={"position": 0.05})
        self.ref_line.setVisible(False)
        self.p_speed.addItem(self.ref_line)
        self.p_spec = self._plot("Draft acceptance / mean accepted length")
        self.c_acc = self.p_spec.plot(pen=pg.mkPen("#31a354", width=2), name="acceptance", symbol="o", symbolSize=4,
                                      symbolBrush="#31a354", symbolPen=None)
        self.c_len = self.p_spec.plot(pen=pg.mkPen("#e6550d", width=2), name="mean accepted length", symbol="o",
                                      symbolSize=4, symbolBrush="#e6550d", symbolPen=None)
        self.p_depth = self._plot("Acceptance by draft depth")
        self.bars = pg.BarGraphItem(x=np.arange(1, 9), height=np.zeros(8), width=0.6, brush="#31a354")
        self.p_depth.addItem(self.bars)
        self.p_depth.setYRange(0, 1)
        self.p_mem = self._plot("VRAM used (GiB)" if self.monitor.has_gpu else "Process RAM (GiB) / CPU %")
        self.c_mem = self.p_mem.plot(pen=pg.mkPen("#756bb1", width=2))
        self.c_cpu = self.p_mem.plot(pen=pg.mkPen("#bbb", width=1))
        self.p_cache = self._plot("Expert cache: hit rate / occupancy")
        self.c_hit = self.p_cache.plot(pen=pg.mkPen("#d62728", width=2), name="hit rate")
        self.c_occ = self.p_cache.plot(pen=pg.mkPen("#9467bd", width=1), name="occupancy")
        self.p_cache.setYRange(0, 1)
        self.p_cache.setVisible(False)  # shown once a GPU expert cache reports
        self.p_usage = self._plot("Expert usage per layer")
        self.heat = pg.ImageItem()
        self.p_usage.addItem(self.heat)
        self.p_usage.setLabel("left", "layer")
        self.p_usage.setLabel("bottom", "expert")
        for i, p in enumerate((self.p_speed, self.p_spec, self.p_depth, self.p_mem, self.p_cache, self.p_usage)):
            grid.addWidget(p, i, 0)

        self.timer = QTimer(self)
        self.timer.setInterval(100)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()

    def set_dark(self, dark: bool) -> None:
        """Chart colours for the app's theme (pyqtgraph draws its own background and axes)."""
        bg, fg = ("#1e1f22", "#d0d0d0") if dark else ("#ffffff", "#404040")
        for p in (self.p_speed, self.p_spec, self.p_depth, self.p_mem, self.p_cache, self.p_usage):
            p.setBackground(bg)
            for side in ("left", "bottom"):
                ax = p.getAxis(side)
                ax.setPen(fg)
                ax.setTextPen(fg)
            p.plotItem.titleLabel.setText(p.plotItem.titleLabel.text, color=fg)

    def _plot(self, title: str) -> pg.PlotWidget:
        w = pg.PlotWidget(title=title)
        w.setAccessibleName(title)
        w.setMinimumHeight(110)
        w.showGrid(x=True, y=True, alpha=0.2)
        return w

    def set_mtp_off_reference(self, tok_s: float | None) -> None:
        """Decode speed measured with MTP off on this model, drawn as a reference line."""
        self.mtp_off_reference = tok_s
        self.dirty = True

    @Slot(object)
    def push_stats(self, st: Stats) -> None:
        """Called on the GUI thread (queued from the worker): store only; drawing happens on the timer."""
        t = time.monotonic() - self.t0
        if st.decode_tok_s > 0:
            self.tok_s.push(t, st.decode_tok_s)
        sp = st.speculative
        if sp:
            self.acceptance.push(t, sp.acceptance)
            self.mean_len.push(t, sp.mean_accepted_length)
            self.by_depth = sp.acceptance_by_depth
        if st.expert_cache:
            self._push_cache(t, st.expert_cache)
        elif st.expert_usage:
            layers = sorted(st.expert_usage)
            self.usage = np.array([st.expert_usage[i] for i in layers], dtype=np.float64)
        self.last = st
        self.dirty = True

    def _push_cache(self, t: float, caches: dict[int, dict]) -> None:
        """Hit rate since the previous Stats (overall and per layer), and how full the caches are."""
        layers = sorted(caches)
        per_layer = np.zeros(len(layers))
        dh_all = dm_all = 0
        for j, il in enumerate(layers):
            c = caches[il]
            h0, m0 = self._cache_last.get(il, (0, 0))
            if c["hits"] < h0 or c["misses"] < m0:  # counters restarted (a new model)
                h0 = m0 = 0
            dh, dm = c["hits"] - h0, c["misses"] - m0
            self._cache_last[il] = (c["hits"], c["misses"])
            per_layer[j] = dh / (dh + dm) if dh + dm else np.nan
            dh_all, dm_all = dh_all + dh, dm_all + dm
        if dh_all + dm_all:
            self.hit_rate.push(t, dh_all / (dh_all + dm_all))
        cap = sum(c["capacity"] for c in caches.values())
        self.occupancy.push(t, sum(c["occupancy"] for c in caches.values()) / cap if cap else 0.0)
        if self.layer_hits is None or self.layer_hits.shape[1] != len(layers):
            self.layer_hits = np.full((HEAT_STEPS, len(layers)), np.nan)
            self.layer_hits_n = 0
        self.layer_hits[self.layer_hits_n % HEAT_STEPS] = per_layer
        self.layer_hits_n += 1

    @Slot()
    def refresh(self) -> None:
        s = self.monitor.sample()
        t = time.monotonic() - self.t0
        if s.vram_used_bytes is not None:
            self.mem.push(t, s.vram_used_bytes / 2**30)
        else:
            self.mem.push(t, s.rss_bytes / 2**30)
            self.cpu.push(t, s.cpu_percent / 100.0)
        self.c_mem.setData(*self.mem.data())
        self.c_cpu.setData(*self.cpu.data())
        if not self.dirty:
            return
        self.dirty = False
        self.c_speed.setData(*self.tok_s.data())
        if self.mtp_off_reference:
            self.ref_line.setPos(self.mtp_off_reference)
            self.ref_line.setVisible(True)
        self.c_acc.setData(*self.acceptance.data())
        self.c_len.setData(*self.mean_len.data())
        if self.by_depth:
            self.bars.setOpts(height=np.array(self.by_depth[:8], dtype=float))
        if self.layer_hits is not None:  # GPU expert cache: per-layer hit rate over time
            if self.p_cache.isHidden():
                self.p_cache.setVisible(True)
                self.p_usage.setTitle("Expert-cache hit rate per layer (over time)")
                self.p_usage.setLabel("bottom", "update")
            self.c_hit.setData(*self.hit_rate.data())
            self.c_occ.setData(*self.occupancy.data())
            n = self.layer_hits_n
            ring = self.layer_hits if n <= HEAT_STEPS else np.roll(self.layer_hits, -(n % HEAT_STEPS), axis=0)
            self.heat.setImage(np.nan_to_num(ring[:min(n, HEAT_STEPS)], nan=0.0), levels=(0.0, 1.0))
        elif self.usage is not None:
            rows = self.usage / np.maximum(self.usage.sum(axis=1, keepdims=True), 1.0)
            self.heat.setImage(rows.T, autoLevels=True)
        st = getattr(self, "last", None)
        if st is not None:
            parts = [f"{st.decode_tok_s:.1f} tok/s", f"TTFT {st.ttft_s * 1000:.0f} ms",
                     f"{st.generated_tokens} tokens"]
            if st.speculative:
                parts.append(f"accepted {st.speculative.accepted}/{st.speculative.drafted} drafts, "
                             f"mean length {st.speculative.mean_accepted_length:.2f}")
            self.summary.setText(" · ".join(parts))
