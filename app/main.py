"""`foretell`: the desktop app. `foretell --smoke-test` opens the real window, sends one prompt, waits for
the reply, saves a screenshot and exits 0 (non-zero on any failure: 2 with a message when the model cannot be
loaded). A conversation store that is damaged, read-only or cannot be created opens a dialog (move the damaged
file aside, or run without history); one that another Foretell holds says so and offers to bring that window
forward (app/instance.py) — a second app never runs silently on the same history. The smoke test takes "without
history" and says so."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from app.instance import ask_to_show
from app.store import Store, StoreError, move_aside

# What to do about a store that cannot be opened: "move" (aside, then start a fresh one), "memory" (run without
# history), "show" (the Foretell that holds it comes forward; this one quits) or "quit".
StoreChoice = Callable[[StoreError], str]


def open_store(path: Path | None, choose: StoreChoice) -> Store | None:
    """The store at `path` (None: the user data dir), or what `choose` picks when it cannot be opened."""
    try:
        return Store(path)
    except StoreError as err:
        e = err
    choice = choose(e)
    history = path if path is not None else Store.default_path()
    if choice == "show" and e.kind == "locked":
        if ask_to_show(history):
            return None
        print(f"foretell: no Foretell answered for {history}: another program holds it; running without history",
              file=sys.stderr)
        return Store.in_memory()
    if choice == "move" and e.kind == "damaged":
        try:
            moved = move_aside(history)
            print(f"foretell: the damaged conversation database was moved to {moved}", file=sys.stderr)
            return Store(path)
        except (OSError, StoreError) as e2:
            print(f"foretell: {e2}; running without history", file=sys.stderr)
            return Store.in_memory()
    if choice in ("memory", "move"):
        return Store.in_memory()
    return None


def ask_store(e: StoreError) -> str:
    """The start-up dialog for a store that cannot be opened: what the user chose (a StoreChoice)."""
    from PySide6.QtWidgets import QMessageBox

    from app import dialogs

    dialogs.use_plain_buttons()
    memory_only = "Without history, this session's chats are kept in memory only."
    if e.kind == "locked":
        box = QMessageBox(QMessageBox.Icon.Information, "Foretell is already open",
                          "Foretell is already open with this conversation history. One window at a time can "
                          "use it, so that neither overwrites what the other saved.")
        box.setInformativeText(f"Switch to that window, or open this one without history. {memory_only}")
        box.setDetailedText(str(e))
        choices = {box.addButton("Switch to the open window", QMessageBox.ButtonRole.AcceptRole): "show"}
    else:
        box = QMessageBox(QMessageBox.Icon.Warning, "Conversation history unavailable", dialogs.sentence(str(e)))
        damaged = e.kind == "damaged"
        box.setInformativeText(("The damaged file is renamed, never deleted. " if damaged else "") + memory_only)
        choices = {box.addButton("Move the damaged file aside", QMessageBox.ButtonRole.AcceptRole): "move"} \
            if damaged else {}
    choices[box.addButton("Run without history", QMessageBox.ButtonRole.ActionRole)] = "memory"
    box.addButton("Quit", QMessageBox.ButtonRole.RejectRole)
    box.exec()
    return choices.get(box.clickedButton(), "quit")


def _no_history(e: StoreError) -> str:
    print(f"foretell: {e} Running without history.", file=sys.stderr)
    return "memory"


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

    from app.window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("Foretell")
    choose = _no_history if args.smoke_test else ask_store
    if args.data_dir:
        d = Path(args.data_dir)
        store = open_store(d / "conversations.sqlite3", choose)
        qs = QSettings(str(d / "settings.ini"), QSettings.Format.IniFormat)
    else:
        store, qs = open_store(None, choose), QSettings("Foretell", "Foretell")
    if store is None:
        return 0  # the user chose to quit, or to switch to the Foretell already open
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
        win.close()  # stops the engine thread: returning with it running aborts the process (SIGABRT)
        return 2
    win.prompt.setPlainText(prompt)
    win.send()
    if not wait(lambda: win.generating, "starting") or not wait(lambda: not win.generating, "generating"):
        win.close()
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
