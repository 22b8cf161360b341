"""The app on remote engines (offscreen): the model menu lists saved remote engines beside local files, local-only
settings are hidden, a reply through a real llama.cpp server fills the charts with its acceptance and says
where the figures came from, a reply cut mid-way is kept and marked with one-click Retry, and a failed
connection keeps the current engine."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QMessageBox

from app.window import MainWindow
from app.store import Store
from engine.remote import RemoteConfig
from tests.fixtures import TINY_MOE, fixture_path
from tests.remote_stub import WORDS, Behaviour, Stub, llama_server


@pytest.fixture(scope="module")
def llama_url():
    server = llama_server()
    yield server.listening_address
    del server


def _window(qtbot, tmp_path: Path) -> MainWindow:
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win = MainWindow(Store(tmp_path / "c.db"), qs, str(fixture_path(TINY_MOE)))
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.model_info is not None or bool(win.errors), timeout=30_000)
    assert not win.errors
    return win


def _connect(qtbot, win: MainWindow, cfg: RemoteConfig) -> None:
    win.connect_remote(cfg)
    qtbot.waitUntil(lambda: win.loading is None, timeout=30_000)


def _send(qtbot, win: MainWindow, text: str) -> None:
    win.prompt.setPlainText(text)
    win.send()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)


def test_chat_through_llama_server_with_acceptance_in_the_charts(qtbot, tmp_path: Path, llama_url) -> None:
    win = _window(qtbot, tmp_path)
    win.settings.max_tokens = 8
    _connect(qtbot, win, RemoteConfig(llama_url, name="llama box"))
    info = win.model_info
    assert info.remote and info.server == "llama.cpp" and "llama.cpp server" in win.info.text()
    assert win.windowTitle() == "Foretell — llama box" and win.device_label.text() == "remote llama.cpp"
    form = win.settings_panel.form
    assert not form.isRowVisible(win.settings_panel.expert_cache) and not form.isRowVisible(win.settings_panel.device)
    assert not form.isRowVisible(win.settings_panel.mtp) and "server's own setting" in win.settings_panel.remote_note.text()
    assert "Remote: llama box" in [a.text() for a in win.recent_menu.actions()]  # saved beside the local files
    _send(qtbot, win, "Who made the heaven?")
    reply = win.store.messages(win.conv_id)[-1]
    assert reply.role == "assistant" and reply.content and reply.stats["drafted"] > 0
    assert reply.stats["source"].startswith("timings") and "drafted tokens accepted" in win.chat.toPlainText()
    assert reply.stats["mtp"] == "server"  # llama-server chose its own depth: not "auto"
    win.metrics.refresh()
    assert win.metrics.replies[-1].engine == "llama box · remote llama.cpp server"
    assert "the server's own setting" in win.metrics.summary.text() and "vs MTP off" not in win.metrics.summary.text()
    assert win.metrics.c_acc.has_data and "acceptance from the server's timings" in win.metrics.summary.text()
    assert "per request" in win.metrics.summary.text()
    # back to a local model: the local settings come back
    win.load_model(str(fixture_path(TINY_MOE)))
    qtbot.waitUntil(lambda: win.loading is None, timeout=30_000)
    assert not win.model_info.remote and form.isRowVisible(win.settings_panel.expert_cache)


def test_cut_reply_is_kept_marked_and_retried_in_one_click(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    b = Behaviour(counters=True, cut_after=3)
    with Stub(b) as stub:
        _connect(qtbot, win, RemoteConfig(stub.url))
        assert not win.settings_panel.form.isRowVisible(win.settings_panel.mtp)  # vLLM: the server's setting
        assert "server's own setting" in win.settings_panel.remote_note.text()
        _send(qtbot, win, "Tell me")
        msgs = win.store.messages(win.conv_id)
        assert msgs[-1].content == "".join(WORDS[:3]) and msgs[-1].stats["stop_reason"] == "interrupted"
        assert "cut off" in win.chat.toPlainText() and "ended the stream" in win.errors[-1]
        box = win.error_box
        retry = box.button(QMessageBox.StandardButton.Retry)
        assert retry is not None
        b.cut_after = None
        win.settings.max_tokens = 5
        retry.click()
        qtbot.waitUntil(lambda: not win.generating, timeout=30_000)
    msgs = win.store.messages(win.conv_id)
    assert msgs[-1].content == "".join(WORDS[:5]) and len(win.store.versions(msgs[-1].id)) == 2
    assert "from /metrics (server-wide)" in win.chat.toPlainText()


def test_failed_connection_keeps_the_current_engine(qtbot, tmp_path: Path) -> None:
    win = _window(qtbot, tmp_path)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    _connect(qtbot, win, RemoteConfig(f"127.0.0.1:{port}"))
    assert "refused" in win.errors[-1] and win.model_info.architecture == "qwen35moe"
    assert win.send_btn.isEnabled() and win.progress.maximum() == 100


def test_connecting_to_a_remote_engine_switches_serving_off(qtbot, tmp_path: Path) -> None:
    import http.client

    win = _window(qtbot, tmp_path)
    panel = win.serve_panel
    panel.port.setValue(0)
    panel.switch.setChecked(True)
    port = panel.server.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 200
    conn.close()
    with Stub(Behaviour()) as stub:
        _connect(qtbot, win, RemoteConfig(stub.url))
        assert win.model_info.remote and panel.server is None and not panel.switch.isChecked()
        assert panel.url.text().startswith("Stopped. A remote engine is served by its own server")
        assert panel.port.isEnabled()
        with pytest.raises(ConnectionRefusedError):  # not an HTTP 500 about the remote engine's missing file
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/v1/models")
        panel.switch.setChecked(True)  # refused with the reason while the engine is remote
        assert panel.server is None and not panel.switch.isChecked() and "own server" in panel.url.text()
    win.load_model(str(fixture_path(TINY_MOE)))  # a local model again: it can be served
    qtbot.waitUntil(lambda: win.loading is None, timeout=30_000)
    panel.switch.setChecked(True)
    assert panel.server is not None and panel.url.text().startswith("http://127.0.0.1:")
    panel.switch.setChecked(False)
