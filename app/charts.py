"""Metrics tab: is MTP helping (per-reply decode speed by MTP setting, per engine and model, the speed-up against
measured replies without MTP: app.speedup), draft acceptance, memory and CPU over time, expert cache and expert usage (pyqtgraph).

Following pyqtgraph's scrolling-plot example: the worker only emits small Stats objects; they land in
fixed-size ring buffers on the GUI thread, and a 100 ms QTimer redraws by `setData` on existing items.
A chart with nothing to show yet shows a sentence saying what it will show, never empty axes.
Time series break between replies (a NaN point, drawn with connect="finite") so idle gaps are not joined.
"""
from __future__ import annotations

import time

import numpy as np
import psutil
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Slot
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QStackedLayout, QVBoxLayout, QWidget

from app.speedup import MIN_TOKENS, SERVER, SHORT, Reply, baseline, mode_name, verdict
from engine.events import Stats
from engine.metrics import SystemMonitor

HISTORY = 600  # points per series: one minute at the 100 ms tick
HEAT_STEPS = 120  # columns of the per-layer cache hit-rate map
MAX_BARS = 24  # replies shown in the per-reply chart
MODE_COLOURS = {"off": "#9e9e9e", "fixed": "#e6550d", "auto": "#2b8cbe", SERVER: "#8856a7"}
USAGE_UNIT = "share of the layer's expert choices (%)"
HIT_UNIT = "expert-cache hit rate (%)"
MAX_TICKS = 12  # labelled rows or columns of the expert map; more are thinned to every k-th


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

    def gap(self, t: float) -> None:
        """A break in the line: nothing is drawn between the points either side."""
        if self.n and not np.isnan(self.v[(self.n - 1) % self.size]):
            self.push(t, np.nan)

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n <= self.size:
            return self.t[:self.n], self.v[:self.n]
        i = self.n % self.size
        return np.concatenate([self.t[i:], self.t[:i]]), np.concatenate([self.v[i:], self.v[:i]])


class Chart(QWidget):
    """A plot, or until it has data a sentence saying what it will show."""

    def __init__(self, title: str, empty: str, left: str, bottom: str):
        super().__init__()
        self.stack = QStackedLayout(self)
        self.empty = QLabel(f"<b>{title}</b><br>{empty}")
        self.empty.setWordWrap(True)
        self.empty.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty.setAccessibleName(f"{title}: no data")
        self.plot = pg.PlotWidget(title=title)
        self.plot.setAccessibleName(title)
        self.plot.showGrid(x=True, y=True, alpha=0.2)
        self.plot.setLabel("left", left)
        self.plot.setLabel("bottom", bottom)
        for side in ("left", "bottom"):  # no "(x0.001)" rescaling: the axis label's unit is the unit shown
            self.plot.getAxis(side).enableAutoSIPrefix(False)
        self.plot.setMenuEnabled(False)
        self.stack.addWidget(self.empty)
        self.stack.addWidget(self.plot)
        self.setMinimumHeight(170)

    @property
    def has_data(self) -> bool:
        return self.stack.currentWidget() is self.plot

    def show_data(self, on: bool = True) -> None:
        self.stack.setCurrentWidget(self.plot if on else self.empty)


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
        self.tried: list[int] = []
        self.accepted: list[int] = []
        self.replies: list[Reply] = []  # of every engine this session; the chart shows one engine's
        self.mode = "off"
        self.engine = ""  # the engine and model of the reply under way (app.session.ModelInfo.engine)
        self.dark = False
        self.dirty = False
        self.last: Stats | None = None

        lay = QVBoxLayout(self)
        self.summary = QLabel("No reply yet. Send a message: each reply's speed appears here, with and without MTP.")
        self.summary.setAccessibleName("Metrics summary")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)

        self.c_replies = Chart("Decode speed per reply", "Each reply becomes a bar here, coloured by its MTP "
                               "setting; turn MTP off in Settings for one reply to get the comparison.",
                               "decode (tokens/s)", "reply")
        self.p_replies = self.c_replies.plot
        self.engine_box = QComboBox()  # replies of different engines are never drawn, or compared, together
        self.engine_box.setAccessibleName("Replies of")
        self.engine_box.currentTextChanged.connect(lambda _t: setattr(self, "dirty", True))
        # A long engine name must not widen the panel (the chart's title would, so it is not there).
        self.engine_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.engine_box.setMinimumContentsLength(16)
        self.engine_row = QWidget()
        er = QHBoxLayout(self.engine_row)
        er.setContentsMargins(0, 0, 0, 0)
        er.addWidget(QLabel("Replies of"))
        er.addWidget(self.engine_box, 1)
        self.engine_row.setVisible(False)
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.7)
        self.p_replies.addItem(self.bars)
        self.ref_line = pg.InfiniteLine(angle=0, pen=pg.mkPen("#555", width=2, style=Qt.PenStyle.DashLine))
        self.ref_line.setVisible(False)
        self.p_replies.addItem(self.ref_line)
        self.bar_labels: list[pg.TextItem] = []
        self.replies_legend = QLabel()
        self.replies_legend.setWordWrap(True)
        self._legend()
        lay.addWidget(self.engine_row)
        lay.addWidget(self.c_replies)
        lay.addWidget(self.replies_legend)

        self.c_speed = Chart("Decode speed over time", "Appears while a reply is generated.", "tokens/s",
                             "time since start (s)")
        self.p_speed = self.c_speed.plot
        self.l_speed = self.p_speed.plot(pen=pg.mkPen("#2b8cbe", width=2), connect="finite", symbol="o",
                                         symbolSize=4, symbolBrush="#2b8cbe", symbolPen=None)
        self.c_acc = Chart("Draft acceptance", "Appears while a reply is generated with MTP on.",
                           "accepted drafts (%)", "time since start (s)")
        self.l_acc = self.c_acc.plot.plot(pen=pg.mkPen("#31a354", width=2), connect="finite", symbol="o",
                                          symbolSize=4, symbolBrush="#31a354", symbolPen=None)
        self.c_acc.plot.setYRange(0, 100)
        self.c_len = Chart("Tokens per verify step", "Appears while a reply is generated with MTP on.",
                           "tokens per step", "time since start (s)")
        self.l_len = self.c_len.plot.plot(pen=pg.mkPen("#e6550d", width=2), connect="finite", symbol="o",
                                          symbolSize=4, symbolBrush="#e6550d", symbolPen=None)
        self.c_depth = Chart("Acceptance by draft depth", "Appears once drafts have been tried.", "accepted (%)",
                             "draft depth")
        self.depth_bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush="#31a354")
        self.c_depth.plot.addItem(self.depth_bars)
        self.c_depth.plot.setYRange(0, 100)
        self.c_mem = Chart("VRAM used" if self.monitor.has_gpu else "Process memory", "Sampling…", "GiB",
                           "time since start (s)")
        self.l_mem = self.c_mem.plot.plot(pen=pg.mkPen("#756bb1", width=2))
        self.cores = psutil.cpu_count() or 1
        self.c_cpu = Chart("CPU use", "Sampling…", "CPU, all cores (%)", "time since start (s)")
        self.c_cpu.plot.setYRange(0, 100)
        self.l_cpu = self.c_cpu.plot.plot(pen=pg.mkPen("#8c6d31", width=2))
        self.c_cache = Chart("Expert cache", "Shown when a GPU expert cache reports.", "fraction",
                             "time since start (s)")
        self.c_cache.plot.addLegend(offset=(5, 5))
        self.l_hit = self.c_cache.plot.plot(pen=pg.mkPen("#d62728", width=2), name="hit rate")
        self.l_occ = self.c_cache.plot.plot(pen=pg.mkPen("#9467bd", width=1), name="occupancy")
        self.c_cache.plot.setYRange(0, 1)
        self.c_cache.setVisible(False)
        self.c_usage = Chart("Expert usage per layer", "Appears after a reply from a mixture-of-experts model: "
                             "how often each expert was chosen, per layer.", "layer", "expert")
        self.c_usage.setMinimumHeight(260)  # a row per layer, and the colour bar's own axis below the title
        self.heat = pg.ImageItem()
        self.c_usage.plot.addItem(self.heat)
        self.heat_bar = pg.ColorBarItem(values=(0, 100), colorMap=pg.colormap.get("viridis"), interactive=False,
                                        label=USAGE_UNIT, colorMapMenu=False)
        self.heat_bar.setImageItem(self.heat, insert_in=self.c_usage.plot.getPlotItem())
        self.heat_rows: list[str] = []  # each row of the map: the model's layer number, or "MTP" for its MTP block
        self.model_layers = 0  # the model's layers, without its MTP block (0: not known, every row by number)
        self.usage_layers: list[int] = []
        self.cache_layers: list[int] = []
        self.charts = (self.c_replies, self.c_speed, self.c_acc, self.c_len, self.c_depth, self.c_mem, self.c_cpu,
                       self.c_cache, self.c_usage)
        self.depth_caption = QLabel("Depth d: the share of d-th drafted tokens the model accepted (a chain stops at "
                                    "the first rejection). Hover over the bars for the counts.")
        self.depth_caption.setWordWrap(True)
        for c in self.charts[1:]:
            lay.addWidget(c)
            if c is self.c_depth:
                lay.addWidget(self.depth_caption)
        lay.addStretch(1)

        self.timer = QTimer(self)
        self.timer.setInterval(100)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()

    def _legend(self) -> None:
        sw = '<span style="color:{c}">■</span> {t}'
        parts = [sw.format(c=MODE_COLOURS["off"], t="MTP off"), sw.format(c=MODE_COLOURS["fixed"], t="fixed depth K"),
                 sw.format(c=MODE_COLOURS["auto"], t="auto depth"),
                 sw.format(c=MODE_COLOURS[SERVER], t="the server's own MTP (remote)"),
                 "– – average of this model's MTP-off replies", "×N on a bar: its speed against that average "
                 f"(replies of {MIN_TOKENS}+ tokens that drafted)", f"faded, '{SHORT}': under {MIN_TOKENS} tokens, too "
                 "short to compare"]
        self.replies_legend.setText(" &nbsp; ".join(parts))

    def set_dark(self, dark: bool) -> None:
        """Chart colours for the app's theme (pyqtgraph draws its own background and axes)."""
        self.dark = dark
        bg, fg = ("#1e1f22", "#d0d0d0") if dark else ("#ffffff", "#404040")
        for c in self.charts:
            p = c.plot
            p.setBackground(bg)
            p.plotItem.titleLabel.setText(p.plotItem.titleLabel.text, color=fg)
        for ax in [c.plot.getAxis(side) for c in self.charts for side in ("left", "bottom")] + [
                self.heat_bar.axis, self.heat_bar.getAxis("left")]:
            ax.setPen(fg)
            ax.setTextPen(fg)
            ax.setLabel(ax.labelText, color=fg)
        self.ref_line.setPen(pg.mkPen("#bbb" if dark else "#555", width=2, style=Qt.PenStyle.DashLine))
        self.dirty = True

    # -- input ---------------------------------------------------------------------------------------
    def begin_reply(self, mode: str, engine: str) -> None:
        """A reply starts with MTP `mode` ("off", "auto", "K=n", or SERVER) on `engine`: the time series break
        here."""
        self.mode, self.engine = mode, engine
        t = time.monotonic() - self.t0
        for r in (self.tok_s, self.acceptance, self.mean_len):
            r.gap(t)

    @Slot(object)
    def push_stats(self, st: Stats) -> None:
        """Called on the GUI thread (queued from the worker): store only; drawing happens on the timer."""
        t = time.monotonic() - self.t0
        if st.decode_tok_s > 0:
            self.tok_s.push(t, st.decode_tok_s)
        sp = st.speculative
        if sp:
            if sp.drafted or sp.acceptance:  # a remote server may give the rate alone (SGLang's gauge)
                self.acceptance.push(t, 100 * sp.acceptance)
            if sp.verify_steps or sp.mean_accepted_length:
                self.mean_len.push(t, sp.mean_accepted_length)
            self.tried, self.accepted = list(sp.tried_by_depth), list(sp.accepted_by_depth)
        if st.expert_cache:
            self._push_cache(t, st.expert_cache)
        elif st.expert_usage:
            self.usage_layers = sorted(st.expert_usage)
            self.usage = np.array([st.expert_usage[i] for i in self.usage_layers], dtype=np.float64)
        if st.final and st.decode_tok_s > 0:
            mode = self.mode if st.mtp or self.mode == SERVER else "off"  # a model without an MTP head: off
            self.replies.append(Reply(st.decode_tok_s, mode, st.generated_tokens, sp.drafted if sp else None,
                                      self.engine))
            if self.engine_box.findText(self.engine) < 0:
                self.engine_box.addItem(self.engine)
            self.engine_box.setCurrentText(self.engine)
            self.engine_box.setEnabled(self.engine_box.count() > 1)
            self.engine_row.setVisible(True)
        self.last = st
        self.dirty = True

    def _push_cache(self, t: float, caches: dict[int, dict]) -> None:
        """Hit rate since the previous Stats (overall and per layer), and how full the caches are."""
        layers = self.cache_layers = sorted(caches)
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

    # -- drawing -------------------------------------------------------------------------------------
    @Slot()
    def refresh(self) -> None:
        s = self.monitor.sample()
        t = time.monotonic() - self.t0
        if s.vram_used_bytes is not None:
            self.mem.push(t, s.vram_used_bytes / 2**30)
        else:
            self.mem.push(t, s.rss_bytes / 2**30)
        # psutil counts 100 per core and jitters over a 100 ms window: shown as a share of all cores, 0-100.
        self.cpu.push(t, min(100.0, s.cpu_percent / self.cores))
        self.l_mem.setData(*self.mem.data())
        self.l_cpu.setData(*self.cpu.data())
        self.c_mem.show_data(self.mem.n >= 2)
        self.c_cpu.show_data(self.cpu.n >= 2)
        if not self.dirty:
            return
        self.dirty = False
        self._draw_replies()
        for chart, line, ring in ((self.c_speed, self.l_speed, self.tok_s), (self.c_acc, self.l_acc, self.acceptance),
                                  (self.c_len, self.l_len, self.mean_len)):
            line.setData(*ring.data())
            finite = ring.data()[1][np.isfinite(ring.data()[1])]
            chart.show_data(finite.size > 0)
            if finite.size and chart is not self.c_acc:  # speeds and lengths from zero, so bars of change read true
                chart.plot.setYRange(0, float(finite.max()) * 1.15 or 1.0)
        self._draw_depth()
        if self.layer_hits is not None:  # GPU expert cache: per-layer hit rate over time
            if self.c_cache.isHidden():
                self.c_cache.setVisible(True)
                self.c_usage.plot.setTitle("Expert-cache hit rate per layer (over time)")
                self.c_usage.plot.setLabel("bottom", "update")
            self.c_cache.show_data()
            self.l_hit.setData(*self.hit_rate.data())
            self.l_occ.setData(*self.occupancy.data())
            n = self.layer_hits_n
            ring = self.layer_hits if n <= HEAT_STEPS else np.roll(self.layer_hits, -(n % HEAT_STEPS), axis=0)
            self._draw_heat(100 * np.nan_to_num(ring[:min(n, HEAT_STEPS)], nan=0.0), self.cache_layers, 100.0,
                            HIT_UNIT, experts=False)
        elif self.usage is not None and self.usage.sum() > 0:
            rows = 100 * self.usage / np.maximum(self.usage.sum(axis=1, keepdims=True), 1.0)
            top = float(np.ceil(rows.max() / 5) * 5) or 5.0  # the scale's top: the largest share, up to a 5
            self._draw_heat(rows.T, self.usage_layers, top, USAGE_UNIT, experts=True)
        self._summarise()

    def _draw_replies(self) -> None:
        engine = self.engine_box.currentText()
        mine = [r for r in self.replies if r.engine == engine]
        shown = mine[-MAX_BARS:]
        first = len(mine) - len(shown) + 1
        base = baseline(self.replies, engine)
        for item in self.bar_labels:
            self.p_replies.removeItem(item)
        self.bar_labels = []
        if not shown:
            self.c_replies.show_data(False)
            return
        x = np.arange(first, first + len(shown))
        verdicts = [verdict(r, self.replies) for r in shown]
        brushes = [pg.mkColor(MODE_COLOURS[r.kind]) for r in shown]
        for b, v in zip(brushes, verdicts):
            b.setAlpha(90 if v.label == SHORT else 255)  # too short to compare: faded
        self.bars.setOpts(x=x, height=[r.tok_s for r in shown], brushes=brushes, pens=[pg.mkPen(None)] * len(shown))
        fg = "#d0d0d0" if self.dark else "#303030"
        for xi, r, v in zip(x, shown, verdicts):
            name = "server" if r.mode == SERVER else r.mode
            text = v.label if v.label == SHORT else f"{v.label}\n{name}" if v.label else name  # short: its colour says
            label = pg.TextItem(text, color=fg, anchor=(0.5, 1.0))
            label.setToolTip(f"{r.tok_s:.1f} tokens/s, {r.tokens} tokens, {mode_name(r.mode)}: {v.sentence}")
            label.setPos(float(xi), r.tok_s)
            self.p_replies.addItem(label)
            self.bar_labels.append(label)
        self.ref_line.setVisible(base is not None)
        if base is not None:
            self.ref_line.setPos(base.tok_s)
        top = max([r.tok_s for r in shown] + [base.tok_s if base else 0.0])
        self.p_replies.setYRange(0, top * 1.5)  # room for two lines of label over the tallest bar
        self.p_replies.setXRange(first - 0.6, first + max(len(shown), 4) - 0.4)
        self.p_replies.getAxis("bottom").setTicks([[(float(i), str(i)) for i in x]])  # replies are whole numbers
        self.c_replies.show_data()

    def _draw_heat(self, image: np.ndarray, layers: list[int], top: float, unit: str, experts: bool) -> None:
        """The expert map: one row per layer the engine reported, labelled with the model's layer number or "MTP"
        (the axis shows those rows and no more), its colours read on the bar beside it in `unit` from 0 to `top`.
        `experts`: the columns are experts (labelled by number), else the cache's updates (plain axis)."""
        plot = self.c_usage.plot
        self.heat.setImage(image, levels=(0.0, top))
        self.heat_bar.setLevels((0.0, top))
        self.heat_bar.getAxis("left").setLabel(unit)  # the bar's label, between it and the map
        n = self.model_layers
        self.heat_rows = [str(il) if not n or il < n else "MTP" for il in layers]  # the MTP block routes too
        plot.setYRange(0, len(layers), padding=0)
        plot.getAxis("left").setTicks([_ticks(self.heat_rows)])
        plot.setXRange(0, image.shape[0], padding=0)
        plot.getAxis("bottom").setTicks([_ticks([str(e) for e in range(image.shape[0])])] if experts else None)
        self.c_usage.show_data()

    def _draw_depth(self) -> None:
        depths = [i for i, n in enumerate(self.tried) if n]
        if not depths:
            self.c_depth.show_data(False)
            return
        frac = [100 * self.accepted[i] / self.tried[i] for i in depths]
        self.depth_bars.setOpts(x=np.array(depths) + 1, height=frac)
        self.c_depth.plot.setXRange(0.5, max(depths) + 1.5)
        self.c_depth.plot.setToolTip("<br>".join(
            f"depth {i + 1}: {self.accepted[i]} of {self.tried[i]} drafted tokens accepted ({f:.0f}%)"
            for i, f in zip(depths, frac)))
        self.c_depth.show_data()

    def _summarise(self) -> None:
        st = self.last
        if st is None:
            return
        parts = [f"{st.decode_tok_s:.1f} tokens/s", f"first token after {st.ttft_s * 1000:.0f} ms",
                 f"{st.generated_tokens} tokens"]
        if st.speculative and st.speculative.drafted:
            sp = st.speculative
            parts.append(f"{sp.accepted} of {sp.drafted} drafted tokens accepted")
        if st.speculative and st.speculative.source != "engine":  # a remote engine: say where figures came from
            sp = st.speculative
            scope = "server-wide: other clients count too" if sp.server_wide else "per request"
            parts.append(f"speed timed here; acceptance from the server's {sp.source} ({scope})")
        text = " · ".join(parts)
        if self.replies:
            r = self.replies[-1]
            text = f"<b>Last reply ({mode_name(r.mode)}, {r.engine}): {verdict(r, self.replies).sentence}.</b><br>{text}"
        self.summary.setText(text)


def _ticks(names: list[str]) -> list[tuple[float, str]]:
    """A tick at the middle of each pixel row (or column) i, named names[i]; at most about MAX_TICKS of them."""
    step = -(-len(names) // MAX_TICKS) or 1
    return [(i + 0.5, n) for i, n in enumerate(names) if i % step == 0]
