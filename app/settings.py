"""User settings: a dataclass persisted with QSettings, mapped onto the engine's configs.

Model-level settings (context length) apply on the next load; generation settings (MTP, draft depth,
sampling, system prompt) apply to the next reply. Bad stored values fall back to defaults instead of
breaking start-up.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from PySide6.QtCore import QSettings, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFormLayout, QPlainTextEdit, QSpinBox,
                               QWidget)

from engine.generate import EngineConfig, GenerationConfig
from engine.sampling import SamplingConfig

MAX_RECENT = 10


@dataclass
class AppSettings:
    mtp: bool = True
    draft: str = "auto"  # "auto" or "1".."8"
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
    recent_models: list[str] = field(default_factory=list)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(n_ctx=self.context)

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig(
            max_tokens=self.max_tokens, mtp=self.mtp, draft=None if self.draft == "auto" else int(self.draft),
            sampling=SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                    min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                                    seed=None if self.seed < 0 else self.seed),
        )

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
    if out.draft != "auto" and not (out.draft.isdigit() and 1 <= int(out.draft) <= 8):
        out.draft = "auto"
    if out.theme not in ("system", "light", "dark"):
        out.theme = "system"
    return out


def save_settings(qs: QSettings, s: AppSettings) -> None:
    for k, v in asdict(s).items():
        qs.setValue(k, v)
    qs.sync()


class SettingsPanel(QWidget):
    """The settings dock's form. Emits `changed` with a new AppSettings whenever a control changes."""

    changed = Signal(object)

    def __init__(self, settings: AppSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings
        form = QFormLayout(self)
        self.mtp = QCheckBox("Speculative decoding with the MTP head")
        self.draft = QComboBox()
        self.draft.addItems(["auto"] + [str(i) for i in range(1, 9)])
        self.temperature = _dspin(0, 2, 0.05)
        self.top_k = _ispin(0, 1000)
        self.top_p = _dspin(0.01, 1, 0.01)
        self.min_p = _dspin(0, 1, 0.01)
        self.repeat_penalty = _dspin(0.5, 2, 0.01)
        self.seed = _ispin(-1, 2**31 - 1)
        self.context = _ispin(256, 262144, 256)
        self.max_tokens = _ispin(1, 32768)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setMaximumHeight(90)
        self.theme = QComboBox()
        self.theme.addItems(["system", "light", "dark"])
        rows = [("MTP", self.mtp, "MTP speculative decoding"), ("Draft depth", self.draft, "Draft depth"),
                ("Temperature", self.temperature, "Temperature (0 = greedy)"), ("Top-k", self.top_k, "Top-k"),
                ("Top-p", self.top_p, "Top-p"), ("Min-p", self.min_p, "Min-p"),
                ("Repetition penalty", self.repeat_penalty, "Repetition penalty"),
                ("Seed (−1 random)", self.seed, "Seed"), ("Context (next load)", self.context, "Context length"),
                ("Max reply tokens", self.max_tokens, "Maximum reply tokens"),
                ("System prompt", self.system_prompt, "System prompt"), ("Theme", self.theme, "Theme")]
        for label, w, name in rows:
            w.setAccessibleName(name)
            form.addRow(label, w)
        self._set(settings)
        for w in (self.temperature, self.top_p, self.min_p, self.repeat_penalty):
            w.valueChanged.connect(self._emit)
        for w in (self.top_k, self.seed, self.context, self.max_tokens):
            w.valueChanged.connect(self._emit)
        self.mtp.toggled.connect(self._emit)
        self.draft.currentTextChanged.connect(self._emit)
        self.theme.currentTextChanged.connect(self._emit)
        self.system_prompt.textChanged.connect(self._emit)

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

    def _emit(self, *_: object) -> None:
        self.settings = replace(
            self.settings, mtp=self.mtp.isChecked(), draft=self.draft.currentText(),
            temperature=self.temperature.value(), top_k=self.top_k.value(), top_p=self.top_p.value(),
            min_p=self.min_p.value(), repeat_penalty=self.repeat_penalty.value(), seed=self.seed.value(),
            context=self.context.value(), max_tokens=self.max_tokens.value(),
            system_prompt=self.system_prompt.toPlainText(), theme=self.theme.currentText(),
        )
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
