"""The main window end to end (offscreen): chat, stop, regenerate, edit, persistence, errors, smoke test."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QSettings, Qt, QUrl, Slot
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication

from app.store import Store
from app.window import MainWindow
from engine.chat import Message
from tests.fixtures import TINY_MOE, fixture_path


def _window(qtbot, tmp_path: Path, model: str | None = None) -> MainWindow:
    store = Store(tmp_path / "c.db")
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win = MainWindow(store, qs, model or str(fixture_path(TINY_MOE)))
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.model_info is not None or bool(win.errors), timeout=30_000)
    return win


def _send(qtbot, win: MainWindow, text: str) -> None:
    win.prompt.setPlainText(text)
    win.send()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)


def _focus(qtbot, win: MainWindow) -> None:
    win.show()
    win.activateWindow()
    qtbot.waitUntil(win.isActiveWindow, timeout=5000)


def test_edit_and_regenerate_make_versions_and_nothing_is_lost(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    _focus(qtbot, win)
    assert win.model_info.architecture == "qwen35moe" and "qwen35moe" in win.info.text()
    win.settings.max_tokens = 16
    _send(qtbot, win, "Hello there")
    msgs = win.store.messages(win.conv_id)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].stats["tokens"] >= 1
    assert "tok/s" in win.chat.toPlainText() and win.conv_list.count() == 1
    first = msgs[1]
    win.search.setFocus()
    win.regenerate()
    assert QApplication.focusWidget() is win.prompt  # typing next goes to the message box, not the search
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    msgs = win.store.messages(win.conv_id)
    assert len(msgs) == 2 and msgs[1].id != first.id and msgs[1].content == first.content  # greedy: same text
    assert win.store.versions(msgs[1].id) == [first.id, msgs[1].id] and "‹ 2/2 ›" in win.chat.toPlainText()
    assert QApplication.focusWidget() is win.prompt
    # Back to version 1 of the reply, and forward again.
    win.chat._on_anchor(QUrl("ver:1:-1"))
    assert win.store.messages(win.conv_id)[1].id == first.id and "1/2" in win.chat.toPlainText()
    win.chat._on_anchor(QUrl("ver:1:1"))
    assert win.store.messages(win.conv_id)[1].id == msgs[1].id
    _send(qtbot, win, "Second question")
    assert len(win.store.messages(win.conv_id)) == 4
    # Edit the first question: nothing is removed until Send, and Cancel leaves everything as it was.
    win.chat._on_anchor(QUrl("edit:0"))
    assert win.prompt.toPlainText() == "Hello there" and len(win.store.messages(win.conv_id)) == 4
    assert win.edit_banner.isVisibleTo(win)
    win.cancel_edit()
    assert win.prompt.toPlainText() == "" and not win.edit_banner.isVisibleTo(win)
    win.chat._on_anchor(QUrl("edit:0"))
    win.prompt.setPlainText("Hello again")
    win.send()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    now = win.store.messages(win.conv_id)
    assert [m.content for m in now][0] == "Hello again" and len(now) == 2
    assert len(win.store.versions(now[0].id)) == 2 and "‹ 2/2" in win.chat.toPlainText()
    win.chat._on_anchor(QUrl("ver:0:-1"))  # the old branch, with its second question, is all there
    old = [m.content for m in win.store.messages(win.conv_id)]
    assert old[0] == "Hello there" and old[2] == "Second question" and len(old) == 4
    win.chat._on_anchor(QUrl("copymsg:2"))
    assert QGuiApplication.clipboard().text() == "Second question"
    conv = win.conv_id
    win.close()
    # Restart: the last model and the last conversation are reopened.
    store = Store(tmp_path / "c.db")
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win2 = MainWindow(store, qs)  # no model named
    qtbot.addWidget(win2)
    qtbot.waitUntil(lambda: win2.model_info is not None or bool(win2.errors), timeout=30_000)
    assert win2.model_info.path == str(fixture_path(TINY_MOE)) and win2.conv_id == conv
    assert "Second question" in win2.chat.toPlainText() and win2.conv_list.count() == 1


def test_stopped_replies_are_kept_and_marked(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    win.settings.max_tokens = 4000
    win.engine.worker.engine.tokenizer.eog_ids = frozenset()
    win.prompt.setPlainText("Go on forever")
    win.send()
    qtbot.waitUntil(lambda: len(win.chat.messages[-1].text) > 20, timeout=30_000)
    win.stop()
    qtbot.waitUntil(lambda: not win.generating, timeout=10_000)
    last = win.store.messages(win.conv_id)[-1]
    assert last.role == "assistant" and last.stats["stop_reason"] == "stopped" and last.stats["tokens"] < 4000
    assert "stopped by you" in win.chat.toPlainText()
    # Stopped before any text: the empty reply is kept and says so.
    win.engine.worker.stop_flag.set()
    win.engine.worker.stop_flag.clear = lambda: None  # the next generate starts already stopped
    win.prompt.setPlainText("And again")
    win.send()
    qtbot.waitUntil(lambda: not win.generating, timeout=10_000)
    last = win.store.messages(win.conv_id)[-1]
    assert last.role == "assistant" and last.content == "" and last.stats["stop_reason"] == "stopped"
    assert "Stopped before any text" in win.chat.toPlainText()


def test_a_bad_file_keeps_the_loaded_model(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    title, info = win.windowTitle(), win.model_info
    notes = tmp_path / "notes.txt"
    notes.write_text("just some notes")
    for bad, why in ((notes, "notes.txt is not a GGUF model file"),
                     (tmp_path / "missing.gguf", "missing.gguf was not found")):
        n = len(win.errors)
        win.load_model(str(bad))
        assert not win.send_btn.isEnabled()  # nothing is sent while a load is under way
        qtbot.waitUntil(lambda: len(win.errors) > n, timeout=30_000)
        assert win.errors[-1].startswith(why) and "b'" not in win.errors[-1]
        assert win.model_info is info and win.windowTitle() == title and win.send_btn.isEnabled()
        assert not win.progress.isVisible() and "kept" in win.state_label.text()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    n = len(win.errors)
    win.load_model(str(broken))
    qtbot.waitUntil(lambda: len(win.errors) > n, timeout=30_000)
    assert "Traceback" not in win.errors[-1] and win.model_info is info and win.engine.worker.engine is not None
    # A dropped picture gets the same answer.
    from PySide6.QtCore import QMimeData, QPointF
    from PySide6.QtGui import QDropEvent

    png = tmp_path / "photo.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 16)
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(png))])
    n = len(win.errors)
    win.dropEvent(QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.NoButton,
                             Qt.KeyboardModifier.NoModifier))
    qtbot.waitUntil(lambda: len(win.errors) > n, timeout=30_000)
    assert win.errors[-1] == "photo.png is not a GGUF model file" and win.model_info is info
    win.settings.max_tokens = 4
    _send(qtbot, win, "still works?")
    assert win.store.messages(win.conv_id)[-1].role == "assistant"


def test_no_model_at_all_leaves_the_app_usable(qtbot, tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    win = _window(qtbot, tmp_path, str(bad))
    assert win.errors and "Traceback" not in win.errors[0] and win.model_info is None
    assert not win.send_btn.isEnabled() and win.state_label.text() == "No model loaded"
    win.load_model(str(fixture_path(TINY_MOE)))
    qtbot.waitUntil(lambda: win.model_info is not None, timeout=30_000)
    assert win.send_btn.isEnabled() and win.windowTitle().startswith("Foretell — ")


def test_layout_fits_1366x768_and_panels_come_back(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    hint = win.minimumSizeHint()
    assert hint.width() <= 1024 and hint.height() <= 640, hint
    for w, h in ((1366, 768 - 60), (1024, 640)):  # 60 px for a desktop panel and the title bar
        win.resize(w, h)
        win.show()
        qtbot.waitUntil(lambda: win.width() == w and win.height() == h, timeout=3000)
        for widget in (win.send_btn, win.prompt, win.chat, win.conv_list, win.tabs):
            r = widget.rect()
            top_left = widget.mapTo(win, r.topLeft())
            bottom_right = widget.mapTo(win, r.bottomRight())
            assert widget.isVisible() and top_left.x() >= 0 and top_left.y() >= 0, widget
            assert bottom_right.x() < w and bottom_right.y() < h, (widget, bottom_right)
        assert win.chat.height() >= 200
    view = [a.text() for a in win.view_menu.actions()]
    assert "Conversations" in view and "Panel" in view and "Settings" in view and "Metrics" in view
    win.panel.close()
    assert not win.panel.isVisible()
    win.tab_actions["Metrics"].trigger()
    assert win.panel.isVisible() and win.tabs.tabText(win.tabs.currentIndex()) == "Metrics"
    win.sidebar.toggleViewAction().trigger()
    assert not win.sidebar.isVisible()
    win.close()  # the layout is remembered
    win2 = _window(qtbot, tmp_path)
    win2.show()
    assert not win2.sidebar.isVisible() and win2.tabs.tabText(win2.tabs.currentIndex()) == "Metrics"
    win2.reset_layout_action.trigger()
    assert win2.sidebar.isVisible() and win2.panel.isVisible()


def test_welcome_status_prefill_delete_undo_and_export(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    text = win.chat.toPlainText()
    assert "Welcome to Foretell" in text and "What is 12 plus 30?" in text
    assert win.state_label.text() == "Ready" and win.model_label.text() == win.model_info.name
    assert "context" in win.context_label.text() and win.device_label.text() == "CPU"
    win.settings.max_tokens = 3
    win.chat._on_anchor(QUrl("ask:" + QUrl.toPercentEncoding("What is 12 plus 30?").data().decode()))
    assert win.generating and win.store.messages(win.conv_id)[0].content == "What is 12 plus 30?"
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    foot = win.chat.messages[-1].footer
    assert "tok/s" in foot and "tokens" in foot and "drafts" not in foot
    win.drafts_action.setChecked(True)  # View › Highlight accepted draft tokens
    assert win.chat.color_drafts  # the colouring itself: test_chat_view
    win.drafts_action.setChecked(False)
    assert not win.chat.color_drafts
    # A long prompt: "Processing prompt … n/N" with progress before the first token.
    states: list[str] = []

    class Watch(QObject):  # a receiver on the GUI thread, so the slot runs there after the window's own
        @Slot(int, int)
        def seen(self, _d: int, _t: int) -> None:
            states.append(win.state_label.text())

    watch = Watch()
    win.engine.worker.prefill.connect(watch.seen)
    _send(qtbot, win, " ".join(["words"] * 700))
    qtbot.waitUntil(lambda: len(states) >= 2, timeout=10_000)
    assert any(s.startswith("Processing prompt … ") and "/" in s for s in states), states
    assert "of" in win.context_label.text()
    # Delete, then undo.
    conv = win.conv_id
    win.delete_conversation()
    assert win.conv_list.count() == 0 and win.undo_btn.isVisibleTo(win)
    win.undo_btn.click()
    assert win.conv_list.count() == 1 and win.conv_id == conv and len(win.store.messages(conv)) == 4
    # Export: a default name from the title, the extension added, model and settings recorded.
    assert win.default_export_path().endswith("What-is-12-plus-30.md")
    out = win.export_to(str(tmp_path / "chat"), "JSON (*.json)")
    data = json.loads(out.read_text())
    assert out.name == "chat.json" and data["model"] == win.model_info.name
    assert data["settings"]["mtp"] == "auto" and data["messages"][1]["stats"]["mtp"] in ("auto", "off")
    md = win.export_to(str(tmp_path / "chat"), "Markdown (*.md)")
    assert md.name == "chat.md" and "**Model:**" in md.read_text()


def test_settings_persist_and_apply(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    win.settings_panel.draft.setCurrentText("2")
    win.settings_panel.mtp.setChecked(False)
    win.close()
    win2 = _window(qtbot, tmp_path)
    assert win2.settings.draft == "2" and win2.settings.mtp is False
    assert win2.settings.generation_config().mtp is False and win2.settings_panel.draft.currentText() == "2"


def test_smoke_test_subprocess(tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    # No model argument: the embedded default model, which answers (greedy, the default settings).
    r = subprocess.run([sys.executable, "-m", "app.main", "--smoke-test", "--data-dir", str(tmp_path / "data"),
                        "--screenshot", str(shot), "--prompt", "What is 12 plus 30?"],
                       capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 10_000
    reply = r.stdout.split("smoke test reply:", 1)[1]
    assert "42" in reply, r.stdout[-1000:]
    r2 = subprocess.run([sys.executable, "-m", "app.main", str(tmp_path / "missing.gguf"), "--smoke-test",
                         "--data-dir", str(tmp_path / "data2"), "--timeout", "30"],
                        capture_output=True, text=True, timeout=120,
                        env={**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen"})
    assert r2.returncode != 0 and "error" in r2.stderr


def test_a_last_model_that_no_longer_opens_falls_back_to_the_embedded_one(qtbot, tmp_path: Path) -> None:
    from engine.storage.modelfile import default_model_path

    bad = tmp_path / "was-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    qs.setValue("recent_models", [str(bad)])
    qs.sync()
    win = MainWindow(Store(tmp_path / "c.db"), qs)  # no model named: the last one, which now fails
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.model_info is not None, timeout=60_000)
    assert Path(win.model_info.path) == default_model_path() and not win.errors
    assert "Could not reopen was-a-model.gguf" in win.statusBar().currentMessage()


def test_model_library_tab_lists_and_opens(qtbot, tmp_path: Path) -> None:
    from engine.storage.modelfile import default_model_path

    win = _window(qtbot, tmp_path)
    win.show()
    assert win.library.list.count() == 0  # not scanned while the tab is hidden
    win.qs.setValue("library/folder", str(default_model_path().parent))
    win.tab_actions["Model"].trigger()
    assert win.library.list.count() == 2  # the embedded model in the folder, then the recent fixture
    assert win.library.list.item(0).text().startswith("foretell-demo\n")
    win.library.list.setCurrentRow(0)
    win.library.open_btn.click()
    qtbot.waitUntil(lambda: win.model_info is not None and win.model_info.name == "foretell-demo", timeout=60_000)
    assert win.windowTitle() == "Foretell — foretell-demo" and win.model_label.text() == "foretell-demo"


def test_loading_shows_a_cancel_button_and_cancel_keeps_the_model(qtbot, tmp_path: Path) -> None:
    from tests.fixtures import KQUANT_MOE

    win = _window(qtbot, tmp_path)
    name, n_errors = win.model_info.name, len(win.errors)
    assert not win.cancel_load_btn.isVisibleTo(win)
    win.load_model(str(fixture_path(KQUANT_MOE)))
    assert win.cancel_load_btn.isVisibleTo(win) and win.progress.isVisibleTo(win)
    win.stop_or_cancel()  # Esc while loading cancels the load
    qtbot.waitUntil(lambda: win.loading is None, timeout=30_000)
    qtbot.waitUntil(lambda: win.state_label.text().startswith("Loading cancelled"), timeout=30_000)
    assert win.state_label.text() == f"Loading cancelled — kept {name}"
    assert win.model_info.name == name and len(win.errors) == n_errors  # no error dialog for a cancel
    assert not win.cancel_load_btn.isVisibleTo(win) and not win.progress.isVisibleTo(win)


def test_a_long_message_is_refused_and_old_turns_are_left_out(qtbot, tmp_path: Path) -> None:
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    qs.setValue("context", 512)
    qs.setValue("max_tokens", 8)
    qs.sync()
    win = _window(qtbot, tmp_path)
    assert win.model_info.context == 512 and win.context_label.text() == "context 512 tokens"
    count = win.session.counter.count
    # ~5,000 tokens: refused before it is stored, the text kept in the box, the next message answered.
    huge = "Please read these notes. " + " ".join(f"Note {i}: the meeting is on day {i}." for i in range(300))
    assert count([Message("user", huge)]) > 5000
    win.prompt.setPlainText(huge)
    win.send()
    assert not win.generating and win.conv_id is None and win.store.conversations() == []
    assert "holds 512 tokens" in win.errors[-1] and win.prompt.toPlainText() == huge
    win.prompt.clear()
    _send(qtbot, win, "Hello!")
    assert win.store.messages(win.conv_id)[-1].role == "assistant" and "left out" not in win.chat.toPlainText()
    # Messages that fill the context: the meter turns amber, then the oldest exchanges are left out and said so.
    chunk = " ".join(f"item {i}" for i in range(27))
    assert 180 < count([Message("user", chunk)]) < 200
    _send(qtbot, win, chunk)
    _send(qtbot, win, chunk)
    assert "nearly full" in win.context_label.text() and "#c77700" in win.context_label.styleSheet()
    _send(qtbot, win, chunk)
    last = win.store.messages(win.conv_id)[-1]
    assert last.role == "assistant" and last.stats["left_out"] >= 2 and last.stats["stop_reason"] != "context_overflow"
    assert "oldest message" in win.chat.messages[-1].footer and not win.errors[1:]
    shown = win.chat.toPlainText()
    divider = shown.index("are no longer sent to the model")
    assert shown.index(chunk) < divider < shown.rindex(chunk)  # above it: what was left out
    assert win.chat.context_start == last.stats["left_out"]
    assert len(win.store.messages(win.conv_id)) == 8  # nothing was deleted
    _send(qtbot, win, "Hello!")  # and the conversation goes on
    assert win.store.messages(win.conv_id)[-1].role == "assistant" and len(win.errors) == 1
    # Delete one message (its Delete link), the meter follows; Undo brings it back.
    before = win.context_label.text()
    win.chat._on_anchor(QUrl("del:6"))
    assert len(win.store.messages(win.conv_id)) == 9 and win.context_label.text() != before
    assert win.undo_btn.isVisibleTo(win) and win.statusBar().currentMessage() == "Deleted a message"
    win.undo_btn.click()
    assert len(win.store.messages(win.conv_id)) == 10 and win.context_label.text() == before


def test_metrics_compare_only_measured_replies_of_this_model(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    win.engine.worker.engine.tokenizer.eog_ids = frozenset()
    win.settings_panel.max_tokens.setValue(8)
    _send(qtbot, win, "Hello!")  # auto, 8 tokens: too short to say anything of
    win.metrics.refresh()
    assert "too short to compare" in win.metrics.summary.text() and "vs MTP off" not in win.metrics.summary.text()
    win.settings_panel.max_tokens.setValue(40)
    win.settings_panel.draft.setCurrentText("2")
    _send(qtbot, win, "Count on")
    win.metrics.refresh()
    assert "no MTP-off reply yet to compare with" in win.metrics.summary.text()
    win.settings_panel.mtp.setChecked(False)
    _send(qtbot, win, "And on")
    win.metrics.refresh()
    k2, off = win.metrics.replies[1], win.metrics.replies[2]
    assert (k2.mode, off.mode, k2.tokens, off.tokens) == ("K=2", "off", 40, 40)
    assert k2.engine == off.engine == win.model_info.engine
    label = win.metrics.bar_labels[1].textItem.toPlainText()
    assert label == f"×{k2.tok_s / off.tok_s:.1f}\nK=2" and win.metrics.ref_line.value() == off.tok_s


def test_export_suggests_documents_only_where_it_exists(qtbot, tmp_path: Path, monkeypatch) -> None:
    import os

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.chdir(tmp_path)  # the folder the app was started from: never suggested
    win = _window(qtbot, tmp_path)
    win.settings_panel.max_tokens.setValue(2)
    _send(qtbot, win, "What is 12 plus 30?")
    assert Path(win.default_export_path()) == home / "What-is-12-plus-30.md" and os.getcwd() == str(tmp_path)
    (home / "Documents").mkdir()
    assert Path(win.default_export_path()) == home / "Documents" / "What-is-12-plus-30.md"


def test_tab_leaves_the_message_box_and_the_shortcuts_are_listed(qtbot, tmp_path: Path) -> None:
    from PySide6.QtTest import QTest

    win = _window(qtbot, tmp_path)
    _focus(qtbot, win)
    win.prompt.setFocus()
    QTest.keyClicks(win.prompt, "Hi")
    QTest.keyClick(win.prompt, Qt.Key.Key_Tab)
    assert win.prompt.toPlainText() == "Hi" and QApplication.focusWidget() is win.send_btn
    QTest.keyClick(win.send_btn, Qt.Key.Key_Backtab, Qt.KeyboardModifier.ShiftModifier)
    assert QApplication.focusWidget() is win.prompt
    assert "&Help" in [a.text() for a in win.menuBar().actions()]
    win.shortcuts_action.trigger()
    text = win.shortcuts_dialog.table.text()
    for keys, what in (("Enter", "Send the message"), ("Tab / Shift+Tab", "Move to the next"), ("Esc", "Stop the reply"),
                       ("Ctrl+N", "New chat"), ("Ctrl+E", "Export conversation"), ("Ctrl+M", "Metrics"),
                       ("Ctrl+Shift+C", "Copy the last reply"), ("F1", "Keyboard shortcuts")):
        assert f"<b>{keys}</b></td><td>{what}" in text, keys
    win.shortcuts_dialog.close()


def test_undo_beside_its_message_regenerate_and_the_meter_follow_the_conversation(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    win.resize(1366, 708)
    win.show()
    win.settings_panel.max_tokens.setValue(4)
    empty = win.context_label.text()
    assert not win.regen_btn.isEnabled()
    _send(qtbot, win, "What is 12 plus 30?")
    assert win.regen_btn.isEnabled() and win.context_label.text() != empty
    win.new_conversation()
    assert not win.regen_btn.isEnabled() and win.context_label.text() == empty
    win.open_conversation(win.store.conversations()[0].id)
    assert win.regen_btn.isEnabled()
    win.delete_conversation()
    assert not win.regen_btn.isEnabled() and win.context_label.text() == empty
    qtbot.waitUntil(lambda: win.undo_btn.isVisible(), timeout=3000)
    message = win.statusBar().currentMessage()
    assert message == "Deleted “What is 12 plus 30?”"
    text_end = win.statusBar().fontMetrics().horizontalAdvance(message) + 12  # the message's margin
    assert win.undo_btn.mapTo(win.statusBar(), win.undo_btn.rect().topLeft()).x() > text_end
    win.undo_btn.click()
    assert win.regen_btn.isEnabled() and win.context_label.text() != empty and not win.undo_btn.isVisible()


def test_identical_titles_show_date_and_model_and_editing_retitles(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    win.settings_panel.max_tokens.setValue(2)
    _send(qtbot, win, "Hello!")
    win.new_conversation()
    _send(qtbot, win, "Hello!")
    items = [win.conv_list.item(i) for i in range(win.conv_list.count())]
    assert all(it.text().startswith("Hello!\n") and it.text().endswith(f" · {win.model_info.name}") for it in items)
    assert all("Started " in it.toolTip() for it in items)
    win.chat._on_anchor(QUrl("edit:0"))
    win.prompt.setPlainText("Count from 3 to 9.")
    win.send()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    assert win.store.conversation(win.conv_id).title == "Count from 3 to 9."
    assert sorted(win.conv_list.item(i).text() for i in range(2)) == ["Count from 3 to 9.", "Hello!"]
