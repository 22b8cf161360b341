"""The open conversation's own settings, above the global defaults in the Settings tab: a system prompt (with saved
presets), temperature, top-p, top-k, MTP and its draft depth. A conversation without its own follows the defaults
and the panel folds to one line saying so; "Own settings" gives it a copy of the defaults to change, stored with
the conversation (app.session.ChatSession.set_own) and used for its replies.
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QPlainTextEdit,
                               QPushButton, QWidget)

from app.session import ChatSession, ConversationSettings
from app.settings import AppSettings, _dspin, _ispin
from engine.validate import MAX_DRAFT

DEFAULTS = "Uses the default settings below."
OWN = "Has its own settings (these)."


class ConversationPanel(QGroupBox):
    """Shows and edits ChatSession.own; `changed` once the open conversation's settings changed."""

    changed = Signal()

    def __init__(self, session: ChatSession, parent: QWidget | None = None):
        super().__init__("This conversation", parent)
        self.session = session
        self.defaults = AppSettings()
        self.form = form = QFormLayout(self)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.WrapLongRows)
        self.own = QCheckBox("Own settings")
        self.own.setAccessibleName("This conversation has its own settings")
        self.state = QLabel(DEFAULTS)  # one line: a wrapped label beside the box is cut at this width
        self.state.setAccessibleName("This conversation's settings")
        top = QHBoxLayout()
        top.addWidget(self.state, 1)
        top.addWidget(self.own)
        form.addRow(top)
        self.preset = QComboBox()
        self.preset.setEditable(True)  # a new name is typed here, then saved
        self.preset.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.preset.lineEdit().setPlaceholderText("Preset name")
        self.save_preset_btn, self.delete_preset_btn = QPushButton("Save"), QPushButton("Delete")
        self.save_preset_btn.setToolTip("Save this system prompt under the preset name")
        presets = QWidget()
        row = QHBoxLayout(presets)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.preset, 1)
        row.addWidget(self.save_preset_btn)
        row.addWidget(self.delete_preset_btn)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setMaximumHeight(72)
        self.temperature, self.top_p, self.top_k = _dspin(0, 2, 0.05), _dspin(0.01, 1, 0.01), _ispin(0, 1000)
        self.mtp = QCheckBox("Speculative decoding")
        self.draft = QComboBox()
        self.draft.addItems(["auto"] + [str(i) for i in range(1, MAX_DRAFT + 1)])
        self.rows = ((presets, "Preset", "System prompt preset"), (self.system_prompt, "System prompt",
                                                                    "This conversation's system prompt"),
                     (self.temperature, "Temperature", "This conversation's temperature"),
                     (self.top_p, "Top-p", "This conversation's top-p"), (self.top_k, "Top-k",
                                                                         "This conversation's top-k"),
                     (self.mtp, "MTP", "This conversation's MTP"), (self.draft, "Draft depth",
                                                                    "This conversation's draft depth"))
        for w, label, name in self.rows:
            w.setAccessibleName(name)
            form.addRow(label, w)
        self._fill_presets()
        self.show_settings(self.defaults)
        self.own.toggled.connect(self._own_toggled)
        for sig in (self.system_prompt.textChanged, self.temperature.valueChanged, self.top_p.valueChanged,
                    self.top_k.valueChanged, self.mtp.toggled, self.draft.currentTextChanged):
            sig.connect(self._edited)
        self.preset.currentIndexChanged.connect(self._use_preset)
        self.save_preset_btn.clicked.connect(self.save_preset)
        self.delete_preset_btn.clicked.connect(self.delete_preset)

    def show_settings(self, defaults: AppSettings) -> None:
        """Show the open conversation's settings (its own, or `defaults`, folded to the line that says so)."""
        self.defaults = defaults
        own = self.session.own
        values = own or ConversationSettings.of(defaults)
        widgets = (self.own, self.system_prompt, self.temperature, self.top_p, self.top_k, self.mtp, self.draft)
        for w in widgets:
            w.blockSignals(True)
        self.own.setChecked(own is not None)
        self.system_prompt.setPlainText(values.system_prompt)
        self.temperature.setValue(values.temperature)
        self.top_p.setValue(values.top_p)
        self.top_k.setValue(values.top_k)
        self.mtp.setChecked(values.mtp)
        self.draft.setCurrentText(values.draft)
        for w in widgets:
            w.blockSignals(False)
        self.state.setText(OWN if own is not None else DEFAULTS)
        for w, _, _ in self.rows:
            self.form.setRowVisible(w, own is not None)

    def values(self) -> ConversationSettings:
        return ConversationSettings(self.system_prompt.toPlainText(), self.temperature.value(), self.top_p.value(),
                                    self.top_k.value(), self.mtp.isChecked(), self.draft.currentText())

    def _own_toggled(self, on: bool) -> None:
        self.session.set_own(ConversationSettings.of(self.defaults) if on else None)
        self.show_settings(self.defaults)
        self.changed.emit()

    def _edited(self, *_: object) -> None:
        if self.own.isChecked() and self.session.set_own(self.values()):
            self.changed.emit()

    def _fill_presets(self, current: str = "") -> None:
        self.preset.blockSignals(True)
        self.preset.clear()
        self.preset.addItems(list(self.session.presets()))
        self.preset.setCurrentIndex(self.preset.findText(current))
        self.preset.setEditText(current)
        self.preset.blockSignals(False)

    def _use_preset(self, index: int) -> None:
        text = self.session.presets().get(self.preset.itemText(index)) if index >= 0 else None
        if text is not None:
            self.system_prompt.setPlainText(text)  # _edited stores it

    def save_preset(self) -> None:
        name = self.preset.currentText().strip()
        if name and self.session.save_preset(name, self.system_prompt.toPlainText()):
            self._fill_presets(name)

    def delete_preset(self) -> None:
        name = self.preset.currentText().strip()
        if name in self.session.presets() and self.session.delete_preset(name):
            self._fill_presets()
