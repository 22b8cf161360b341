"""File › Get models through the real window, over app.hub.HubDownloader against tests/hub_stub.py's local server
in the Hub's layout (no network): the suggested first model, the search (known MTP builds first, other
architectures left out), a repository's files with size, MTP head and fit, a download paused, resumed, cancelled and
interrupted, a corrupted one refused, and the model opened from the library folder."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QSettings, Qt
from PySide6.QtTest import QTest

from app.hub import KNOWN_REPOS, HubDownloader, partial_bytes
from app.store import Store
from app.window import MainWindow
from tests.fixtures import TINY_MOE, fixture_path
from tests.hub_stub import BIG, HUGE, TINY, Listed, LocalHub

MiB = 2**20


def _window(qtbot, tmp_path: Path) -> tuple[MainWindow, Path]:
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win = MainWindow(Store(tmp_path / "c.db"), qs, str(fixture_path(TINY_MOE)))
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.model_info is not None, timeout=30_000)
    models = tmp_path / "models"
    qs.setValue("library/folder", str(models))
    return win, models


def _choose(qtbot, dlg, name: str) -> None:
    qtbot.waitUntil(lambda: dlg.file_list.count() == 3, timeout=5000)
    dlg.file_list.setCurrentRow([f.name for f in dlg.files].index(name))


def test_search_suggest_refuse_a_corrupted_file_and_open(qtbot, tmp_path: Path) -> None:
    win, models = _window(qtbot, tmp_path)
    index = (Listed("someone/Qwen3.5-9B-GGUF", "qwen35", 900), Listed("else/Qwen3.5-Llamafied-GGUF", "llama", 5000),
             Listed("other/Qwen3.5-2B-MTP-GGUF", "qwen35", 40))
    with LocalHub(index) as hub:
        assert "&Get models…" in [a.text() for a in win.menuBar().actions()[0].menu().actions()]
        dlg = win.get_models(HubDownloader(hub.endpoint))
        assert dlg.repos.count() == len(KNOWN_REPOS) and "MTP" in dlg.repos.item(0).text()
        # The suggestion is a known MTP build; Show it lists its files.
        assert dlg.suggested.repo in [r for r, _, _ in KNOWN_REPOS] and dlg.suggested.repo in \
            dlg.suggestion_label.text() and "GiB free" in dlg.suggestion_label.text()
        dlg.suggest_btn.click()
        assert dlg.repo == dlg.suggested.repo
        qtbot.waitUntil(lambda: dlg.file_list.count() == 3, timeout=5000)
        assert hub.listed == [dlg.suggested.repo] and "3 GGUF files" in dlg.status.text()
        small, huge = dlg.file_list.item(0).text(), dlg.file_list.item(2).text()
        assert "Q8_0" in small and "MTP head yes" in small and "fits this machine" in small
        assert "Q4_K_M" in huge and "MTP head no" in huge and "5120.00 GiB" in huge and "too large" in huge
        # Search: the engine's architectures only, the known MTP builds first, then other MTP builds.
        QTest.keyClicks(dlg.search_box, "Qwen3.5")
        QTest.keyClick(dlg.search_box, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: "repositories" in dlg.status.text(), timeout=5000)
        assert [dlg.repos.item(i).text().split("\n")[0] for i in range(dlg.repos.count())] == [
            KNOWN_REPOS[1][0], KNOWN_REPOS[2][0], "other/Qwen3.5-2B-MTP-GGUF", "someone/Qwen3.5-9B-GGUF"]
        assert "qwen35 · 900 downloads" in dlg.repos.item(3).text() and dlg.file_list.count() == 0
        # A corrupted file is refused and removed.
        dlg.repos.setCurrentRow(3)
        _choose(qtbot, dlg, TINY)
        hub.corrupt = True
        dlg.download_btn.click()
        qtbot.waitUntil(lambda: not dlg.busy, timeout=10_000)
        assert "arrived damaged" in dlg.status.text() and "removed" in dlg.status.text()
        assert list(models.iterdir()) == [] and not dlg.open_btn.isEnabled()
        hub.corrupt = False
        dlg.download_btn.click()
        qtbot.waitUntil(lambda: dlg.downloaded is not None, timeout=10_000)
        got = models / TINY
        assert got.read_bytes() == hub.data[TINY] and dlg.downloaded == str(got)
        assert "SHA-256 matches" in dlg.status.text()
        # In the library, and opened from the dialog.
        assert win.qs.value("library/folder") == str(models)
        dlg.open_btn.click()
        qtbot.waitUntil(lambda: win.loading is None and win.model_info.path == str(got), timeout=30_000)
        win.show()
        win.tab_actions["Model"].trigger()
        assert win.library.list.count() >= 1 and win.library.entries[0].path == str(got)


def test_pause_resume_cancel_and_an_interrupted_download(qtbot, tmp_path: Path) -> None:
    win, models = _window(qtbot, tmp_path)
    with LocalHub() as hub:
        dlg = win.get_models(HubDownloader(hub.endpoint))
        dlg.repos.setCurrentRow(0)
        _choose(qtbot, dlg, BIG)
        assert not dlg.pause_btn.isEnabled() and not dlg.cancel_btn.isEnabled()
        # Pause half-way, then Cancel the paused download: its partial file goes.
        hub.slow.set()
        dlg.download_btn.click()
        assert dlg.pause_btn.isEnabled() and not dlg.download_btn.isEnabled()
        qtbot.waitUntil(lambda: dlg.progress_bar.value() > 0, timeout=10_000)
        assert "10 MiB of 25 MiB" in dlg.progress_bar.format()
        dlg.pause_btn.click()
        qtbot.waitUntil(lambda: not dlg.busy, timeout=10_000)
        assert dlg.status.text() == "Paused at 10 MiB of 25 MiB. Resume continues from there."
        assert dlg.download_btn.text() == "Resume" and dlg.cancel_btn.isEnabled() and not dlg.pause_btn.isEnabled()
        assert partial_bytes(models, BIG) == 10 * MiB and not (models / BIG).exists()
        assert dlg.file_list.currentItem().text().endswith(" · 10 MiB here, paused")
        dlg.cancel_btn.click()
        assert "removed" in dlg.status.text() and partial_bytes(models, BIG) == 0
        assert dlg.download_btn.text() == "Download" and not dlg.cancel_btn.isEnabled()
        assert "paused" not in dlg.file_list.currentItem().text()
        # Pause again, and Resume: one Range request from where it stopped.
        dlg.download_btn.click()
        qtbot.waitUntil(lambda: dlg.progress_bar.value() > 0, timeout=10_000)
        dlg.pause_btn.click()
        qtbot.waitUntil(lambda: not dlg.busy, timeout=10_000)
        hub.slow.clear()
        hub.ranges.clear()
        dlg.download_btn.click()
        assert "Resuming" in dlg.status.text()
        qtbot.waitUntil(lambda: dlg.downloaded is not None, timeout=10_000)
        assert hub.ranges == [10 * MiB] and (models / BIG).read_bytes() == hub.data[BIG]
        # Cancel under way: nothing is left.
        dlg.file_list.setCurrentRow([f.name for f in dlg.files].index(TINY))
        hub.slow.set()
        dlg.download_btn.click()
        dlg.cancel_btn.click()
        qtbot.waitUntil(lambda: not dlg.busy, timeout=10_000)
        assert dlg.status.text() == "Download cancelled." and partial_bytes(models, TINY) == 0
        assert not (models / TINY).exists()
        # The connection drops and the server is down: what came is kept; Resume finishes it when it is back.
        hub.slow.clear()
        (models / BIG).unlink()
        dlg.file_list.setCurrentRow([f.name for f in dlg.files].index(BIG))
        hub.ranges.clear()
        hub.cut_after(12 * MiB)
        dlg.download_btn.click()
        qtbot.waitUntil(lambda: not dlg.busy, timeout=15_000)
        assert dlg.status.text().startswith("The download stopped at 10 MiB of 25 MiB (")
        assert "503" in dlg.status.text() and dlg.status.text().endswith("Resume continues from there.")
        hub.recover()
        dlg.download_btn.click()
        qtbot.waitUntil(lambda: not dlg.busy, timeout=10_000)
        assert hub.ranges == [0, 10 * MiB] and (models / BIG).read_bytes() == hub.data[BIG]
        assert HUGE not in [p.name for p in models.iterdir()]
