"""Screenshot of the app on a remote engine: llama.cpp's own server (xllamacpp, in-process, the embedded model
with draft-mtp and /metrics on 127.0.0.1), connected from the app, three replies with the Metrics tab open.

    python docs/screenshots/remote.py          # needs Xvfb and openbox, and xllamacpp (the test extra)

Saves 1920x1080-{light,dark}-remote-llama-server.png beside this file (via make.py's Xvfb runner).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
QUESTIONS = ("Who made the heaven?", "What is 12 plus 30?", "Hello!", "Count from 3 to 9.",
             "Convert 5 km to metres.", "How many letters are in 'library'?")


def _drive(out: Path, theme: str, tag: str) -> None:
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage

    from app.window import TABS
    from engine.remote import RemoteConfig
    from make import open_window
    from tests.remote_stub import llama_server

    server = llama_server()
    app, win, data, wait = open_window(theme)
    wait(lambda: win.model_info is not None and win.loading is None)
    win.connect_remote(RemoteConfig(server.listening_address, name="llama-server (draft-mtp)"))
    wait(lambda: win.loading is None)
    if not win.model_info.remote:
        raise SystemExit(f"screenshots: could not connect: {win.errors[-1:]}")
    win.tabs.setCurrentIndex(TABS.index("Metrics"))
    win.settings_panel.max_tokens.setValue(48)
    for q in QUESTIONS:
        win.prompt.setPlainText(q)
        win.send()
        wait(lambda: not win.generating)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # a few ticks of the chart timer
        app.processEvents()
        time.sleep(0.01)
    if not (win.metrics.c_acc.has_data and win.metrics.c_depth.has_data):
        raise SystemExit("screenshots: the acceptance charts are empty")
    # light: the Metrics tab scrolled to the mean accepted length and acceptance by depth; dark: its top (the
    # summary naming the figures' source, and the per-reply speed bars)
    if theme == "light":
        win.tabs.currentWidget().verticalScrollBar().setValue(win.metrics.c_len.y())
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.01)
    img = QGuiApplication.primaryScreen().grabWindow(0).toImage()
    img = img.convertToFormat(QImage.Format.Format_Indexed8, Qt.ImageConversionFlag.ThresholdDither)
    img.save(str(out / f"{tag}-{theme}-remote-llama-server.png"))
    win.close()
    del server
    shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--drive", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--theme", default="light", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT), str(HERE)]
    if args.drive:
        _drive(args.drive, args.theme, args.tag)
        return
    from make import _run_one

    for tool in ("Xvfb", "openbox"):
        if shutil.which(tool) is None:
            raise SystemExit(f"screenshots: {tool} is needed (Debian: apt-get install xvfb openbox)")
    for display, theme in ((120, "light"), (121, "dark")):
        _run_one(1920, 1080, theme, display, args.out, script=__file__)
        print(f"screenshots: remote {theme} done")


if __name__ == "__main__":
    main()
