"""File › Get models through the real window, with a downloader that stands in for the Hub (no network): the
known repositories, a repository's files with size, MTP head and fit, a download with progress, Cancel, a second
download, and the model opened from the library folder."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from app.hub import KNOWN_REPOS, DownloadCancelled, RemoteFile
from app.store import Store
from app.window import MainWindow
from tests.fixtures import TINY_MOE, fixture_path
from tests.hub_stub import FakeHub


def test_get_a_model_with_progress_cancel_and_open(qtbot, tmp_path: Path) -> None:
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win = MainWindow(Store(tmp_path / "c.db"), qs, str(fixture_path(TINY_MOE)))
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.model_info is not None, timeout=30_000)
    models = tmp_path / "models"
    qs.setValue("library/folder", str(models))
    assert "&Get models…" in [a.text() for a in win.menuBar().actions()[0].menu().actions()]
    hub = FakeHub()
    dlg = win.get_models(hub)
    assert dlg.repos.count() == len(KNOWN_REPOS) and "MTP" in dlg.repos.item(0).text()
    dlg.repos.setCurrentRow(0)
    qtbot.waitUntil(lambda: dlg.file_list.count() == 2, timeout=5000)
    assert hub.listed == [KNOWN_REPOS[0][0]] and "2 GGUF files" in dlg.status.text()
    small, huge = dlg.file_list.item(0).text(), dlg.file_list.item(1).text()
    assert "Q8_0" in small and "MTP head yes" in small and "fits in RAM" in small
    assert "Q4_K_M" in huge and "MTP head no" in huge and "5120.00 GiB" in huge and "larger than the free RAM" in huge
    # Download, cancel half-way, download again.
    hub.slow.set()
    dlg.file_list.setCurrentRow(0)
    dlg.download_btn.click()
    assert dlg.cancel_btn.isEnabled() and not dlg.download_btn.isEnabled()
    qtbot.waitUntil(lambda: dlg.progress_bar.value() > 0, timeout=10_000)
    assert " of " in dlg.progress_bar.format()
    dlg.cancel_btn.click()
    qtbot.waitUntil(lambda: "cancelled" in dlg.status.text(), timeout=10_000)
    assert not dlg.open_btn.isEnabled() and dlg.download_btn.isEnabled() and not dlg.progress_bar.isVisible()
    assert list(models.iterdir()) == []
    hub.slow.clear()
    dlg.download_btn.click()
    qtbot.waitUntil(lambda: dlg.downloaded is not None, timeout=10_000)
    got = models / "Tiny-MTP-Q8_0.gguf"
    assert got.read_bytes() == hub.data and dlg.downloaded == str(got) and "Downloaded to" in dlg.status.text()
    # In the library, and opened from the dialog.
    assert win.qs.value("library/folder") == str(models)
    dlg.open_btn.click()
    qtbot.waitUntil(lambda: win.loading is None and win.model_info.path == str(got), timeout=30_000)
    win.show()
    win.tab_actions["Model"].trigger()
    assert win.library.list.count() >= 1 and win.library.entries[0].path == str(got)


def test_the_hub_downloads_progress_and_cancel() -> None:
    """huggingface_hub takes a progress-bar class: ours reports the bytes (from where a download starts) and stops
    it when cancelled."""
    from app.hub import reporting_bar

    seen: list[tuple[int, int]] = []
    cancel = threading.Event()
    bar = reporting_bar(lambda d, t: seen.append((d, t)), cancel)(unit="B", total=1000, initial=200, desc="x")
    bar.update(300)
    bar.update(100)
    assert seen == [(500, 1000), (600, 1000)]
    cancel.set()
    with pytest.raises(DownloadCancelled):
        bar.update(100)
    bar.close()


def test_the_hub_downloader_against_a_local_server_in_the_hubs_layout(tmp_path: Path) -> None:
    """HubDownloader through huggingface_hub against a server on 127.0.0.1 that answers as the Hub does (the model
    listing with file sizes, the file's HEAD and ranged GET): files listed, a download cancelled mid-way, then
    complete and identical."""
    import hashlib
    import json
    import os
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from app.hub import HubDownloader

    data = os.urandom(25 * 2**20)  # huggingface_hub reports every 10 MiB: three reports
    sha, commit = hashlib.sha256(data).hexdigest(), "a" * 40

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _headers(self, code: int, length: int, extra: dict[str, str]) -> None:
            self.send_response(code)
            for k, v in {"X-Repo-Commit": commit, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                         "X-Linked-Size": str(len(data)), "Content-Length": str(length), **extra}.items():
                self.send_header(k, v)
            self.end_headers()

        def do_HEAD(self) -> None:  # noqa: N802
            self._headers(200, len(data), {})

        def do_GET(self) -> None:  # noqa: N802
            if self.path.startswith("/api/models/org/repo"):
                body = json.dumps({"id": "org/repo", "sha": commit, "siblings": [
                    {"rfilename": "m-MTP-Q4_K_M.gguf", "size": len(data)}, {"rfilename": "README.md", "size": 9}]})
                self._headers(200, len(body), {"Content-Type": "application/json"})
                self.wfile.write(body.encode())
                return
            start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
            ranged = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if start else {}
            self._headers(206 if start else 200, len(data) - start, ranged)
            try:
                self.wfile.write(data[start:])
            except (BrokenPipeError, ConnectionResetError):  # the cancelled download hung up
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        hub = HubDownloader(f"http://127.0.0.1:{server.server_port}")
        assert hub.files("org/repo") == [RemoteFile("m-MTP-Q4_K_M.gguf", len(data))]
        seen: list[tuple[int, int]] = []
        cancel = threading.Event()

        def progress(done: int, total: int) -> None:
            seen.append((done, total))
            if done > len(data) // 3:
                cancel.set()

        with pytest.raises(DownloadCancelled):
            hub.download("org/repo", "m-MTP-Q4_K_M.gguf", tmp_path, progress, cancel)
        assert seen and seen[-1][0] < len(data) and not (tmp_path / "m-MTP-Q4_K_M.gguf").exists()
        seen.clear()
        got = hub.download("org/repo", "m-MTP-Q4_K_M.gguf", tmp_path, lambda d, t: seen.append((d, t)),
                           threading.Event())
        assert got == tmp_path / "m-MTP-Q4_K_M.gguf" and got.read_bytes() == data and seen[-1] == (len(data),) * 2
    finally:
        server.shutdown()
