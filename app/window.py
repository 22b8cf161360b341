"""Main window: chat first, with the conversations list on the left and one tabbed panel on the right
(Settings, Metrics, Model); both panels can be closed and brought back from the View menu, and the layout is
remembered. It fits a 1366×768 screen (works from 1024×640): every tall panel scrolls.

All engine work goes through `EngineController` (its own thread, queued signals); the conversation itself — what
is shown, edited, sent and saved — is `ChatSession` (app/session.py), which the window draws. Nothing the user
made is lost: completed messages are saved as soon as they complete, an edit or a regenerate adds a new version
of that turn (‹ 1/2 › in the chat switches), a stopped reply is kept and marked, a delete can be undone, and a
model is replaced only once the new file has been checked.
"""
from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from PySide6.QtCore import QDir, QSettings, QStandardPaths, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QAction, QColor, QGuiApplication, QKeySequence, QPalette, QShortcut
from PySide6.QtWidgets import (QApplication, QDockWidget, QFileDialog, QFrame, QGridLayout, QHBoxLayout,
                               QInputDialog, QLabel, QLineEdit, QListWidget, QListWidgetItem, QMainWindow,
                               QMessageBox, QPlainTextEdit, QProgressBar, QPushButton, QScrollArea, QTabWidget,
                               QVBoxLayout, QWidget)

from app.charts import MetricsDock
from app.chat_view import ChatView, ViewMessage
from app import context, dialogs, remote
from app.context import DoesNotFit, TokenCounter
from app.conversation_settings import ConversationPanel
from app.get_models import GetModelsDialog
from app.hub import Downloader, HubDownloader
from app.instance import InstanceServer
from app.library import LibraryPanel, models_folder, scan
from app.reply_stats import footer, mtp_mode
from app.serve_panel import ServePanel
from app.session import ChatSession, ModelInfo, list_labels, stopped_early
from app.shortcuts import ShortcutsDialog, shortcut_rows
from app.settings import AppSettings, SettingsPanel, load_settings, save_settings
from app.store import Store, StoredMessage
from app.worker import EngineController
from engine.errors import EngineError
from engine.events import Stats

LAYOUT_VERSION = 2  # restoreState refuses a layout saved by another version of the panels
TABS = ("Settings", "Metrics", "Model")
COPIED_MS = 3000  # how long the status bar says "Copied"
WARN_COLOUR = "#c77700"  # the context meter nearly full: amber, readable on the light and the dark theme


class PromptBox(QPlainTextEdit):
    """Enter sends, Shift+Enter inserts a newline, Tab and Shift+Tab move the focus on (a message rarely wants a
    tab, and the keyboard must be able to leave the box)."""

    submitted = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.setTabChangesFocus(True)

    def keyPressEvent(self, e) -> None:  # noqa: N802 (Qt override)
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not e.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(e)


def export_folder() -> Path:
    """Where an export is suggested: the Documents folder where it exists, else the home folder — never the
    folder the app was started from (a file dialog falls back to it for a folder that does not exist)."""
    docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    return Path(docs) if docs and Path(docs).is_dir() else Path(QDir.homePath())


def _scroll(w: QWidget) -> QScrollArea:
    """Tall panels scroll instead of forcing the window's minimum height."""
    s = QScrollArea()
    s.setWidgetResizable(True)
    s.setFrameShape(QFrame.Shape.NoFrame)
    s.setWidget(w)
    return s


class MainWindow(QMainWindow):
    def __init__(self, store: Store, qsettings: QSettings, model: str | None = None):
        super().__init__()
        self.setWindowTitle("Foretell")
        self.setAcceptDrops(True)
        self.store, self.qs = store, qsettings
        self.settings: AppSettings = load_settings(qsettings)
        self.engine = EngineController(self)
        self.session = ChatSession(store, lambda msg: self.show_error("Conversation history", msg))
        self.loading: str | None = None  # the file being loaded
        self._library_stale = True
        self.errors: list[str] = []  # every error reported (as said, before app.dialogs words it), for tests
        dialogs.use_plain_buttons()
        self._build()
        self._connect()
        self._restore_layout()
        self.apply_theme(self.settings.theme)
        self.refresh_conversations()
        self._reopen_conversation()
        self.refresh_library()
        # A second app on this history asks this one to come forward (app/instance.py).
        self.instance = InstanceServer(store.path, self) if store.path is not None else None
        if self.instance is not None:
            self.instance.showRequested.connect(self.bring_forward)
        # No model named: the last one opened (the embedded model if it cannot be opened any more).
        last = next(iter(self.settings.recent_models), None)
        self._fallback = model is None and last is not None and Path(last).exists()
        self.load_model(model if model is not None or not self._fallback else last)

    # What the smoke test, the screenshots and the tests watch: the session's, read-only.
    @property
    def generating(self) -> bool:
        return self.session.generating

    @property
    def conv_id(self) -> int | None:
        return self.session.conv_id

    @property
    def model_info(self) -> ModelInfo | None:
        return self.session.model

    @property
    def last_stats(self) -> Stats | None:
        return self.session.last_stats

    # -- layout --------------------------------------------------------------------------------------
    def _build(self) -> None:
        central = QWidget()
        col = QVBoxLayout(central)
        self.chat = ChatView()
        col.addWidget(self.chat, 1)
        self.edit_banner = QWidget()
        eb = QHBoxLayout(self.edit_banner)
        eb.setContentsMargins(0, 0, 0, 0)
        eb.addWidget(QLabel("Editing a message: Send makes a new version of it; the old one stays (‹ › to switch)."), 1)
        self.cancel_edit_btn = QPushButton("Cancel edit")
        eb.addWidget(self.cancel_edit_btn)
        self.edit_banner.setVisible(False)
        col.addWidget(self.edit_banner)
        self.prompt = PromptBox()
        self.prompt.setAccessibleName("Message")
        self.prompt.setPlaceholderText("Message (Enter to send, Shift+Enter for a new line)")
        self.prompt.setMinimumHeight(52)
        self.prompt.setMaximumHeight(90)
        col.addWidget(self.prompt)
        row = QHBoxLayout()
        self.send_btn = QPushButton("Send")
        self.stop_btn = QPushButton("Stop (Esc)")
        self.regen_btn = QPushButton("Regenerate")
        for b in (self.send_btn, self.stop_btn, self.regen_btn):
            b.setAccessibleName(b.text())
            row.addWidget(b)
        row.addStretch(1)
        col.addLayout(row)
        self.setCentralWidget(central)

        side = QWidget()
        sl = QVBoxLayout(side)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations")
        self.search.setAccessibleName("Search conversations")
        self.search.setClearButtonEnabled(True)
        self.conv_list = QListWidget()
        self.conv_list.setAccessibleName("Conversations")
        sl.addWidget(self.search)
        sl.addWidget(self.conv_list, 1)
        grid = QGridLayout()
        self.new_btn, self.rename_btn, self.delete_btn, self.export_btn = (
            QPushButton(t) for t in ("New", "Rename", "Delete", "Export…"))
        for i, b in enumerate((self.new_btn, self.rename_btn, self.delete_btn, self.export_btn)):
            b.setAccessibleName(f"{b.text().rstrip('…')} conversation")
            grid.addWidget(b, i // 2, i % 2)
        sl.addLayout(grid)
        self.sidebar = self._dock("Conversations", "conversations", side, Qt.DockWidgetArea.LeftDockWidgetArea)

        self.settings_panel = SettingsPanel(self.settings)
        self.serve_panel = ServePanel(self.engine.worker, lambda: self.settings.generation_config())
        settings_tab = QWidget()
        st_col = QVBoxLayout(settings_tab)
        st_col.setContentsMargins(0, 0, 0, 0)
        self.conv_panel = ConversationPanel(self.session)  # this conversation's own settings, above the defaults
        st_col.addWidget(self.conv_panel)
        st_col.addWidget(self.settings_panel)
        line = QFrame()
        line.setFrameShape(QFrame.Shape.HLine)
        line.setFrameShadow(QFrame.Shadow.Sunken)
        st_col.addWidget(line)
        st_col.addWidget(self.serve_panel)
        st_col.addStretch(1)  # a tall panel's spare height goes below the forms, not between their rows
        self.metrics = MetricsDock()
        model_tab = QWidget()
        ml = QVBoxLayout(model_tab)
        self.info = QLabel("No model loaded")
        self.info.setAccessibleName("Model information")
        self.info.setWordWrap(True)
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        ml.addWidget(self.info)
        ml.addWidget(QLabel("<b>Model library</b>"))
        self.library = LibraryPanel()
        ml.addWidget(self.library, 1)
        self.tabs = QTabWidget()
        self.tabs.setAccessibleName("Side panel")
        self.tabs.addTab(_scroll(settings_tab), "Settings")
        self.tabs.addTab(_scroll(self.metrics), "Metrics")
        self.tabs.addTab(_scroll(model_tab), "Model")
        self.panel = self._dock("Panel", "panel", self.tabs, Qt.DockWidgetArea.RightDockWidgetArea)
        self.panel.setMinimumWidth(300)
        self.sidebar.setMinimumWidth(170)

        sb = self.statusBar()
        self.state_label = QLabel()
        self.state_label.setAccessibleName("State")
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Progress")
        self.progress.setMaximumWidth(200)
        self.progress.setVisible(False)
        self.undo_btn = QPushButton("Undo delete")
        self.undo_btn.setVisible(False)
        self.cancel_load_btn = QPushButton("Cancel loading")
        self.cancel_load_btn.setToolTip("Stop loading this model (Esc); the previous model stays")
        self.cancel_load_btn.setVisible(False)
        self.context_label, self.device_label, self.model_label = QLabel(), QLabel(), QLabel()
        self.context_label.setAccessibleName("Context used")
        self.context_label.setToolTip("Tokens of the open conversation, with the system prompt, in the model's "
                                      "context. When a message does not fit, the oldest messages are left out.")
        self.model_label.setAccessibleName("Model")
        sb.addWidget(self.state_label, 1)
        sb.addWidget(self.progress)
        sb.addWidget(self.cancel_load_btn)
        sb.addPermanentWidget(self.undo_btn)  # permanent: beside the message it undoes, never over it
        for w in (self.context_label, self.device_label, self.model_label):
            w.setContentsMargins(8, 0, 8, 0)
            sb.addPermanentWidget(w)
        self.undo_timer = QTimer(self, singleShot=True, interval=20_000)

        file_menu = self.menuBar().addMenu("&File")
        self.open_action = QAction("&Open model…", self, shortcut=QKeySequence("Ctrl+O"))
        file_menu.addAction(self.open_action)
        self.get_models_action = QAction("&Get models…", self)
        self.get_models_action.setToolTip("Download a Qwen3.5/3.6 GGUF model from Hugging Face")
        file_menu.addAction(self.get_models_action)
        self.connect_action = QAction("&Connect to a server…", self)
        self.connect_action.setToolTip("Chat through llama-server, vLLM, SGLang or another Foretell over the OpenAI API")
        file_menu.addAction(self.connect_action)
        self.recent_menu = file_menu.addMenu("Open &recent")
        self._fill_recent()
        self.library_action = file_menu.addAction("Model &library")
        file_menu.addSeparator()
        self.new_action = QAction("&New chat", self, shortcut=QKeySequence("Ctrl+N"))
        file_menu.addAction(self.new_action)
        self.export_action = QAction("&Export conversation…", self, shortcut=QKeySequence("Ctrl+E"))
        file_menu.addAction(self.export_action)
        file_menu.addSeparator()
        self.quit_action = QAction("&Quit", self, shortcut=QKeySequence("Ctrl+Q"))
        file_menu.addAction(self.quit_action)

        view = self.menuBar().addMenu("&View")
        self.view_menu = view
        for dock, key in ((self.sidebar, "Ctrl+Shift+L"), (self.panel, "Ctrl+Shift+P")):
            act = dock.toggleViewAction()
            act.setShortcut(QKeySequence(key))
            view.addAction(act)
        view.addSeparator()
        self.tab_actions = {}
        for i, (name, key) in enumerate(zip(TABS, ("Ctrl+,", "Ctrl+M", "Ctrl+L"))):
            act = QAction(name, self, shortcut=QKeySequence(key))
            act.triggered.connect(lambda _c=False, i=i: self.show_tab(i))
            view.addAction(act)
            self.tab_actions[name] = act
        view.addSeparator()
        self.drafts_action = QAction("&Highlight accepted draft tokens", self, checkable=True)
        self.drafts_action.setToolTip("Tokens that came from accepted MTP drafts get a green background")
        view.addAction(self.drafts_action)
        self.reset_layout_action = view.addAction("&Reset layout")

        self.help_menu = self.menuBar().addMenu("&Help")
        self.shortcuts_action = QAction("&Keyboard shortcuts", self, shortcut=QKeySequence("F1"))
        self.help_menu.addAction(self.shortcuts_action)

    def bring_forward(self) -> None:
        """Another app was started on this history: this window comes forward and says why."""
        if self.isMinimized():
            self.showNormal()
        self.show()
        self.raise_()
        self.activateWindow()
        self.statusBar().showMessage("Foretell is already open here: this window has the conversation history",
                                     10_000)

    def show_shortcuts(self) -> None:
        menus = [a.menu() for a in self.menuBar().actions() if a.menu() is not None]
        self.shortcuts_dialog = ShortcutsDialog(shortcut_rows(menus, self.shortcuts), self)
        self.shortcuts_dialog.open()

    def _dock(self, title: str, name: str, w: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        d = QDockWidget(title, self)
        d.setObjectName(name)
        d.setWidget(w)
        self.addDockWidget(area, d)
        return d

    def show_tab(self, index: int) -> None:
        self.panel.setVisible(True)
        self.tabs.setCurrentIndex(index)

    def _default_layout(self) -> None:
        for d, area in ((self.sidebar, Qt.DockWidgetArea.LeftDockWidgetArea),
                        (self.panel, Qt.DockWidgetArea.RightDockWidgetArea)):
            d.setFloating(False)
            self.addDockWidget(area, d)
            d.setVisible(True)
        screen = QGuiApplication.primaryScreen()
        avail = screen.availableGeometry() if screen else None
        w, h = (1280, 800) if avail is None else (min(1280, avail.width()), min(800, avail.height()))
        self.resize(w, h)
        self._fit_docks = True
        self._fit_dock_widths()

    def _fit_dock_widths(self) -> None:
        """The chat column is capped at a readable width; a wide window gives the rest to the panel."""
        w = self.width()
        self.resizeDocks([self.sidebar, self.panel], [220, min(560, max(360, w - 220 - 920))],
                         Qt.Orientation.Horizontal)

    def resizeEvent(self, e) -> None:  # noqa: N802 (Qt override)
        super().resizeEvent(e)
        if getattr(self, "_fit_docks", False):  # until the window has settled (a window manager maximises late)
            self._fit_dock_widths()

    def showEvent(self, e) -> None:  # noqa: N802 (Qt override)
        super().showEvent(e)
        QTimer.singleShot(2000, lambda: setattr(self, "_fit_docks", False))

    def _restore_layout(self) -> None:
        geo, state = self.qs.value("window/geometry"), self.qs.value("window/state")
        self._default_layout()
        if geo is not None:
            self.restoreGeometry(geo)
        if state is not None and self.restoreState(state, LAYOUT_VERSION):
            self._fit_docks = False  # the user's own widths
        self.tabs.setCurrentIndex(int(self.qs.value("window/tab", 0) or 0) % len(TABS))

    def _save_layout(self) -> None:
        self.qs.setValue("window/geometry", self.saveGeometry())
        self.qs.setValue("window/state", self.saveState(LAYOUT_VERSION))
        self.qs.setValue("window/tab", self.tabs.currentIndex())

    def _connect(self) -> None:
        w = self.engine.worker
        w.loadProgress.connect(self.on_load_progress)
        w.loadCancelled.connect(self.on_load_cancelled)
        w.loaded.connect(self.on_loaded)
        w.loadFailed.connect(self.on_load_failed)
        w.prefill.connect(self.on_prefill)
        w.token.connect(self.chat.append_token)
        w.token.connect(self._on_token)
        w.stats.connect(self.on_stats)
        w.finished.connect(self.on_finished)
        w.failed.connect(self.on_failed)
        self.send_btn.clicked.connect(self.send)
        self.prompt.submitted.connect(self.send)
        self.stop_btn.clicked.connect(self.stop)
        self.regen_btn.clicked.connect(self.regenerate)
        self.cancel_edit_btn.clicked.connect(self.cancel_edit)
        self.chat.editRequested.connect(self.edit_message)
        self.chat.deleteRequested.connect(self.delete_message)
        self.chat.versionRequested.connect(self.switch_version)
        self.chat.exampleChosen.connect(self.ask_example)
        self.chat.copied.connect(lambda _t: self.statusBar().showMessage("Copied", COPIED_MS))
        self.new_btn.clicked.connect(self.new_conversation)
        self.new_action.triggered.connect(self.new_conversation)
        self.rename_btn.clicked.connect(self.rename_conversation)
        self.delete_btn.clicked.connect(self.delete_conversation)
        self.export_btn.clicked.connect(self.export_conversation)
        self.export_action.triggered.connect(self.export_conversation)
        self.undo_btn.clicked.connect(self.undo_delete)
        self.cancel_load_btn.clicked.connect(self.cancel_load)
        self.undo_timer.timeout.connect(lambda: self.undo_btn.setVisible(False))
        self.search.textChanged.connect(lambda _t: self.refresh_conversations())
        self.conv_list.currentItemChanged.connect(self._on_select)
        self.settings_panel.changed.connect(self.on_settings)
        self.conv_panel.changed.connect(self._update_context)
        self.open_action.triggered.connect(self.open_dialog)
        self.get_models_action.triggered.connect(lambda: self.get_models(HubDownloader()))
        self.connect_action.triggered.connect(self.remote_dialog)
        self.library_action.triggered.connect(lambda: self.show_tab(TABS.index("Model")))
        self.quit_action.triggered.connect(self.close)
        self.reset_layout_action.triggered.connect(self._default_layout)
        self.drafts_action.toggled.connect(self.highlight_drafts)
        self.shortcuts_action.triggered.connect(self.show_shortcuts)
        self.library.openRequested.connect(self.load_model)
        self.library.folderChanged.connect(self._set_library_folder)
        self.library.refresh_btn.clicked.connect(self.refresh_library)
        self.tabs.currentChanged.connect(lambda _i: self._library_stale and self.refresh_library())
        self.panel.visibilityChanged.connect(lambda _v: self._library_stale and self.refresh_library())
        self.shortcuts = [
            QShortcut(QKeySequence("Esc"), self, activated=self.stop_or_cancel,
                      whatsThis="Stop the reply, cancel loading a model, or cancel an edit"),
            QShortcut(QKeySequence("Ctrl+Shift+C"), self, whatsThis="Copy the last reply",
                      activated=self.chat.copy_last_reply)]
        self._update_buttons()

    # -- model -------------------------------------------------------------------------------------
    def load_model(self, path: str | None) -> None:
        """Ask the worker to load; the current model stays until the new file has been checked and loaded."""
        name = Path(path).name if path else "the embedded model"
        self.loading = name
        self.progress.setRange(0, 100)
        self.progress.setValue(0)
        self.progress.setFormat(f"opening {name}")
        self.progress.setVisible(True)
        self.cancel_load_btn.setVisible(True)
        self.cancel_load_btn.setEnabled(True)
        self._set_state(f"Loading {name}…")
        self._update_buttons()
        self.engine.load(path, self.settings.engine_config())

    @Slot(float, str)
    def on_load_progress(self, frac: float, msg: str) -> None:
        self.progress.setValue(int(frac * 100))
        self.progress.setFormat(msg)

    @Slot(object)
    def on_loaded(self, info: dict) -> None:
        self.session.model = ModelInfo.of(info)
        self.session.counter = self._token_counter(self.session.model)
        self.loading = None
        self.progress.setVisible(False)
        self.cancel_load_btn.setVisible(False)
        self.settings_panel.show_engine(info if info.get("remote") else None)
        if info.get("remote"):
            self._on_remote(info)
            return
        self.settings.add_recent(info["path"])
        save_settings(self.qs, self.settings)
        self._fill_recent()
        mix = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in info["quant_mix"].items())
        moe = f"{info['experts']} experts, top-{info['experts_used']}" if info["experts"] else "dense FFN"
        lines = [f"<b>{info['name']}</b>", f"{info['architecture']} · {info['layers']} layers ({info['layer_pattern']})",
                 f"{info['params_total'] / 1e6:.1f}M parameters, {info['params_active'] / 1e6:.1f}M active · {moe}",
                 f"context {info['context']} (trained {info['context_train']}) · MTP {'yes' if info['mtp'] else 'no'}",
                 f"quant mix: {mix}", f"Placement: {info['placement']}.", f"<small>{info['path']}</small>"]
        lines += [f"<i>{n}</i>" for n in info["notices"]]
        self.info.setText("<br>".join(lines))
        self.metrics.model_layers = info["layers"]
        self.setWindowTitle(f"Foretell — {info['name']}")
        self.model_label.setText(info["name"])
        self.device_label.setText("CPU" if info["placement"].startswith("all ") else "CPU + GPU")
        self._update_context()
        self._set_state("Ready")
        self._update_buttons()
        self.refresh_library()

    def _on_remote(self, info: dict) -> None:
        remote.save_remote(self.qs, info["config"])
        self._fill_recent()
        self.info.setText(remote.describe(info))
        self.setWindowTitle(f"Foretell — {info['name']}")
        self.model_label.setText(info["name"])
        self.device_label.setText(f"remote {info['server']}")
        self._update_context()
        self._set_state("Ready")
        self._update_buttons()

    def _token_counter(self, info: ModelInfo) -> TokenCounter | None:
        """How prompts are measured against the context: the local model's own tokenizer and template; a remote
        engine's length estimated where its server says its context, else not measured (the server decides)."""
        if info.remote:
            return TokenCounter(context.estimate, info.context, estimated=True) if info.context else None
        worker = self.engine.worker
        return TokenCounter(lambda msgs: len(worker.served.encode_prompt(msgs)) if worker.served else 0,
                            info.context)

    def _update_context(self) -> None:
        """The status bar's context meter for the open conversation (what the next message starts from)."""
        info = self.model_info
        if info is None or self.loading:
            return
        try:
            used = self.session.measure(self.session.effective(self.settings).system_prompt, self.settings.max_tokens)
        except EngineError:
            used = None
        start = used.left_out if used is not None else 0
        if start != self.chat.context_start:  # the line above the first message the model is sent
            self.chat.context_start = start
            self.chat.render()
        if used is None:
            self._show_meter(f"context {info.context:,} tokens" if info.context else "", False)
            return
        text, warn = context.meter(used.tokens, info.context, self.settings.max_tokens, used.left_out)
        estimated = self.session.counter is not None and self.session.counter.estimated
        self._show_meter(text + (" (estimated)" if estimated else ""), warn)

    def _show_meter(self, text: str, warn: bool) -> None:
        """Amber as the context fills, and once the oldest messages no longer fit."""
        self.context_label.setText(text)
        self.context_label.setStyleSheet(f"color: {WARN_COLOUR}; font-weight: bold" if warn else "")

    @Slot(str)
    def on_load_failed(self, msg: str) -> None:
        failed, self.loading = self.loading, None
        self.progress.setVisible(False)
        self.cancel_load_btn.setVisible(False)
        if self._fallback and self.model_info is None:  # the last model cannot be reopened: the embedded one
            self._fallback = False
            self.statusBar().showMessage(f"Could not reopen {failed}: {msg}", 15_000)
            self.load_model(None)
            return
        self.progress.setRange(0, 100)
        if self.model_info is not None:
            self._set_state(f"Ready — kept {self.model_info.name}")
        else:
            self._set_state("No model loaded")
            self.info.setText("No model loaded")
        self.show_error("Could not open the model", msg)
        self._update_buttons()

    def cancel_load(self) -> None:
        if self.loading:
            self.cancel_load_btn.setEnabled(False)
            self._set_state(f"Cancelling the load of {self.loading}…")
            self.engine.cancel_load()

    @Slot(str)
    def on_load_cancelled(self, msg: str) -> None:
        """The previous model (if any) was loaded again before this arrives (the worker's order)."""
        self.loading = None
        self.progress.setVisible(False)
        self.cancel_load_btn.setVisible(False)
        self.cancel_load_btn.setEnabled(True)
        kept = f" — kept {self.model_info.name}" if self.model_info is not None else " — no model loaded"
        self._set_state(f"Loading cancelled{kept}")
        if self.model_info is None:
            self.info.setText("No model loaded")
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
        remote.fill_menu(self.recent_menu, remote.load_remotes(self.qs), self.connect_remote)

    def remote_dialog(self) -> remote.RemoteDialog:
        """File › Connect to a server…"""
        dlg = remote.RemoteDialog(self)
        dlg.accepted.connect(lambda: self.connect_remote(dlg.config()))
        dlg.open()
        return dlg

    def connect_remote(self, cfg) -> None:  # engine.remote.RemoteConfig
        """Connect on the worker thread; the current engine stays until the server and model check out."""
        self.loading = remote.label(cfg)
        self.progress.setRange(0, 0)  # busy: a connection has no fraction
        self.progress.setVisible(True)
        self._set_state(f"Connecting to {cfg.url}…")
        self._update_buttons()
        self.engine.connect_remote(cfg)

    def refresh_library(self) -> None:
        """Describe the library's files — only while the Model tab shows (each file's header is read)."""
        if self.tabs.currentIndex() != TABS.index("Model") or not self.panel.isVisible():
            self._library_stale = True
            return
        self._library_stale = False
        folder = str(self.qs.value("library/folder", "") or "")
        entries = scan(folder or None, self.settings.recent_models, self.settings.context,
                       self.settings.engine_config().device)
        self.library.show_entries(entries, folder)

    def get_models(self, downloader: Downloader) -> GetModelsDialog:
        """The Get models dialog over `downloader`; downloads go to the library's folder (the models folder in the
        user data directory until one is chosen), and a downloaded model can be opened from it."""
        folder = str(self.qs.value("library/folder", "") or "") or str(models_folder())
        self.get_models_dialog = GetModelsDialog(downloader, Path(folder), self, self.settings.context,
                                                 self.settings.engine_config().device)
        self.get_models_dialog.work.finished.connect(lambda path, *_: path and self._set_library_folder(folder))
        self.get_models_dialog.opened.connect(self.load_model)
        self.get_models_dialog.open()
        return self.get_models_dialog

    def _set_library_folder(self, folder: str) -> None:
        self.qs.setValue("library/folder", folder)
        self.refresh_library()

    def dragEnterEvent(self, e) -> None:  # noqa: N802
        if any(u.isLocalFile() for u in e.mimeData().urls()):
            e.acceptProposedAction()  # any file: a non-GGUF one is answered with why it cannot be opened

    def dropEvent(self, e) -> None:  # noqa: N802
        files = [u.toLocalFile() for u in e.mimeData().urls() if u.isLocalFile()]
        if files:
            self.load_model(files[0])

    # -- conversations -----------------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        convs = self.session.conversations(self.search.text() or None)
        for c, (text, tip) in zip(convs, list_labels(convs, self.session.models())):
            item = QListWidgetItem(text)
            item.setToolTip(tip)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            self.conv_list.addItem(item)
            if c.id == self.conv_id:
                self.conv_list.setCurrentItem(item)
        self.conv_list.blockSignals(False)

    def _on_select(self, item: QListWidgetItem | None, _prev: object = None) -> None:
        if item is not None and not self.generating:
            self.open_conversation(int(item.data(Qt.ItemDataRole.UserRole)))
            self.prompt.setFocus()

    def _reopen_conversation(self) -> None:
        last = self.qs.value("last_conversation")
        ids = {c.id for c in self.store.conversations()}
        if last is not None and str(last).isdigit() and int(last) in ids:
            self.open_conversation(int(last))
            self.refresh_conversations()

    def open_conversation(self, conv_id: int) -> None:
        self.session.open(conv_id)
        self._show_conversation()

    def _show_conversation(self) -> None:
        """Draw the session's open conversation (opened, reread, or switched to another version)."""
        self.qs.setValue("last_conversation", self.conv_id)
        self.edit_banner.setVisible(False)
        self.chat.set_messages([self._view(m) for m in self.session.shown])
        self.conv_panel.show_settings(self.settings)
        self._update_buttons()
        self._update_context()

    def _view(self, m: StoredMessage) -> ViewMessage:
        return ViewMessage(m.role, m.content, [(m.content, False)], footer(m.stats) if m.role == "assistant" else "",
                           version=self.session.version_of(m), stopped=stopped_early(m.stats.get("stop_reason", "")))

    def new_conversation(self) -> None:
        if self.session.new():
            self._show_empty()

    def _show_empty(self) -> None:
        self.qs.remove("last_conversation")
        self.edit_banner.setVisible(False)
        self.chat.set_messages([])
        self.conv_panel.show_settings(self.settings)
        self.refresh_conversations()
        self._update_buttons()
        self._update_context()
        self.prompt.setFocus()

    def rename_conversation(self) -> None:
        if self.conv_id is None:
            return
        title, ok = QInputDialog.getText(self, "Rename", "Title:", text=self.store.conversation(self.conv_id).title)
        if ok:
            self.session.rename(title)
            self.refresh_conversations()

    def delete_conversation(self) -> None:
        """Delete at once, with Undo in the status bar (the store purges it when next opened)."""
        conv = self.session.delete()
        if conv is None:
            return
        self._show_empty()
        self._offer_undo(f"Deleted “{conv.title}”")

    @Slot(int)
    def delete_message(self, index: int) -> None:
        """Delete one message at once, with Undo in the status bar (as a conversation)."""
        if self.session.delete_message(index):
            self._show_conversation()
            self._offer_undo("Deleted a message")

    def _offer_undo(self, what: str) -> None:
        self.statusBar().showMessage(what, 20_000)
        self.undo_btn.setVisible(True)
        self.undo_timer.start()

    def undo_delete(self) -> None:
        if not self.session.undo_delete():
            return
        self.undo_btn.setVisible(False)
        self.statusBar().clearMessage()
        self._show_conversation()
        self.refresh_conversations()

    def export_meta(self) -> dict:
        s = self.session.effective(self.settings)
        m = self.model_info
        return {"model": m.name if m else None, "model_file": m.path if m else None,
                "exported": dt.datetime.now().isoformat(timespec="seconds"),
                "settings": {"mtp": mtp_mode(s.mtp, s.draft), "temperature": s.temperature, "top_k": s.top_k,
                             "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
                             "seed": s.seed, "context": s.context, "max_tokens": s.max_tokens,
                             "system_prompt": s.system_prompt}}

    def default_export_path(self) -> str:
        title = self.store.conversation(self.conv_id).title if self.conv_id is not None else "conversation"
        stem = re.sub(r"[^\w\- ]+", "", title).strip().replace(" ", "-")[:60] or "conversation"
        return str(export_folder() / f"{stem}.md")

    def export_conversation(self) -> None:
        if self.conv_id is None:
            return
        path, chosen = QFileDialog.getSaveFileName(self, "Export conversation", self.default_export_path(),
                                                   "Markdown (*.md);;JSON (*.json)")
        if path:
            self.export_to(path, chosen)

    def export_to(self, path: str, chosen_filter: str = "") -> Path:
        """Write the shown branch; the extension of the chosen format is added when the name has none."""
        p = Path(path)
        if p.suffix.lower() not in (".md", ".json"):
            p = p.with_name(p.name + (".json" if "json" in chosen_filter.lower() else ".md"))
        assert self.conv_id is not None
        meta = self.export_meta()
        text = self.store.export_json(self.conv_id, meta) if p.suffix.lower() == ".json" else \
            self.store.export_markdown(self.conv_id, meta)
        p.write_text(text, encoding="utf-8")
        self.statusBar().showMessage(f"Exported to {p}", 8000)
        return p

    # -- chatting ----------------------------------------------------------------------------------
    def send(self) -> None:
        if self.loading:
            return
        text = self.prompt.toPlainText().strip()
        try:
            refused = self.session.refusal(text, self.session.effective(self.settings).system_prompt) if text else None
        except EngineError as e:
            refused = str(e)
        if refused is not None:  # never stored: the text stays in the input, the conversation as it was
            self.show_error("The message is too long", refused)
            return
        started = self.conv_id is None
        posted = self.session.post(text)
        if started and self.conv_id is not None:  # this message started a conversation: reopened next time
            self.qs.setValue("last_conversation", self.conv_id)
        if not posted:
            return  # the text stays in the input; an error says why where the store failed
        self.edit_banner.setVisible(False)
        self.prompt.clear()
        self.refresh_conversations()
        self._reply()

    def ask_example(self, question: str) -> None:
        self.prompt.setPlainText(question)
        self.send()

    def regenerate(self) -> None:
        """A new version of the last reply; the old one stays (‹ › switches)."""
        self._reply()

    def _reply(self) -> None:
        """Show the branch the session answers and ask the engine for the reply."""
        s = self.session.effective(self.settings)  # the conversation's own settings, where it has them
        try:
            msgs = self.session.reply(s.system_prompt, self.model_info.mode(s.mtp, s.draft), s.max_tokens)
        except (DoesNotFit, EngineError) as e:
            self.show_error("The message does not fit", str(e))
            return
        if msgs is None:
            return
        self.chat.context_start = self.session.left_out
        self.chat.set_messages([self._view(m) for m in self.session.shown])
        self.chat.add_message("assistant")
        self.metrics.begin_reply(self.session.reply_mode, self.model_info.engine)
        self._set_state("Waiting for the first token…")
        n = self.session.left_out
        if n:
            self.statusBar().showMessage(f"Sent without the {n} oldest message{'s' if n > 1 else ''}: the "
                                         "conversation no longer fits the context", 15_000)
        self._update_buttons()
        self.prompt.setFocus()
        self.engine.generate(msgs, s.generation_config())

    def stop(self) -> None:
        if self.generating:
            self.engine.stop()

    def stop_or_cancel(self) -> None:
        if self.loading:
            self.cancel_load()
        elif self.generating:
            self.stop()
        elif self.session.editing is not None:
            self.cancel_edit()

    @Slot(int)
    def edit_message(self, index: int) -> None:
        """Put user message `index` in the input. Nothing is removed: sending adds a new version of that turn."""
        msg = self.session.edit(index)
        if msg is not None:
            self.edit_banner.setVisible(True)
            self.prompt.setPlainText(msg.content)
            self.prompt.setFocus()

    def cancel_edit(self) -> None:
        if self.session.cancel_edit():
            self.edit_banner.setVisible(False)
            self.prompt.clear()
            self.prompt.setFocus()

    @Slot(int, int)
    def switch_version(self, index: int, step: int) -> None:
        if self.session.switch_version(index, step):
            self._show_conversation()
            self.prompt.setFocus()

    def highlight_drafts(self, on: bool) -> None:
        self.chat.color_drafts = on
        self.chat.render()

    @Slot(int, int)
    def on_prefill(self, done: int, total: int) -> None:
        self.progress.setRange(0, total)
        self.progress.setValue(done)
        self.progress.setFormat(f"{done}/{total}")
        self.progress.setVisible(done < total)
        self._set_state(f"Processing prompt … {done}/{total}")

    @Slot(str, bool)
    def _on_token(self, _text: str, _acc: bool) -> None:
        if self.session.token_arrived():
            self.progress.setVisible(False)
            self._set_state("Generating…")

    @Slot(object)
    def on_stats(self, st: Stats) -> None:
        self.session.last_stats = st
        self.metrics.push_stats(st)
        if self.model_info and self.model_info.context:
            self._show_meter(*context.meter(st.prompt_tokens + st.generated_tokens, self.model_info.context,
                                            self.settings.max_tokens, 0))

    @Slot(str, str)
    def on_finished(self, reason: str, message: str) -> None:
        self.chat.flush()
        done = self.session.finish(self.chat.last_reply(), reason)
        if done.saved is not None:  # else the reply stays in the window (not saved), and an error says so
            last = self.chat.messages[-1]
            last.version, last.stopped = (done.versions, done.versions), done.stopped
            self.refresh_conversations()  # the list names a conversation's model, known now
        self.chat.set_footer(footer(done.stats))
        self._set_state("Ready" if reason != "stopped" else "Ready — the reply was stopped and kept")
        self.progress.setVisible(False)
        self._update_buttons()
        self._update_context()
        self.prompt.setFocus()
        if reason == "context_overflow":
            self.show_error("The conversation does not fit", message)
        elif reason == "interrupted":  # a remote reply cut mid-way: kept, marked, and one click retries it
            self._set_state("Ready — the reply was cut off and kept")
            self.show_error("The reply was cut off", message, retry=True)

    @Slot(str)
    def on_failed(self, msg: str) -> None:
        self.session.fail()  # the partial reply was never saved: show what is stored
        self.progress.setVisible(False)
        self._set_state("Ready")
        if self.conv_id is not None:
            self._show_conversation()
        self._update_buttons()
        self.show_error("Generation failed", msg, retry=True)

    @Slot(object)
    def on_settings(self, s: AppSettings) -> None:
        self.settings = s
        save_settings(self.qs, s)
        self.apply_theme(s.theme)
        self.conv_panel.show_settings(s)  # a conversation on the defaults shows the new ones
        self._update_context()  # the system prompt counts

    def show_error(self, title: str, msg: str, retry: bool = False) -> None:
        """A message box in plain words (app.dialogs) that leaves the window live; `retry` adds a Retry button (a
        new version of the reply). `errors` keeps `msg` itself, as the engine or the store said it."""
        self.errors.append(msg)
        box = dialogs.error_box(self, title, msg)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        if retry:
            box.addButton(QMessageBox.StandardButton.Retry).clicked.connect(self.regenerate)
        self.error_box = box
        box.open()  # not exec(): the window stays live

    def _set_state(self, text: str) -> None:
        self.state_label.setText(text)

    def apply_theme(self, theme: str) -> None:
        app = QApplication.instance()
        dark = theme == "dark" or (theme == "system" and QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark)
        pal = QPalette()
        if dark:
            for role, color in ((QPalette.ColorRole.Window, "#1e1f22"), (QPalette.ColorRole.WindowText, "#e6e6e6"),
                                (QPalette.ColorRole.Base, "#26282b"), (QPalette.ColorRole.Text, "#e6e6e6"),
                                (QPalette.ColorRole.AlternateBase, "#2b2d31"),
                                (QPalette.ColorRole.Button, "#2d2f33"), (QPalette.ColorRole.ButtonText, "#e6e6e6"),
                                (QPalette.ColorRole.Highlight, "#3d6fb6"), (QPalette.ColorRole.Link, "#7fb2ff"),
                                (QPalette.ColorRole.PlaceholderText, "#9a9da3"), (QPalette.ColorRole.ToolTipBase, "#2d2f33"),
                                (QPalette.ColorRole.ToolTipText, "#e6e6e6")):
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
        ready = self.model_info is not None and self.loading is None
        self.send_btn.setEnabled(ready and not self.generating)
        self.stop_btn.setEnabled(self.generating)
        self.regen_btn.setEnabled(ready and not self.generating and self.conv_id is not None and bool(self.session.shown))
        for b in (self.rename_btn, self.delete_btn, self.export_btn):
            b.setEnabled(self.conv_id is not None and not self.generating)
        self.export_action.setEnabled(self.conv_id is not None)

    def closeEvent(self, e) -> None:  # noqa: N802
        self.serve_panel.stop()
        self.engine.shutdown()
        self._save_layout()
        save_settings(self.qs, self.settings)
        if self.instance is not None:
            self.instance.close()
        self.store.close()  # the history's lock goes with the window: another window may open it now
        super().closeEvent(e)

