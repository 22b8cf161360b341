"""User settings: a dataclass persisted with QSettings, mapped onto the engine's configs.

Model-level settings (context length, device, GPU layers, experts on CPU, expert cache) apply on the next
load; generation settings (MTP, draft depth, sampling, system prompt) apply to the next reply. Bad stored
values fall back to defaults instead of breaking start-up. The six sampling controls fold under one "Sampling"
row that says what they are set to, so the form (and "Serve on localhost" under it) fits a 1366×768 screen.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from PySide6.QtCore import QSettings, Signal
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QHBoxLayout, QLabel,
                               QPlainTextEdit, QSizePolicy, QSlider, QSpinBox, QToolButton, QWidget)

from engine.errors import InvalidParameterError
from engine.events import EngineConfig, GenerationConfig
from engine.metrics import cuda_status
from engine.sampling import SamplingConfig
from engine.speculative import default_dir
from engine.validate import MAX_DRAFT, parse_draft

MAX_RECENT = 10


@dataclass
class AppSettings:
    mtp: bool = True
    draft: str = "auto"  # "auto" or a depth's digits, as the draft combo box shows it (read by parse_draft)
    temperature: float = 0.0  # greedy: the most faithful answers, and the best draft acceptance
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int = -1  # −1: a new random seed for every reply
    context: int = 4096
    max_tokens: int = 1024
    system_prompt: str = ""
    theme: str = "system"  # system | light | dark
    device: str = "cpu"  # cpu | cuda
    gpu_layers: int = -1  # −1: auto (as many as fit in free VRAM)
    cpu_moe: bool = False
    expert_cache: str = "auto"  # auto | N experts per layer | N MiB
    recent_models: list[str] = field(default_factory=list)

    def engine_config(self, cuda_state: tuple[bool, str] | None = None) -> EngineConfig:
        """The engine config these settings ask for; on the CPU where CUDA is not usable (`cuda_state`: what
        engine.metrics.cuda_status says, asked now when not given)."""
        cuda = self.device == "cuda" and (cuda_state or cuda_status())[0]
        memory = default_dir()  # auto draft depth starts a model's next session from what it learned
        if not cuda:
            return EngineConfig(n_ctx=self.context, auto_memory_dir=memory)
        return EngineConfig(n_ctx=self.context, device="cuda", gpu_layers=None if self.gpu_layers < 0 else self.gpu_layers,
                            cpu_moe=self.cpu_moe, expert_cache=None if self.expert_cache == "auto" else self.expert_cache,
                            auto_memory_dir=memory)

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(
            max_tokens=self.max_tokens, mtp=self.mtp, draft=parse_draft(self.draft),
            sampling=SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                    min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                                    seed=None if self.seed < 0 else self.seed),
        )

    def sampling_summary(self) -> str:
        """The sampling settings in a few words, for the folded Sampling row."""
        parts = ["greedy" if self.temperature == 0 else f"temperature {self.temperature:g}"]
        parts += [f"{name} {v:g}" for name, v, off in (("top-k", self.top_k, 0), ("top-p", self.top_p, 1.0),
                                                       ("min-p", self.min_p, 0.0),
                                                       ("repetition penalty", self.repeat_penalty, 1.0))
                  if v != off]
        parts.append("random seed" if self.seed < 0 else f"seed {self.seed}")
        return ", ".join(parts)

    def add_recent(self, path: str) -> None:
        self.recent_models = ([path] + [p for p in self.recent_models if p != path])[:MAX_RECENT]


def load_settings(qs: QSettings) -> AppSettings:
    s = AppSettings()
    values = {}
    for f in fields(AppSettings):
        if not qs.contains(f.name):
            continue
        raw = qs.value(f.name)
        default = getattr(s, f.name)
        try:
            if isinstance(default, bool):
                values[f.name] = raw in (True, "true", "1", 1)
            elif isinstance(default, list):
                values[f.name] = [str(x) for x in (raw if isinstance(raw, list) else [raw] if raw else [])]
            else:
                values[f.name] = type(default)(raw)
        except (TypeError, ValueError):
            continue  # a corrupted value: keep the default
    out = replace(s, **values)
    try:
        parse_draft(out.draft)
    except InvalidParameterError:
        out.draft = "auto"
    if out.theme not in ("system", "light", "dark"):
        out.theme = "system"
    if out.device not in ("cpu", "cuda"):
        out.device = "cpu"
    return out


def save_settings(qs: QSettings, s: AppSettings) -> None:
    for k, v in asdict(s).items():
        qs.setValue(k, v)
    qs.sync()


class SettingsPanel(QWidget):
    """The settings dock's form. Emits `changed` with a new AppSettings whenever a control changes."""

    changed = Signal(object)

    def __init__(self, settings: AppSettings, parent: QWidget | None = None,
                 cuda_state: tuple[bool, str] | None = None):
        """`cuda_state`: whether CUDA is usable and why not (engine.metrics.cuda_status, asked when not given)."""
        super().__init__(parent)
        self.settings = settings
        self.form = form = QFormLayout(self)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)  # a narrow panel puts fields under labels
        # Short texts: a checkbox wider than the field column puts it on a line of its own in a narrow panel.
        self.mtp = QCheckBox("Speculative decoding")
        self.mtp.setToolTip("Draft tokens with the model's MTP head and verify them in one pass")
        self.draft = QComboBox()
        self.draft.addItems(["auto"] + [str(i) for i in range(1, MAX_DRAFT + 1)])
        self.temperature = _dspin(0, 2, 0.05)
        self.top_k = _ispin(0, 1000)
        self.top_p = _dspin(0.01, 1, 0.01)
        self.min_p = _dspin(0, 1, 0.01)
        self.repeat_penalty = _dspin(0.5, 2, 0.01)
        self.seed = _ispin(-1, 2**31 - 1)
        self.context = _ispin(256, 262144, 256)
        self.max_tokens = _ispin(1, 32768)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setMaximumHeight(72)
        self.theme = QComboBox()
        self.theme.addItems(["system", "light", "dark"])
        # GPU placement (next load). Without CUDA the controls stay visible but disabled, with the reason.
        self.device = QComboBox()
        self.device.addItems(["cpu", "cuda"])
        self.gpu_layers = QSlider(Qt.Orientation.Horizontal)
        self.gpu_layers.setRange(-1, 128)
        self.gpu_layers_label = QLabel()
        gl = QWidget()
        gl.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)  # no row takes spare height
        gl_lay = QHBoxLayout(gl)
        gl_lay.setContentsMargins(0, 0, 0, 0)
        gl_lay.addWidget(self.gpu_layers)
        gl_lay.addWidget(self.gpu_layers_label)
        self.cpu_moe = QCheckBox("Keep on the CPU")
        self.cpu_moe.setToolTip("Keep the routed experts' weights on the CPU (next load)")
        self.expert_cache = QComboBox()
        self.expert_cache.setEditable(True)
        self.expert_cache.addItems(["auto", "0", "16", "32", "64", "128", "1024MiB", "4096MiB"])
        ok, why = cuda_state or cuda_status()
        self.gpu_reason = QLabel(why if ok else f"GPU controls disabled: {why}")
        self.gpu_reason.setWordWrap(True)
        self.gpu_reason.setAccessibleName("GPU status")
        for w in (self.device, self.gpu_layers, self.cpu_moe, self.expert_cache):
            w.setEnabled(ok)
        self.sampling = QToolButton()  # folds the sampling rows; beside it, what they are set to
        self.sampling.setCheckable(True)
        self.sampling.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.sampling.setToolTip("Temperature, top-k, top-p, min-p, repetition penalty and seed")
        self.sampling_label = QLabel()
        self.sampling_label.setWordWrap(True)  # a long summary wraps instead of widening the panel
        samp = QWidget()
        samp.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        samp_lay = QHBoxLayout(samp)
        samp_lay.setContentsMargins(0, 0, 0, 0)
        samp_lay.addWidget(self.sampling)
        samp_lay.addWidget(self.sampling_label, 1)
        self.sampling_rows = (self.temperature, self.top_k, self.top_p, self.min_p, self.repeat_penalty, self.seed)
        rows = [("MTP", self.mtp, "MTP speculative decoding"), ("Draft depth", self.draft, "Draft depth"),
                ("Sampling", samp, "Sampling settings"),
                ("Temperature", self.temperature, "Temperature (0 = greedy)"), ("Top-k", self.top_k, "Top-k"),
                ("Top-p", self.top_p, "Top-p"), ("Min-p", self.min_p, "Min-p"),
                ("Repetition penalty", self.repeat_penalty, "Repetition penalty"),
                ("Seed (−1 random)", self.seed, "Seed"), ("Context (next load)", self.context, "Context length"),
                ("Max reply tokens", self.max_tokens, "Maximum reply tokens"),
                ("System prompt", self.system_prompt, "System prompt"), ("Theme", self.theme, "Theme"),
                ("Device (next load)", self.device, "Compute device"), ("GPU layers", gl, "GPU layers"),
                ("Routed experts", self.cpu_moe, "Experts on CPU"), ("Expert cache", self.expert_cache,
                                                              "Expert cache size (experts per layer or MiB)"),
                ("", self.gpu_reason, "GPU status")]
        self.remote_note = QLabel()  # a remote engine: what its server decides, not these settings
        self.remote_note.setWordWrap(True)
        rows.insert(0, ("", self.remote_note, "Remote engine"))
        for label, w, name in rows:
            w.setAccessibleName(name)
            form.addRow(label, w)
        self.local_only = (self.context, self.device, gl, self.cpu_moe, self.expert_cache, self.gpu_reason)
        form.setRowVisible(self.remote_note, False)
        self._set(settings)
        self.sampling.toggled.connect(self.show_sampling)
        self.show_sampling(False)
        for w in (self.temperature, self.top_p, self.min_p, self.repeat_penalty):
            w.valueChanged.connect(self._emit)
        for w in (self.top_k, self.seed, self.context, self.max_tokens):
            w.valueChanged.connect(self._emit)
        self.mtp.toggled.connect(self._emit)
        self.draft.currentTextChanged.connect(self._emit)
        self.theme.currentTextChanged.connect(self._emit)
        self.system_prompt.textChanged.connect(self._emit)
        self.device.currentTextChanged.connect(self._emit)
        self.gpu_layers.valueChanged.connect(self._emit)
        self.cpu_moe.toggled.connect(self._emit)
        self.expert_cache.currentTextChanged.connect(self._emit)

    def show_engine(self, remote: dict | None) -> None:
        """Hide what does not apply to a remote engine (context, device, GPU layers, experts); MTP and depth stay
        only where its server takes them per request."""
        for w in self.local_only:
            self.form.setRowVisible(w, remote is None)
        per_request = remote is None or remote["mtp_per_request"]
        self.form.setRowVisible(self.mtp, per_request)
        self.form.setRowVisible(self.draft, per_request)
        self.form.setRowVisible(self.remote_note, remote is not None)
        if remote is not None:
            self.remote_note.setText(
                f"Remote {remote['server']} engine: context, device and memory are the server's. "
                + ("MTP and draft depth below are sent with each request." if per_request else
                   "MTP and draft depth are the server's own setting (it does not take them per request)."))

    def show_sampling(self, on: bool) -> None:
        """Unfold (or fold) the sampling rows; folded, the button says what they are set to."""
        for w in self.sampling_rows:
            self.form.setRowVisible(w, on)
        self.sampling.setChecked(on)
        self.sampling.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.sampling.setText("Hide" if on else "Show")
        self._sampling_text()

    def _sampling_text(self) -> None:
        self.sampling_label.setText(self.settings.sampling_summary())

    def _set(self, s: AppSettings) -> None:
        self.mtp.setChecked(s.mtp)
        self.draft.setCurrentText(s.draft)
        self.temperature.setValue(s.temperature)
        self.top_k.setValue(s.top_k)
        self.top_p.setValue(s.top_p)
        self.min_p.setValue(s.min_p)
        self.repeat_penalty.setValue(s.repeat_penalty)
        self.seed.setValue(s.seed)
        self.context.setValue(s.context)
        self.max_tokens.setValue(s.max_tokens)
        self.system_prompt.setPlainText(s.system_prompt)
        self.theme.setCurrentText(s.theme)
        self.device.setCurrentText(s.device)
        self.gpu_layers.setValue(s.gpu_layers)
        self._gpu_label(s.gpu_layers)
        self.cpu_moe.setChecked(s.cpu_moe)
        self.expert_cache.setCurrentText(s.expert_cache)

    def _gpu_label(self, v: int) -> None:
        self.gpu_layers_label.setText("auto" if v < 0 else str(v))

    def _emit(self, *_: object) -> None:
        self.settings = replace(
            self.settings, mtp=self.mtp.isChecked(), draft=self.draft.currentText(),
            temperature=self.temperature.value(), top_k=self.top_k.value(), top_p=self.top_p.value(),
            min_p=self.min_p.value(), repeat_penalty=self.repeat_penalty.value(), seed=self.seed.value(),
            context=self.context.value(), max_tokens=self.max_tokens.value(),
            system_prompt=self.system_prompt.toPlainText(), theme=self.theme.currentText(),
            device=self.device.currentText(), gpu_layers=self.gpu_layers.value(), cpu_moe=self.cpu_moe.isChecked(),
            expert_cache=self.expert_cache.currentText().strip() or "auto",
        )
        self._gpu_label(self.settings.gpu_layers)
        self._sampling_text()
        self.changed.emit(self.settings)


def _dspin(lo: float, hi: float, step: float) -> QDoubleSpinBox:
    w = QDoubleSpinBox()
    w.setRange(lo, hi)
    w.setSingleStep(step)
    w.setDecimals(2)
    return w


def _ispin(lo: int, hi: int, step: int = 1) -> QSpinBox:
    w = QSpinBox()
    w.setRange(lo, hi)
    w.setSingleStep(step)
    return w
