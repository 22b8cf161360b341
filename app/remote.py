"""Remote engines in the app: the saved list (QSettings), the "Connect to a server" dialog (File › Connect to a
server…), and what the Model tab says about a connected one.

Nothing here waits on the network in the GUI thread: the model list is fetched on a plain thread and comes
back through a queued signal; connecting happens on the engine worker's thread (app.worker).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable

from PySide6.QtCore import QObject, QSettings, Signal
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QFormLayout, QHBoxLayout, QLabel, QLineEdit,
                               QMenu, QPushButton, QWidget)

from engine.errors import EngineError
from engine.remote import RemoteConfig, RemoteEngine, list_models

KEY = "remote/engines"
MAX_SAVED = 20
MIN_WIDTH = 560  # the dialog's: a server URL and a model's repository name fit whole
MODEL_CHARS = 32  # the model box's minimum width, in characters


def load_remotes(qs: QSettings) -> list[RemoteConfig]:
    """The saved remote engines, newest first; an unreadable entry is dropped, not fatal."""
    try:
        rows = json.loads(str(qs.value(KEY, "[]") or "[]"))
    except ValueError:
        return []
    out = []
    for r in rows if isinstance(rows, list) else []:
        if isinstance(r, dict) and isinstance(r.get("url"), str):
            out.append(RemoteConfig(r["url"], api_key=r.get("api_key") or None, model=r.get("model") or None,
                                    name=str(r.get("name") or "")))
    return out


def save_remote(qs: QSettings, cfg: RemoteConfig) -> None:
    """Remember `cfg` first in the list (replacing one with the same URL and model)."""
    rest = [r for r in load_remotes(qs) if (r.url, r.model) != (cfg.url, cfg.model)]
    rows = [{"name": r.name, "url": r.url, "model": r.model, "api_key": r.api_key} for r in [cfg] + rest]
    qs.setValue(KEY, json.dumps(rows[:MAX_SAVED]))


def forget_remote(qs: QSettings, cfg: RemoteConfig) -> None:
    rows = [{"name": r.name, "url": r.url, "model": r.model, "api_key": r.api_key}
            for r in load_remotes(qs) if (r.url, r.model) != (cfg.url, cfg.model)]
    qs.setValue(KEY, json.dumps(rows))


def label(cfg: RemoteConfig) -> str:
    return cfg.name or f"{cfg.model or 'first model'} @ {cfg.url}"


def fill_menu(menu: QMenu, remotes: list[RemoteConfig], connect: Callable[[RemoteConfig], None]) -> None:
    """Saved remote engines below the local files of Open recent: one click reconnects."""
    if remotes:
        menu.addSeparator()
    for cfg in remotes:
        act = menu.addAction(f"Remote: {label(cfg)}")
        act.setToolTip(cfg.url)
        act.triggered.connect(lambda _c=False, cfg=cfg: connect(cfg))


def remote_info(eng: RemoteEngine) -> dict[str, Any]:
    """What the window shows for a connected remote engine (plain data: safe to pass between threads)."""
    return {"remote": True, "name": eng.name, "path": eng.wire.base, "server": eng.server, "model": eng.model,
            "models": list(eng.models), "context": eng.n_ctx or 0, "mtp_per_request": eng.mtp_per_request,
            "metrics": eng.counters_at_connect is not None or eng.has_gauges, "notices": list(eng.notices),
            "config": eng.config}


def describe(info: dict[str, Any]) -> str:
    """The Model tab's text for a remote engine."""
    ctx = f"context {info['context']:,}" if info["context"] else "context: the server's"
    mtp = "MTP on/off and depth sent with each request" if info["mtp_per_request"] else \
        "MTP and draft depth: the server's own setting"
    metrics = ("speculation counters on /metrics (server-wide)" if info["metrics"]
               else "no speculation counters on /metrics")
    lines = [f"<b>{info['model']}</b>", f"remote {info['server']} server at {info['path']}", f"{ctx} · {mtp}",
             f"Statistics: tok/s and first-token time timed here; acceptance per request when the server reports it, "
             f"else {metrics}.",
             f"<small>The server lists: {', '.join(info['models'][:6])}</small>"]
    return "<br>".join(lines + [f"<i>{n}</i>" for n in info["notices"]])


class _Fetcher(QObject):
    done = Signal(object, str)  # model ids, error ("" when none)

    def fetch(self, url: str, key: str | None) -> None:
        def work() -> None:
            try:
                self.done.emit(list_models(url, key), "")
            except EngineError as e:
                self.done.emit([], str(e))
        threading.Thread(target=work, name="foretell-remote-models", daemon=True).start()


class RemoteDialog(QDialog):
    """Base URL, API key, model (from the server's /v1/models) and a name for the menu; wide enough for a whole URL
    and a model's repository name (Qwen/Qwen3.5-397B-A17B-GGUF), the fields growing with the dialog."""

    def __init__(self, parent: QWidget | None = None, cfg: RemoteConfig | None = None):
        super().__init__(parent)
        self.setWindowTitle("Connect to a server")
        self.setMinimumWidth(MIN_WIDTH)
        form = QFormLayout(self)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        self.url = QLineEdit(cfg.url if cfg else "")
        self.url.setPlaceholderText("http://gpu-server:8000/v1")
        self.key = QLineEdit(cfg.api_key or "" if cfg else "")
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("optional")
        self.model = QComboBox()
        self.model.setEditable(True)
        # Sized by the field, not by the names it holds: a long name is shown whole in a wider dialog.
        self.model.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model.setMinimumContentsLength(MODEL_CHARS)
        if cfg and cfg.model:
            self.model.addItem(cfg.model)
        self.fetch_btn = QPushButton("Fetch models")
        row = QHBoxLayout()
        row.addWidget(self.model, 1)
        row.addWidget(self.fetch_btn)
        self.name = QLineEdit(cfg.name if cfg else "")
        self.name.setPlaceholderText("shown in the model menu (optional)")
        self.status = QLabel("llama-server, vLLM, SGLang or another Foretell: any OpenAI-compatible server.")
        self.status.setWordWrap(True)
        for text, w, acc in (("Server URL", self.url, "Server URL"), ("API key", self.key, "API key"),
                             ("Model", row, "Model"), ("Name", self.name, "Name")):
            if isinstance(w, QWidget):
                w.setAccessibleName(acc)
            form.addRow(text, w)
        form.addRow(self.status)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Connect")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)
        self.fetcher = _Fetcher(self)
        self.fetcher.done.connect(self._fetched)
        self.fetch_btn.clicked.connect(self.fetch)

    def fetch(self) -> None:
        self.fetch_btn.setEnabled(False)
        self.status.setText("Asking the server for its models…")
        self.fetcher.fetch(self.url.text(), self.key.text().strip() or None)

    def _fetched(self, models: list[str], error: str) -> None:
        self.fetch_btn.setEnabled(True)
        if error:
            self.status.setText(f"<span style='color:#c0392b'>{error}</span>")
            return
        current = self.model.currentText()
        self.model.clear()
        self.model.addItems(models)
        if current in models:
            self.model.setCurrentText(current)
        self.status.setText(f"{len(models)} model(s) served.")

    def config(self) -> RemoteConfig:
        return RemoteConfig(self.url.text().strip(), api_key=self.key.text().strip() or None,
                            model=self.model.currentText().strip() or None, name=self.name.text().strip())
