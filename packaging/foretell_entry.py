"""Entry point of the frozen app: PyInstaller runs this file as `__main__` and it starts `app.main.main`.

With FORETELL_STARTUP_TRACE=1 it also prints start-up milestones to stderr, one line each, as
`startup-trace: <milestone> <seconds since this script started>`: `imports` (Qt, torch and the app
imported), `window-shown` (the main window is visible) and `model-loaded` (the model is ready to chat).
bench/packaging.py reads them; without the variable nothing changes.
"""
from __future__ import annotations

import os
import sys
import time

T0 = time.monotonic()


def _trace(milestone: str) -> None:
    print(f"startup-trace: {milestone} {time.monotonic() - T0:.3f}", file=sys.stderr, flush=True)


def _install_trace() -> None:
    """Create the QApplication early (app.main.main reuses an existing one) and poll the main window
    from a timer, which runs inside the app's own event processing."""
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    import app.window  # noqa: F401 (the heavy imports: torch, the engine, pyqtgraph)

    _trace("imports")
    qapp = QApplication.instance() or QApplication(sys.argv[:1])
    seen: set[str] = set()

    def poll() -> None:
        for w in qapp.topLevelWidgets():
            if type(w).__name__ != "MainWindow" or not w.isVisible():
                continue
            if "window-shown" not in seen:
                seen.add("window-shown")
                _trace("window-shown")
            if getattr(w, "model_info", None) is not None and "model-loaded" not in seen:
                seen.add("model-loaded")
                _trace("model-loaded")
                timer.stop()

    timer = QTimer(qapp)
    timer.setInterval(5)
    timer.timeout.connect(poll)
    timer.start()
    _install_trace.timer = timer  # type: ignore[attr-defined]  # keep the timer alive


if __name__ == "__main__":
    if os.environ.get("FORETELL_STARTUP_TRACE") == "1":
        _install_trace()
    from app.main import main

    raise SystemExit(main())
