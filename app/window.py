"""Main window: conversations sidebar, chat, settings dock, metrics dock, model info.

All engine work goes through `EngineController` (its own thread, queued signals); completed messages are
saved to the store as soon as they complete.
"""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSettings, Qt, Signal, Slot
from PySide6.QtGui import QAction, QColor, QGuiApplication, QKeySequence, QPalette, QShortcut
from PySide6.QtWidgets import (QApplication, QDockWidget, QFileDialog, QHBoxLayout, QInputDialog, QLabel,
                               QLineEdit, QListWidget, QListWidgetItem, QMainWindow, QMessageBox, QPlainTextEdit,
                               QProgressBar, QPushButton, QVBoxLayout, QWidget)

from app.charts import MetricsDock
from app.chat_view import ChatView
from app.settings import AppSettings, SettingsPanel, load_settings, save_settings
from app.store import Store, StoreError
from app.worker import EngineController
from engine.chat import Message
from engine.events import Stats


class PromptBox(QPlainTextEdit):
    """Enter sends, Shift+Enter inserts a newline."""

    submitted = Signal()

    def keyPressEvent(self, e) -> None:  # noqa: N802 (Qt override)
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not e.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(e)


class MainWindow(QMainWindow):
    def __init__(self, store: Store, qsettings: QSettings, model: str | None = None):
        super().__init__()
        self.setWindowTitle("Foretell")
        self.setAcceptDrops(True)
        self.resize(1280, 820)
        self.store, self.qs = store, qsettings
        self.settings: AppSettings = load_settings(qsettings)
        self.engine = EngineController(self)
        self.conv_id: int | None = None
        self.generating = False
        self.model_info: dict | None = None
        self.last_stats: Stats | None = None
        self.errors: list[str] = []  # every error shown, for tests and the smoke test
        self._build()
        self._connect()
        self.apply_theme(self.settings.theme)
        self.refresh_conversations()
        self.load_model(model)

    # -- layout --------------------------------------------------------------------------------------
    def _build(self) -> None:
        central = QWidget()
        col = QVBoxLayout(central)
        self.chat = ChatView()
        col.addWidget(self.chat, 1)
        self.prompt = PromptBox()
        self.prompt.setAccessibleName("Message")
        self.prompt.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line)")
        self.prompt.setMaximumHeight(110)
        col.addWidget(self.prompt)
        row = QHBoxLayout()
        self.send_btn = QPushButton("Send")
        self.stop_btn = QPushButton("Stop (Esc)")
        self.regen_btn = QPushButton("Regenerate")
        self.edit_btn = QPushButton("Edit last message")
        for b in (self.send_btn, self.stop_btn, self.regen_btn, self.edit_btn):
            b.setAccessibleName(b.text())
            row.addWidget(b)
        row.addStretch(1)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Model loading progress")
        self.progress.setMaximumWidth(240)
        self.progress.setRange(0, 100)
        row.addWidget(self.progress)
        col.addLayout(row)
        self.setCentralWidget(central)

        side = QWidget()
        sl = QVBoxLayout(side)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations")
        self.search.setAccessibleName("Search conversations")
        self.conv_list = QListWidget()
        self.conv_list.setAccessibleName("Conversations")
        sl.addWidget(self.search)
        sl.addWidget(self.conv_list, 1)
        btns = QHBoxLayout()
        self.new_btn, self.rename_btn, self.delete_btn, self.export_btn = (
            QPushButton(t) for t in ("New", "Rename", "Delete", "Export"))
        for b in (self.new_btn, self.rename_btn, self.delete_btn, self.export_btn):
            b.setAccessibleName(f"{b.text()} conversation")
            btns.addWidget(b)
        sl.addLayout(btns)
        self.sidebar = self._dock("Conversations", side, Qt.DockWidgetArea.LeftDockWidgetArea)

        self.settings_panel = SettingsPanel(self.settings)
        self.settings_dock = self._dock("Settings", self.settings_panel, Qt.DockWidgetArea.RightDockWidgetArea)
        self.metrics = MetricsDock()
        self.metrics_dock = self._dock("Live metrics", self.metrics, Qt.DockWidgetArea.RightDockWidgetArea)
        self.info = QLabel("No model loaded")
        self.info.setAccessibleName("Model information")
        self.info.setWordWrap(True)
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.info_dock = self._dock("Model", self.info, Qt.DockWidgetArea.LeftDockWidgetArea)

        menu = self.menuBar().addMenu("&File")
        self.open_action = QAction("&Open model…", self, shortcut=QKeySequence("Ctrl+O"))
        menu.addAction(self.open_action)
        self.recent_menu = menu.addMenu("Open &recent")
        self._fill_recent()
        new_action = QAction("&New chat", self, shortcut=QKeySequence("Ctrl+N"))
        new_action.triggered.connect(self.new_conversation)
        menu.addAction(new_action)

    def _dock(self, title: str, w: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        d = QDockWidget(title, self)
        d.setObjectName(title)
        d.setWidget(w)
        self.addDockWidget(area, d)
        return d

    def _connect(self) -> None:
        w = self.engine.worker
        w.loadProgress.connect(self.on_load_progress)
        w.loaded.connect(self.on_loaded)
        w.loadFailed.connect(self.on_load_failed)
        w.token.connect(self.chat.append_token)
        w.stats.connect(self.on_stats)
        w.finished.connect(self.on_finished)
        w.failed.connect(self.on_failed)
        self.send_btn.clicked.connect(self.send)
        self.prompt.submitted.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.regen_btn.clicked.connect(self.regenerate)
        self.edit_btn.clicked.connect(self.edit_last)
        self.chat.editRequested.connect(self.edit_message)
        self.new_btn.clicked.connect(self.new_conversation)
        self.rename_btn.clicked.connect(self.rename_conversation)
        self.delete_btn.clicked.connect(self.delete_conversation)
        self.export_btn.clicked.connect(self.export_conversation)
        self.search.textChanged.connect(lambda _t: self.refresh_conversations())
        self.conv_list.currentItemChanged.connect(self._on_select)
        self.settings_panel.changed.connect(self.on_settings)
        self.open_action.triggered.connect(self.open_dialog)
        QShortcut(QKeySequence("Esc"), self, activated=self.stop)
        QShortcut(QKeySequence("Ctrl+,"), self, activated=lambda: self.settings_dock.setVisible(
            not self.settings_dock.isVisible()))
        QShortcut(QKeySequence("Ctrl+Shift+C"), self,
                  activated=lambda: QGuiApplication.clipboard().setText(self.chat.last_reply()))
        self._update_buttons()

    # -- model -------------------------------------------------------------------------------------
    def load_model(self, path: str | None) -> None:
        self.progress.setValue(0)
        self.info.setText(f"Loading {Path(path).name if path else 'the embedded model'}…")
        self.model_info = None
        self._update_buttons()
        self.engine.load(path, self.settings.engine_config())

    @Slot(float, str)
    def on_load_progress(self, frac: float, msg: str) -> None:
        self.progress.setValue(int(frac * 100))
        self.progress.setFormat(msg)

    @Slot(object)
    def on_loaded(self, info: dict) -> None:
        self.model_info = info
        self.settings.add_recent(info["path"])
        save_settings(self.qs, self.settings)
        self._fill_recent()
        mix = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in info["quant_mix"].items())
        moe = f"{info['experts']} experts, top-{info['experts_used']}" if info["experts"] else "dense FFN"
        lines = [f"<b>{info['name']}</b>", f"{info['architecture']} · {info['layers']} layers ({info['layer_pattern']})",
                 f"{info['params_total'] / 1e6:.1f}M parameters, {info['params_active'] / 1e6:.1f}M active · {moe}",
                 f"context {info['context']} (trained {info['context_train']}) · MTP {'yes' if info['mtp'] else 'no'}",
                 f"quant mix: {mix}", f"Placement: {info['placement']}."]
        lines += [f"<i>{n}</i>" for n in info["notices"]]
        self.info.setText("<br>".join(lines))
        self.setWindowTitle(f"Foretell — {info['name']}")
        self._update_buttons()

    @Slot(str)
    def on_load_failed(self, msg: str) -> None:
        self.info.setText("No model loaded")
        self.progress.setValue(0)
        self.show_error("Could not load the model", msg)
        self._update_buttons()

    def open_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load_model(path)

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        for p in self.settings.recent_models:
            act = self.recent_menu.addAction(p)
            act.triggered.connect(lambda _c=False, p=p: self.load_model(p))

    def dragEnterEvent(self, e) -> None:  # noqa: N802
        if any(u.toLocalFile().endswith(".gguf") for u in e.mimeData().urls()):
            e.acceptProposedAction()

    def dropEvent(self, e) -> None:  # noqa: N802
        for u in e.mimeData().urls():
            if u.toLocalFile().endswith(".gguf"):
                self.load_model(u.toLocalFile())
                return

    # -- conversations -----------------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        convs = self._stored(self.store.conversations, self.search.text() or None) or []
        for c in convs:
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            self.conv_list.addItem(item)
            if c.id == self.conv_id:
                self.conv_list.setCurrentItem(item)
        self.conv_list.blockSignals(False)

    def _on_select(self, item: QListWidgetItem | None, _prev: object = None) -> None:
        if item is not None and not self.generating:
            self.open_conversation(int(item.data(Qt.ItemDataRole.UserRole)))

    def open_conversation(self, conv_id: int) -> None:
        self.conv_id = conv_id
        msgs = self._stored(self.store.messages, conv_id) or []
        self.chat.set_messages([(m.role, m.content, _footer(m.stats)) for m in msgs])
        self._update_buttons()

    def new_conversation(self) -> None:
        if self.generating:
            return
        self.conv_id = None
        self.chat.set_messages([])
        self.refresh_conversations()
        self.prompt.setFocus()

    def rename_conversation(self) -> None:
        if self.conv_id is None:
            return
        title, ok = QInputDialog.getText(self, "Rename", "Title:", text=self.store.conversation(self.conv_id).title)
        if ok:
            self._stored(self.store.rename, self.conv_id, title)
            self.refresh_conversations()

    def delete_conversation(self) -> None:
        if self.conv_id is None or self.generating:
            return
        if self._stored(self.store.delete, self.conv_id) is not _FAILED:
            self.new_conversation()

    def export_conversation(self) -> None:
        if self.conv_id is None:
            return
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", "", "Markdown (*.md);;JSON (*.json)")
        if path:
            text = self.store.export_json(self.conv_id) if path.endswith(".json") else self.store.export_markdown(self.conv_id)
            Path(path).write_text(text, encoding="utf-8")

    # -- chatting ----------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.prompt.toPlainText().strip()
        if not text or self.generating or self.model_info is None:
            return
        if self.conv_id is None:
            conv = self._stored(self.store.new_conversation, text[:48].replace("\n", " "))
            if conv is _FAILED:
                return  # the text stays in the input; the error says why
            self.conv_id = conv.id
        if self._stored(self.store.add_message, self.conv_id, "user", text) is _FAILED:
            return
        self.prompt.clear()
        self.chat.add_message("user", text)
        self.refresh_conversations()
        self._run()

    def _run(self) -> None:
        assert self.conv_id is not None
        stored = self._stored(self.store.messages, self.conv_id)
        if stored is _FAILED:
            return
        msgs = [Message(m.role, m.content) for m in stored]
        if self.settings.system_prompt.strip():
            msgs = [Message("system", self.settings.system_prompt.strip())] + msgs
        self.chat.add_message("assistant")
        self.generating = True
        self.last_stats = None
        self._update_buttons()
        self.engine.generate(msgs, self.settings.generation_config())

    def stop(self) -> None:
        if self.generating:
            self.engine.stop()

    def regenerate(self) -> None:
        if self.generating or self.conv_id is None:
            return
        msgs = self._stored(self.store.messages, self.conv_id) or []
        if msgs and msgs[-1].role == "assistant":
            if self._stored(self.store.truncate_from, self.conv_id, msgs[-1].position) is _FAILED:
                return
            self.open_conversation(self.conv_id)
        if self._stored(self.store.messages, self.conv_id):
            self._run()

    def edit_last(self) -> None:
        if self.conv_id is not None:
            users = [i for i, m in enumerate(self._stored(self.store.messages, self.conv_id) or []) if m.role == "user"]
            if users:
                self.edit_message(users[-1])

    @Slot(int)
    def edit_message(self, index: int) -> None:
        """Put user message `index` back in the input and drop it and everything after it; sending re-runs
        the conversation from there."""
        if self.generating or self.conv_id is None:
            return
        msgs = self._stored(self.store.messages, self.conv_id) or []
        if not 0 <= index < len(msgs) or msgs[index].role != "user":
            return
        if self._stored(self.store.truncate_from, self.conv_id, msgs[index].position) is _FAILED:
            return
        self.open_conversation(self.conv_id)
        self.prompt.setPlainText(msgs[index].content)
        self.prompt.setFocus()

    @Slot(object)
    def on_stats(self, st: Stats) -> None:
        self.last_stats = st
        self.metrics.push_stats(st)
        # The MTP-off reference: plain decode speed, from a reply without MTP or from the plain steps
        # (depth 0) that auto takes and times.
        sp = st.speculative
        if not st.mtp and st.decode_tok_s > 0 and st.final:
            self.metrics.set_mtp_off_reference(st.decode_tok_s)
        elif sp and sp.plain_steps >= 8 and sp.time_s.plain_decode > 0:
            self.metrics.set_mtp_off_reference(sp.plain_steps / sp.time_s.plain_decode)

    @Slot(str, str)
    def on_finished(self, reason: str, message: str) -> None:
        self.chat.flush()
        reply = self.chat.last_reply()
        stats = _stats_dict(self.last_stats, reason)
        self.chat.set_footer(_footer(stats))
        self.generating = False  # first: a failed save below must not leave the window "generating"
        self._update_buttons()
        if self.conv_id is not None and (reply or reason not in ("stopped",)):
            # On failure the reply stays in the window (not saved), and the error says so.
            self._stored(self.store.add_message, self.conv_id, "assistant", reply, stats,
                         note="The reply is shown but was not saved.")
        if reason == "context_overflow":
            self.show_error("The conversation does not fit", message)

    @Slot(str)
    def on_failed(self, msg: str) -> None:
        self.generating = False
        self._update_buttons()
        self.show_error("Generation failed", msg)

    @Slot(object)
    def on_settings(self, s: AppSettings) -> None:
        self.settings = s
        save_settings(self.qs, s)
        self.apply_theme(s.theme)

    def _stored(self, call, *args, note: str = ""):  # type: ignore[no-untyped-def]
        """call(*args) on the store; on StoreError the error is shown and _FAILED returned (the app goes on)."""
        try:
            return call(*args)
        except StoreError as e:
            self.show_error("Conversation history", f"{e} {note}".strip())
            return _FAILED

    def show_error(self, title: str, msg: str) -> None:
        self.errors.append(msg)
        box = QMessageBox(QMessageBox.Icon.Warning, title, msg, QMessageBox.StandardButton.Ok, self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()  # not exec(): the window stays live

    def apply_theme(self, theme: str) -> None:
        app = QApplication.instance()
        dark = theme == "dark" or (theme == "system" and QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark)
        pal = QPalette()
        if dark:
            for role, color in ((QPalette.ColorRole.Window, "#1e1f22"), (QPalette.ColorRole.WindowText, "#e6e6e6"),
                                (QPalette.ColorRole.Base, "#26282b"), (QPalette.ColorRole.Text, "#e6e6e6"),
                                (QPalette.ColorRole.Button, "#2d2f33"), (QPalette.ColorRole.ButtonText, "#e6e6e6"),
                                (QPalette.ColorRole.Highlight, "#3d6fb6"), (QPalette.ColorRole.Link, "#7fb2ff")):
                pal.setColor(role, QColor(color))
            for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
                pal.setColor(QPalette.ColorGroup.Disabled, role, QColor("#6f7277"))  # disabled must look disabled
        elif app is not None:
            pal = app.style().standardPalette()
        if app is not None:
            app.setPalette(pal)
        self.chat.dark = dark
        self.chat.render()
        self.metrics.set_dark(dark)

    def _update_buttons(self) -> None:
        ready = self.model_info is not None
        self.send_btn.setEnabled(ready and not self.generating)
        self.stop_btn.setEnabled(self.generating)
        self.regen_btn.setEnabled(ready and not self.generating and self.conv_id is not None)
        self.edit_btn.setEnabled(ready and not self.generating and self.conv_id is not None)

    def closeEvent(self, e) -> None:  # noqa: N802
        self.engine.shutdown()
        save_settings(self.qs, self.settings)
        super().closeEvent(e)


class _Failed:
    """What _stored returns when the store failed: falsy and empty, so a failed read reads as no rows."""

    def __bool__(self) -> bool:
        return False

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(())


_FAILED = _Failed()


def _stats_dict(st: Stats | None, reason: str) -> dict:
    if st is None:
        return {"stop_reason": reason}
    d = {"ttft_s": round(st.ttft_s, 3), "prompt_tok_s": round(st.prefill_tok_s, 1),
         "decode_tok_s": round(st.decode_tok_s, 2), "tokens": st.generated_tokens, "stop_reason": reason}
    if st.speculative:
        d.update(drafted=st.speculative.drafted, accepted=st.speculative.accepted,
                 mean_accepted_length=round(st.speculative.mean_accepted_length, 2))
    return d


def _footer(stats: dict) -> str:
    if not stats:
        return ""
    parts = []
    if "ttft_s" in stats:
        parts += [f"TTFT {stats['ttft_s'] * 1000:.0f} ms", f"prompt {stats['prompt_tok_s']} tok/s",
                  f"{stats['decode_tok_s']} tok/s", f"{stats['tokens']} tokens"]
    if "drafted" in stats:
        parts.append(f"drafts {stats['accepted']}/{stats['drafted']}, mean length {stats['mean_accepted_length']}")
    parts.append(f"stop: {stats.get('stop_reason', '?')}")
    return " · ".join(parts)

