"""The app's "Serve on localhost" switch (offscreen): it serves the worker's loaded engine, shows the URL and the
request count, shares the worker's generation lock, and stops when switched off."""
from __future__ import annotations

import http.client
import json

import pytest

from app.serve_panel import ServePanel
from app.worker import EngineController
from engine.events import GenerationConfig


def _post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_switch_serves_the_loaded_engine(qtbot) -> None:
    ctl = EngineController()
    try:
        panel = ServePanel(ctl.worker, lambda: GenerationConfig(max_tokens=4))
        qtbot.addWidget(panel)
        panel.port.setValue(0)  # any free port
        panel.switch.setChecked(True)  # no model yet: refused with a reason, switch back off
        assert panel.server is None and not panel.switch.isChecked() and "Load a model" in panel.url.text()
        with qtbot.waitSignal(ctl.worker.loaded, timeout=60_000):
            ctl.load(None)
        panel.switch.setChecked(True)
        assert panel.server is not None and panel.server.scheduler.lock is ctl.worker.gen_lock
        port = panel.server.port
        assert panel.url.text() == f"http://127.0.0.1:{port}/v1" and not panel.port.isEnabled()
        reply = _post(port, {"messages": [{"role": "user", "content": "Hi"}]})
        assert 1 <= reply["usage"]["completion_tokens"] <= 4  # the app's settings are the defaults
        qtbot.waitUntil(lambda: panel.count.text().startswith("1 finished"), timeout=5_000)
        panel.switch.setChecked(False)
        assert panel.server is None and panel.url.text() == "Off" and panel.port.isEnabled()
        with pytest.raises(ConnectionRefusedError):
            _post(port, {"messages": [{"role": "user", "content": "Hi"}]})
    finally:
        ctl.shutdown()


def test_port_in_use_is_reported(qtbot) -> None:
    import socket

    ctl = EngineController()
    try:
        with qtbot.waitSignal(ctl.worker.loaded, timeout=60_000):
            ctl.load(None)
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen(1)
            panel = ServePanel(ctl.worker, GenerationConfig)
            qtbot.addWidget(panel)
            panel.port.setValue(busy.getsockname()[1])
            panel.switch.setChecked(True)
            assert panel.server is None and not panel.switch.isChecked()
            assert panel.url.text().startswith("Not serving: cannot listen on 127.0.0.1:")
    finally:
        ctl.shutdown()
