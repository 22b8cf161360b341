"""`foretell`: the desktop app. `foretell --smoke-test` opens the real window, sends one prompt, waits for
the reply, saves a screenshot and exits 0 (non-zero on any failure)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="foretell", description="Foretell: local chat with Qwen3.5/3.6 GGUF models")
    ap.add_argument("model", nargs="?", help="GGUF file to open (default: the embedded model)")
    ap.add_argument("--smoke-test", action="store_true", help="send one prompt, wait for the reply, exit")
    ap.add_argument("--prompt", default="Hello! What can you do?")
    ap.add_argument("--screenshot", help="save a screenshot of the window here (smoke test)")
    ap.add_argument("--data-dir", help="keep conversations and settings here instead of the user data dir")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)

    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from app.store import Store
    from app.window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Foretell")
    if args.data_dir:
        d = Path(args.data_dir)
        d.mkdir(parents=True, exist_ok=True)
        store, qs = Store(d / "conversations.sqlite3"), QSettings(str(d / "settings.ini"), QSettings.Format.IniFormat)
    else:
        store, qs = Store(), QSettings("Foretell", "Foretell")
    win = MainWindow(store, qs, args.model)
    win.show()
    if not args.smoke_test:
        return app.exec()
    return _smoke(app, win, args.prompt, args.screenshot, args.timeout)


def _smoke(app, win, prompt: str, screenshot: str | None, timeout: float) -> int:  # type: ignore[no-untyped-def]
    def wait(cond, what: str) -> bool:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            app.processEvents()
            if win.errors:
                print(f"smoke test: error while {what}: {win.errors[-1]}", file=sys.stderr)
                return False
            if cond():
                return True
            time.sleep(0.01)
        print(f"smoke test: timed out while {what}", file=sys.stderr)
        return False

    if not wait(lambda: win.model_info is not None, "loading the model"):
        return 2
    win.prompt.setPlainText(prompt)
    win.send()
    if not wait(lambda: win.generating, "starting") or not wait(lambda: not win.generating, "generating"):
        return 3
    reply = win.chat.last_reply()
    end = time.monotonic() + 0.4  # a few ticks of the 100 ms chart timer, so the screenshot shows the charts
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)
    if screenshot:
        win.grab().save(screenshot)
    print(f"smoke test: {len(reply)} characters of reply; stats: {win.last_stats}")
    from engine.ops import default_backend

    print(f"smoke test: kernels: {default_backend().name}")  # the native library travelled with the frozen app
    print(f"smoke test reply: {reply[:500]!r}")
    ok = bool(reply.strip()) and not win.errors
    win.close()
    return 0 if ok else 4


if __name__ == "__main__":
    raise SystemExit(main())
