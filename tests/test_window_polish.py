"""Issue 47, items 10-14 and the chat's Markdown, through the real window (offscreen): error dialogs in plain words,
File › Connect to a server…, the Settings tab at both screen sizes, a second app on the same history, Copy's
confirmation, the expert heatmap, code blocks with Copy and readable LaTeX."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QTimer, QUrl
from PySide6.QtGui import QGuiApplication
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QFormLayout, QMessageBox, QStyle

from app.dialogs import PlainButtons
from app.main import ask_store, open_store
from app.remote import MIN_WIDTH, RemoteDialog
from app.window import TABS, MainWindow
from engine.storage.modelfile import default_model_path
from tests.fixtures import TINY_MOE
from tests.remote_stub import Behaviour, Stub
from tests.test_window import _focus, _send, _window


def _error_box(qtbot, win: MainWindow, path: Path) -> QMessageBox:
    n = len(win.errors)
    win.load_model(str(path))
    qtbot.waitUntil(lambda: len(win.errors) > n, timeout=30_000)
    return win.error_box


def test_error_dialogs_speak_plainly_with_the_details_kept(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    cut = tmp_path / "interrupted.gguf"
    cut.write_bytes(default_model_path().read_bytes()[:100_000])  # the file: cut in the vocabulary
    box = _error_box(qtbot, win, cut)
    assert box.text().startswith("The file interrupted.gguf is incomplete") and "download was interrupted" in box.text()
    assert "bytes" not in box.text() and "at byte 99998" in box.detailedText() and "(truncated?)" in box.detailedText()
    assert box.icon() == QMessageBox.Icon.Warning and box.windowTitle() == "Could not open the model"
    ok = box.button(QMessageBox.StandardButton.Ok)
    # The generic Unix theme (X11 without a desktop's) puts an icon on OK; the app's style puts none on any button.
    assert isinstance(win.style(), PlainButtons) and ok.icon().isNull()
    assert win.style().styleHint(QStyle.StyleHint.SH_DialogButtonBox_ButtonsHaveIcons) == 0
    box.close()
    notes = tmp_path / "notes.txt"
    notes.write_text("just some notes")
    box = _error_box(qtbot, win, notes)
    assert box.text() == "The file notes.txt is not a GGUF model file." and box.detailedText() == ""
    assert win.errors[-1] == "notes.txt is not a GGUF model file"  # as the engine said it
    box.close()
    win.show_error("Generation failed", "the server closed the connection")
    assert win.error_box.text() == "The server closed the connection."


def test_connect_to_a_server_has_its_own_entry_and_shows_whole_values(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    file_menu = win.menuBar().actions()[0].menu()
    assert "&Connect to a server…" in [a.text() for a in file_menu.actions()]
    assert not any("Connect" in a.text() for a in win.recent_menu.actions())  # no longer under Open recent
    win.show()
    model = "Qwen3.6-35B-A3B-UD-Q4_K_XL-mtp.gguf"
    with Stub(Behaviour(model=model)) as stub:
        win.connect_action.trigger()
        dlg = next(d for d in win.findChildren(RemoteDialog) if d.isVisible())
        assert dlg.windowTitle() == "Connect to a server" and dlg.width() >= MIN_WIDTH
        dlg.url.setText(stub.url)
        dlg.fetch_btn.click()
        qtbot.waitUntil(lambda: dlg.model.count() == 1, timeout=10_000)
        assert dlg.model.currentText() == model
        box = dlg.model.lineEdit()
        assert box.fontMetrics().horizontalAdvance(model) < box.width()  # the whole name, not "emo.gguf"
        assert dlg.url.fontMetrics().horizontalAdvance(stub.url) < dlg.url.width()
        dlg.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok).click()
        qtbot.waitUntil(lambda: win.loading is None and win.model_info.remote, timeout=30_000)
        assert win.model_info.name.startswith(model)
        assert any(a.text().startswith(f"Remote: {model} @ ") for a in win.recent_menu.actions())


def _rows(win: MainWindow) -> list[tuple[int, int]]:
    """(top, bottom) of each shown settings row and of the Serve switch, in the Settings tab's coordinates."""
    tab = win.tabs.widget(TABS.index("Settings")).widget()
    form = win.settings_panel.form
    fields = [form.itemAt(i, QFormLayout.ItemRole.FieldRole) for i in range(form.rowCount())]
    shown = [f.widget() for f in fields if f is not None and f.widget().isVisible()]
    out = []
    for w in shown + [win.serve_panel.switch]:
        top = w.mapTo(tab, w.rect().topLeft()).y()
        out.append((top, top + w.height()))
    return sorted(out)


def test_settings_fit_1366x768_without_gaps_at_1920x1080(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    win.show_tab(TABS.index("Settings"))
    scroll = win.tabs.currentWidget()
    for w, h in ((1366, 768 - 60), (1920, 1080 - 60)):  # 60 px for a desktop panel and the title bar
        win.resize(w, h)
        win.show()
        qtbot.waitUntil(lambda: win.width() == w and win.height() == h, timeout=3000)
        qtbot.wait(50)
        switch, address = win.serve_panel.switch, win.serve_panel.url
        bottom = address.mapTo(scroll.viewport(), address.rect().bottomLeft()).y()
        assert switch.isVisible() and bottom < scroll.viewport().height(), (w, bottom)  # above the fold
        rows = _rows(win)
        gaps = [b[0] - a[1] for a, b in zip(rows, rows[1:])]
        assert max(gaps) < 40, (w, gaps)  # no row stretched by the spare height (they were ~150 px at 1920)
    # The folded sampling rows say what they hold, and unfold on a click.
    panel = win.settings_panel
    assert panel.sampling_label.text() == "greedy, random seed" and not panel.temperature.isVisible()
    panel.temperature.setValue(0.7)
    assert panel.sampling_label.text() == "temperature 0.7, random seed"
    panel.sampling.click()
    assert panel.temperature.isVisible() and panel.seed.isVisible() and panel.sampling.text() == "Hide"


def _answer(qtbot, button: str, seen: list[QMessageBox]) -> None:
    """Click `button` of the start-up dialog once it is up (it runs its own event loop)."""
    def click() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, click)
            return
        seen.append(box)
        next(b for b in box.buttons() if b.text() == button).click()
    QTimer.singleShot(20, click)


def test_a_second_app_on_the_same_history_says_so_and_brings_the_first_forward(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)  # holds tmp_path/c.db
    win.showMinimized()
    seen: list[QMessageBox] = []
    _answer(qtbot, "Switch to the open window", seen)
    assert open_store(tmp_path / "c.db", ask_store) is None  # this app quits: it never runs beside the first
    box = seen[0]
    assert box.windowTitle() == "Foretell is already open" and "already open with this conversation history" in box.text()
    assert "another program has it open" in box.detailedText()
    assert [b.text() for b in box.buttons()] and {"Run without history", "Quit"} <= {b.text() for b in box.buttons()}
    qtbot.waitUntil(lambda: "this window has the conversation history" in win.statusBar().currentMessage(),
                    timeout=5000)
    assert not win.isMinimized()
    # Or this one runs without history, saying so; the first keeps its own.
    _answer(qtbot, "Run without history", seen)
    second = open_store(tmp_path / "c.db", ask_store)
    assert second is not None and second.path is None and len(seen) == 2
    second.close()


def test_copy_is_confirmed_and_the_expert_map_has_the_models_layers_and_a_scale(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    _focus(qtbot, win)
    win.settings.max_tokens = 8
    win.settings.draft = "2"  # the head drafts (auto may leave a random head asleep): the MTP block routes too
    _send(qtbot, win, "Hello!")
    win.chat.anchorClicked.emit(QUrl("copymsg:0"))  # the message's Copy link
    assert QGuiApplication.clipboard().text() == "Hello!" and win.statusBar().currentMessage() == "Copied"
    win.statusBar().clearMessage()
    QTest.keyClick(win, Qt.Key.Key_C, Qt.KeyboardModifier.ControlModifier | Qt.KeyboardModifier.ShiftModifier)
    assert QGuiApplication.clipboard().text() == win.chat.last_reply() and win.statusBar().currentMessage() == "Copied"
    # The expert map: a row per layer of the model, no more, and a colour bar in percent beside it.
    dock = win.metrics
    qtbot.waitUntil(lambda: dock.c_usage.has_data, timeout=3000)
    layers = TINY_MOE.n_layer  # the window's model
    rows = [str(i) for i in range(layers)] + ["MTP"]  # the MTP block's experts: its own row, named
    assert dock.heat_rows == rows and dock.heat.image.shape[1] == len(rows)
    assert dock.c_usage.plot.getViewBox().viewRange()[1] == [0, len(rows)]  # rows 0-9 showed for 8 layers
    assert dock.heat_bar.getAxis("left").labelText == "share of the layer's expert choices (%)"
    low, high = dock.heat_bar.levels()
    assert low == 0 and high >= float(dock.heat.image.max()) and high % 5 == 0


REPLY = r"""Two ways:

```python
print("one")
```

```bash
echo two
```

Euler: $e^{i\pi} + 1 = 0$, and $a_1 * b_2 * c_3$ stays whole.

$$\int_0^1 x^2 \, dx = \frac{1}{3}$$

Inline \( \alpha_i * \beta_j \) too; a price of $5 and $6 is text."""


def test_code_blocks_each_have_copy_and_latex_stays_readable(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    conv = win.store.new_conversation("Maths")
    win.store.add_message(conv.id, "user", "Show me")
    win.store.add_message(conv.id, "assistant", REPLY)
    win.open_conversation(conv.id)
    shown = win.chat.toPlainText()
    for source in (r"$e^{i\pi} + 1 = 0$", "$a_1 * b_2 * c_3$", r"$$\int_0^1 x^2 \, dx = \frac{1}{3}$$",
                   r"\( \alpha_i * \beta_j \)", "a price of $5 and $6 is text."):
        assert source in shown, source  # as written: no backslash, * or _ taken by the Markdown
    assert "```" not in shown and shown.count("Copy") == 4  # two messages' Copy links, one per code block
    win.chat.anchorClicked.emit(QUrl("copy:1"))
    assert QGuiApplication.clipboard().text() == "echo two\n" and win.statusBar().currentMessage() == "Copied"
    win.chat.anchorClicked.emit(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == 'print("one")\n'
