"""The "Serve on localhost" switch: the app's loaded engine over the OpenAI API (engine.server), with its URL
and how many requests it has answered.

The server runs on its own threads (uvicorn's and one generation thread) and shares the worker's `gen_lock`,
the lock the worker holds while it generates, so a chat in the window and a request never run on the engine
at once. It serves a local model only (`EngineWorker.served`): connecting to a remote engine switches it off.
Only 127.0.0.1 is offered here; `python -m engine serve --host` is for anything wider.
"""
from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt, QTimer, Slot
from PySide6.QtWidgets import QCheckBox, QFormLayout, QLabel, QSpinBox, QWidget

from app.worker import EngineWorker
from engine.errors import EngineError
from engine.events import GenerationConfig

REMOTE_NOTE = "A remote engine is served by its own server: open a local model to serve it"


class ServePanel(QWidget):
    def __init__(self, worker: EngineWorker, defaults: Callable[[], GenerationConfig],
                 parent: QWidget | None = None):
        super().__init__(parent)
        from engine.server.run import DEFAULT_PORT

        self.worker, self.defaults = worker, defaults
        self.server = None  # engine.server.run.LocalServer while serving
        form = QFormLayout(self)
        self.switch = QCheckBox("Serve on localhost")
        self.switch.setAccessibleName("Serve on localhost")
        self.switch.setToolTip("Let other programs (editors, Open WebUI, scripts) use this model over the OpenAI API")
        self.port = QSpinBox()
        self.port.setAccessibleName("Server port")
        self.port.setRange(0, 65535)
        self.port.setSpecialValueText("any free port")
        self.port.setValue(DEFAULT_PORT)
        self.url = QLabel("Off")
        self.url.setAccessibleName("Server address")
        self.url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.count = QLabel("")
        self.count.setAccessibleName("Server requests")
        form.addRow(self.switch)
        form.addRow("Port", self.port)
        form.addRow("Address", self.url)
        form.addRow("Requests", self.count)
        self.timer = QTimer(self, interval=1000)
        self.timer.timeout.connect(self.refresh)
        self.switch.toggled.connect(self._toggled)
        worker.loaded.connect(self._on_loaded)

    @Slot(bool)
    def _toggled(self, on: bool) -> None:
        if on:
            self.start()
        else:
            self.stop()

    def start(self) -> None:
        from engine.server.run import LocalServer

        if self.worker.engine is None:
            self._off("Load a model first")
            return
        served = self.worker.served
        if served is None:  # a remote engine: it is a server already
            self._off(REMOTE_NOTE)
            return
        try:
            server = LocalServer(served, port=self.port.value(), defaults=self.defaults, lock=self.worker.gen_lock)
            server.start()
        except EngineError as e:
            self._off(f"Not serving: {e}")
            return
        self.server = server
        self.port.setEnabled(False)
        self.url.setText(server.url)
        self.timer.start()
        self.refresh()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.timer.stop()
        self.port.setEnabled(True)
        self.url.setText("Off")

    def _off(self, message: str) -> None:
        self.switch.blockSignals(True)
        self.switch.setChecked(False)
        self.switch.blockSignals(False)
        self.url.setText(message)

    @Slot()
    def refresh(self) -> None:
        if self.server is None:
            return
        m = self.server.metrics
        self.count.setText(f"{m.requests_finished} finished, {m.running} running, {m.waiting} waiting")

    @Slot(object)
    def _on_loaded(self, info: dict) -> None:
        """The server goes on with a newly loaded local model; a remote engine is not served (switched off)."""
        if self.server is None:
            return
        served = self.worker.served
        if served is not None:
            self.server.set_engine(served)
            return
        self.stop()
        self._off(f"Stopped. {REMOTE_NOTE}")
