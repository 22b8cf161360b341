"""The main window end to end (offscreen): chat, stop, regenerate, edit, persistence, errors, smoke test."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from app.store import Store
from app.window import MainWindow
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


def test_send_stream_regenerate_edit_and_restart(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    assert win.model_info["architecture"] == "qwen35moe" and "qwen35moe" in win.info.text()
    win.settings.max_tokens = 16
    _send(qtbot, win, "Hello there")
    msgs = win.store.messages(win.conv_id)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[1].stats["tokens"] >= 1
    assert "tok/s" in win.chat.toPlainText() and win.conv_list.count() == 1
    first = msgs[1].content
    win.regenerate()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    msgs = win.store.messages(win.conv_id)
    assert len(msgs) == 2 and msgs[1].content == first  # greedy: the same reply again
    win.edit_last()
    assert win.prompt.toPlainText() == "Hello there" and win.store.messages(win.conv_id) == []
    _send(qtbot, win, "Hello again")
    _send(qtbot, win, "Second question")
    assert len(win.store.messages(win.conv_id)) == 4
    from PySide6.QtCore import QUrl

    win.chat._on_anchor(QUrl("edit:0"))  # edit the *first* user message
    assert win.prompt.toPlainText() == "Hello again" and win.store.messages(win.conv_id) == []
    _send(qtbot, win, "Hello again")
    conv = win.conv_id
    win.close()
    # Restart: the conversation is found again.
    win2 = _window(qtbot, tmp_path)
    assert win2.conv_list.count() == 1
    win2.open_conversation(conv)
    assert "Hello again" in win2.chat.toPlainText()


def test_stop_within_a_step(qtbot, tmp_path: Path) -> None:
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


def test_bad_model_shows_an_error_and_app_stays_usable(qtbot, tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    win = _window(qtbot, tmp_path, str(bad))
    assert win.errors and "Traceback" not in win.errors[0] and win.model_info is None
    assert not win.send_btn.isEnabled()
    win.load_model(str(fixture_path(TINY_MOE)))
    qtbot.waitUntil(lambda: win.model_info is not None, timeout=30_000)
    win.settings.max_tokens = 4
    _send(qtbot, win, "still works?")
    assert win.store.messages(win.conv_id)[-1].role == "assistant"


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
