"""Screenshots of the real app on a real X server (Xvfb) with a window manager (openbox), at 1366×768 and
1920×1080, light and dark: first run, during streaming, after four replies (MTP off, fixed depth, auto), a
regenerated reply (two versions) with the model library, a non-model file refused, a long prompt processed, a
message too long for the context refused, the context nearly full, the oldest messages left out, and File › Get
models mid-download (from a local server in the Hub's layout).

    python docs/screenshots/make.py            # needs Xvfb and openbox (Debian: apt-get install xvfb openbox)

Each screen size and theme runs in its own X server; the app is maximised by the window manager, replies come
from the embedded model, and the whole screen (window decorations included) is saved as an 8-bit PNG.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SIZES = ((1366, 768), (1920, 1080))
THEMES = ("light", "dark")
QUESTIONS = (("off", "What is 12 plus 30?"), ("3", "Count from 3 to 9."), ("auto", "Convert 5 km to metres."))
STREAMED = "Hello!"  # the demo model's longest answer
LONG_PROMPT = "Please read these notes. " + " ".join(f"Note {i}: the meeting is on day {i}." for i in range(150))
HUGE_PROMPT = "Please read these notes. " + " ".join(f"Note {i}: the meeting is on day {i}." for i in range(300))
NOTES = "Please remember these notes. " + " ".join(f"Note {i}: the meeting is on day {i}." for i in range(45))
MATHS_REPLY = r"""Compute it exactly, then check it numerically:

$$\int_0^1 x^2 \, dx = \left[ \frac{x^3}{3} \right]_0^1 = \frac{1}{3}$$

```python
from scipy.integrate import quad
print(quad(lambda x: x**2, 0, 1))  # (0.333..., error estimate)
```

```bash
python -c "print(1/3)"
```

The midpoint rule with $n$ steps errs by about $\frac{1}{12 n^2}$ here, so \( n = 100 \) gives 4 correct digits."""
STREAM_AT = 6  # tokens into the reply: the screen is grabbed from the token handler while the worker goes on


def open_window(theme: str):  # type: ignore[no-untyped-def]
    """Inside the X server: the app maximised on a fresh store and settings; (app, window, data folder, wait),
    where wait(cond, timeout) runs the event loop until cond() holds."""
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from app.store import Store
    from app.window import MainWindow

    app = QApplication(sys.argv[:1])
    app.setApplicationName("Foretell")
    data = Path(tempfile.mkdtemp(prefix="foretell-shots-"))
    qs = QSettings(str(data / "settings.ini"), QSettings.Format.IniFormat)
    qs.setValue("theme", theme)
    win = MainWindow(Store(data / "c.sqlite3"), qs)
    win.showMaximized()

    def wait(cond, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise SystemExit(f"screenshots: timed out ({win.state_label.text()})")
            app.processEvents()
            time.sleep(0.01)

    return app, win, data, wait


def _drive(out: Path, theme: str, tag: str) -> None:
    """Inside the X server: run the window, ask, and grab the screen at each stage."""
    from PySide6.QtCore import QObject, Qt, QTimer, QUrl, Slot
    from PySide6.QtGui import QGuiApplication, QImage
    from PySide6.QtWidgets import QApplication, QMessageBox

    from app.window import TABS
    from engine.storage.modelfile import default_model_path

    app, win, data, wait = open_window(theme)

    def settle(s: float = 0.6) -> None:
        end = time.monotonic() + s
        while time.monotonic() < end:
            app.processEvents()
            time.sleep(0.01)

    def shot(stage: str) -> None:
        img = QGuiApplication.primaryScreen().grabWindow(0).toImage()
        img = img.convertToFormat(QImage.Format.Format_Indexed8, Qt.ImageConversionFlag.ThresholdDither)
        img.save(str(out / f"{tag}-{theme}-{stage}.png"))

    wait(lambda: win.model_info is not None)
    settle(1.0)
    shot("welcome")
    win.tabs.setCurrentIndex(TABS.index("Metrics"))
    for draft, q in QUESTIONS:
        win.settings_panel.mtp.setChecked(draft != "off")
        if draft != "off":
            win.settings_panel.draft.setCurrentText(draft)
        win.prompt.setPlainText(q)
        win.send()
        wait(lambda: not win.generating)
    tokens: list[str] = []

    class StreamShot(QObject):
        """Grabs the screen a few tokens into the reply, on the GUI thread (a QObject's slot: queued)."""

        @Slot(str, bool)
        def on_token(self, text: str, _accepted: bool) -> None:
            tokens.append(text)
            if len(tokens) == STREAM_AT and win.generating:
                win.chat.flush()
                win.repaint()  # painted and flushed to the X server now, not on the next event-loop pass
                shot("streaming")

        @Slot(int, int)
        def on_prefill(self, done: int, total: int) -> None:
            if 0 < done < total and not prefills:
                prefills.append(done)
                app.processEvents()  # lay out the status bar's new text (this slot runs before the next pass)
                win.repaint()
                shot("prefill")

    prefills: list[int] = []
    grabber = StreamShot()
    win.engine.worker.token.connect(grabber.on_token)
    win.engine.worker.prefill.connect(grabber.on_prefill)
    win.prompt.setPlainText(STREAMED)
    win.send()
    wait(lambda: not win.generating)
    if len(tokens) < STREAM_AT:
        raise SystemExit(f"screenshots: the streamed reply had only {len(tokens)} tokens")
    settle()
    shot("after")
    # A second version of the last reply (‹ 2/2 ›), with the Model tab (the library) open.
    win.regenerate()
    wait(lambda: not win.generating)
    win.tabs.setCurrentIndex(TABS.index("Model"))
    settle()
    shot("versions-library")
    # A file that is not a model, and a model file cut short (an interrupted download): refused in plain words (the
    # reader's message under Show details), the loaded model kept.
    notes, cut = data / "notes.txt", data / "Qwen3.5-2B-Q4_K_M.gguf"
    notes.write_text("just some notes")
    cut.write_bytes(default_model_path().read_bytes()[:100_000])
    for path, stage in ((notes, "not-a-model"), (cut, "incomplete-file")):
        n = len(win.errors)
        win.load_model(str(path))
        wait(lambda n=n: len(win.errors) > n)
        settle()
        shot(stage)
        for box in win.findChildren(QMessageBox):
            box.close()
    # The expert map (bottom of the Metrics tab): the model's layers, the MTP block's row, a colour bar in %.
    win.tabs.setCurrentIndex(TABS.index("Metrics"))
    settle()  # the tab lays its charts out first: the bar's range grows
    bar = win.tabs.currentWidget().verticalScrollBar()
    bar.setValue(bar.maximum())
    settle(0.3)
    shot("expert-map")
    # Markdown: code blocks with their own Copy (one just copied), LaTeX as its source.
    conv = win.store.new_conversation("Integrals")
    win.store.add_message(conv.id, "user", "How do I check the integral of x² from 0 to 1?")
    win.store.add_message(conv.id, "assistant", MATHS_REPLY)
    win.open_conversation(conv.id)
    win.refresh_conversations()
    win.chat.anchorClicked.emit(QUrl("copy:0"))
    settle()
    shot("markdown-latex")
    # File › Connect to a server…, the models fetched from a stand-in server.
    from tests.remote_stub import Behaviour, Stub

    with Stub(Behaviour(model="Qwen3.6-35B-A3B-UD-Q4_K_XL-mtp.gguf")) as stub:
        dlg = win.remote_dialog()
        dlg.url.setText(stub.url)
        dlg.name.setText("GPU box")
        dlg.fetch_btn.click()
        wait(lambda: dlg.model.count() > 0)
        settle()
        shot("connect-server")
        dlg.reject()
    # A second Foretell on the same history: the start-up dialog over the first window.
    from app.main import ask_store, open_store

    def grab_then_quit() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(50, grab_then_quit)
            return
        settle()
        shot("second-instance")
        next(b for b in box.buttons() if b.text() == "Quit").click()

    QTimer.singleShot(50, grab_then_quit)
    if open_store(data / "c.sqlite3", ask_store) is not None:
        raise SystemExit("screenshots: a second store opened on the same history")
    # A long prompt: "Processing prompt … n/N" with its progress bar before the first token.
    win.settings_panel.max_tokens.setValue(8)
    win.prompt.setPlainText(LONG_PROMPT)
    win.send()
    wait(lambda: not win.generating)
    if not prefills:
        raise SystemExit("screenshots: no prefill progress was reported for the long prompt")
    # A message that can never fit (~5,000 tokens in a 4,096-token context): refused before it is stored.
    n = len(win.errors)
    win.prompt.setPlainText(HUGE_PROMPT)
    win.send()
    if len(win.errors) == n or win.generating:
        raise SystemExit("screenshots: the message too long for the context was not refused")
    settle()
    shot("long-refused")
    for box in win.findChildren(QMessageBox):
        box.close()
    # The context fills: the meter turns amber, then the oldest exchanges are left out (a line marks where).
    win.settings_panel.max_tokens.setValue(1024)
    win.new_conversation()
    for _ in range(12):
        win.prompt.setPlainText(NOTES)
        win.send()
        wait(lambda: not win.generating)
        if win.session.left_out:
            break
        if "nearly full" in win.context_label.text() and not (out / f"{tag}-{theme}-context-nearly-full.png").exists():
            settle()
            shot("context-nearly-full")
    if not win.session.left_out:
        raise SystemExit("screenshots: the conversation never outgrew the context")
    win.chat.find("no longer sent")
    settle()
    shot("left-out")
    # File › Get models, mid-download (a local server in the Hub's layout: no network).
    from app.hub import HubDownloader
    from tests.hub_stub import BIG, LocalHub

    hub = LocalHub()
    hub.slow.set()
    win.qs.setValue("library/folder", str(data / "models"))  # downloads go to the run's own folder
    dlg = win.get_models(HubDownloader(hub.endpoint))
    dlg.repos.setCurrentRow(1)
    wait(lambda: dlg.file_list.count() > 0)
    dlg.file_list.setCurrentRow([f.name for f in dlg.files].index(BIG))
    dlg.download_btn.click()
    wait(lambda: dlg.progress_bar.value() > 300)
    shot("get-models")
    dlg.cancel_btn.click()
    wait(lambda: not dlg.busy)
    dlg.close()
    hub.close()
    win.close()
    shutil.rmtree(data, ignore_errors=True)


def _run_one(w: int, h: int, theme: str, display: int, out: Path, script: str = __file__) -> None:
    """`script --drive OUT` inside its own Xvfb + openbox (docs/screenshots/remote.py drives it too)."""
    env = {**os.environ, "DISPLAY": f":{display}", "QT_QPA_PLATFORM": "xcb"}
    env.pop("WAYLAND_DISPLAY", None)
    xvfb = subprocess.Popen(["Xvfb", f":{display}", "-screen", "0", f"{w}x{h}x24", "-nolisten", "tcp"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wm = None
    try:
        time.sleep(1.0)
        wm = subprocess.Popen(["openbox"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        subprocess.run([sys.executable, script, "--drive", str(out), "--theme", theme, "--tag", f"{w}x{h}"],
                       env=env, cwd=ROOT, check=True, timeout=600)
    finally:
        for p in (wm, xvfb):
            if p is not None:
                p.terminate()
                p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--size", action="append", help="WxH instead of the default sizes (repeatable)")
    ap.add_argument("--theme-only", choices=THEMES, help="one theme instead of both")
    ap.add_argument("--drive", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--theme", default="light", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        sys.path.insert(0, str(ROOT))
        _drive(args.drive, args.theme, args.tag)
        return
    for tool in ("Xvfb", "openbox"):
        if shutil.which(tool) is None:
            raise SystemExit(f"screenshots: {tool} is needed (Debian: apt-get install xvfb openbox)")
    args.out.mkdir(parents=True, exist_ok=True)
    display = 90
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.size] if args.size else SIZES
    for w, h in sizes:
        for theme in [args.theme_only] if args.theme_only else THEMES:
            _run_one(w, h, theme, display, args.out)
            display += 1
            print(f"screenshots: {w}x{h} {theme} done")


if __name__ == "__main__":
    main()
