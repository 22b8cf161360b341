"""One app per conversation history. The store lets one process open it (StoreError kind "locked" for a second);
the app that holds it also listens on a local socket named after the history's path, so a second app started
on the same history can ask it to come forward instead of running silently beside it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot
from PySide6.QtNetwork import QLocalServer, QLocalSocket

CONNECT_WAIT_MS = 1000


def socket_name(history: Path) -> str:
    """The local socket of the app that holds `history` (a short name: socket paths are limited to ~100 bytes)."""
    return "foretell-" + hashlib.sha256(str(history.resolve()).encode()).hexdigest()[:16]


class InstanceServer(QObject):
    """Listens for later apps on the same history; each connection asks this one to come forward."""

    showRequested = Signal()

    def __init__(self, history: Path, parent: QObject | None = None):
        super().__init__(parent)
        self.server = QLocalServer(self)
        name = socket_name(history)
        QLocalServer.removeServer(name)  # a socket left by an app that crashed (this one holds the history now)
        self.server.listen(name)
        self.server.newConnection.connect(self._on_connection)

    @Slot()
    def _on_connection(self) -> None:
        sock = self.server.nextPendingConnection()
        while sock is not None:
            sock.disconnectFromServer()
            sock.deleteLater()
            self.showRequested.emit()
            sock = self.server.nextPendingConnection()

    def close(self) -> None:
        self.server.close()


def ask_to_show(history: Path) -> bool:
    """Ask the app that holds `history` to come forward; False where none answers (another program has it)."""
    sock = QLocalSocket()
    sock.connectToServer(socket_name(history))
    if not sock.waitForConnected(CONNECT_WAIT_MS):
        return False
    sock.disconnectFromServer()
    return True
