"""EngineWorker on its QThread: load, stream, stop, errors — and the GUI thread never blocks."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QObject, QThread, Slot

from app.worker import EngineController
from engine.chat import Message
from engine.events import EngineConfig, GenerationConfig
from tests.fixtures import KQUANT_MOE, TINY_MOE, fixture_path


@pytest.fixture
def ctl(qtbot):
    c = EngineController()
    yield c
    c.shutdown()


class Recorder(QObject):
    """A GUI-thread receiver, connected the way the window connects: queued delivery to its slots."""

    def __init__(self) -> None:
        super().__init__()
        self.got: dict = {"tokens": [], "stats": [], "done": None, "errors": [], "loaded": None, "threads": set()}

    @Slot(object)
    def on_loaded(self, info: object) -> None:
        self.got["loaded"] = info

    @Slot(str)
    def on_error(self, msg: str) -> None:
        self.got["errors"].append(msg)

    @Slot(str, bool)
    def on_token(self, text: str, accepted: bool) -> None:
        self.got["tokens"].append((text, accepted))
        self.got["threads"].add(QThread.currentThread())

    @Slot(object)
    def on_stats(self, st: object) -> None:
        self.got["stats"].append(st)

    @Slot(str, str)
    def on_finished(self, reason: str, msg: str) -> None:
        self.got["done"] = reason


_recorders: list[Recorder] = []


def _record(ctl: EngineController) -> dict:
    r = Recorder()
    _recorders.append(r)  # keep it alive for the test
    w = ctl.worker
    w.loaded.connect(r.on_loaded)
    w.loadFailed.connect(r.on_error)
    w.failed.connect(r.on_error)
    w.token.connect(r.on_token)
    w.stats.connect(r.on_stats)
    w.finished.connect(r.on_finished)
    return r.got


def test_load_generate_stream(qtbot, ctl) -> None:
    got = _record(ctl)
    ctl.load(str(fixture_path(TINY_MOE)), EngineConfig(n_ctx=512))
    qtbot.waitUntil(lambda: got["loaded"] is not None or bool(got["errors"]), timeout=30_000)
    assert not got["errors"]
    info = got["loaded"]
    assert info["architecture"] == "qwen35moe" and info["mtp"] and info["layer_pattern"] == "RRRAM"
    ctl.generate([Message("user", "Hello")], GenerationConfig(max_tokens=12, stats_interval_s=0.0))
    qtbot.waitUntil(lambda: got["done"] is not None, timeout=30_000)
    assert got["tokens"] and got["stats"] and got["stats"][-1].final
    # Slots connected in the GUI thread ran there (queued delivery), not on the engine thread.
    assert got["threads"] == {QThread.currentThread()} and ctl.thread is not QThread.currentThread()


def _worst_stall(qtbot, until) -> float:
    """Longest gap between event-loop turns while waiting for `until`."""
    worst, last = 0.0, time.perf_counter()
    while not until():
        qtbot.wait(5)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    return worst


def test_stop_and_gui_stays_responsive(qtbot, ctl) -> None:
    got = _record(ctl)
    ctl.load(str(fixture_path(KQUANT_MOE)), EngineConfig(n_ctx=4096))
    assert _worst_stall(qtbot, lambda: got["loaded"] is not None) < 0.05  # during load
    ctl.worker.engine.tokenizer.eog_ids = frozenset()  # a random model: keep it generating
    # as long as the fixture's context allows: a decode step of this small model takes well under a millisecond
    ctl.generate([1, 2, 3], GenerationConfig(max_tokens=4000))
    qtbot.waitUntil(lambda: len(got["tokens"]) >= 5, timeout=30_000)
    # The GUI event loop keeps turning while the worker decodes: measure the longest stall.
    worst, last, t_end = 0.0, time.perf_counter(), time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        qtbot.wait(5)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    assert worst < 0.05, worst
    ctl.stop()
    qtbot.waitUntil(lambda: got["done"] is not None, timeout=10_000)
    assert got["done"] == "stopped" and len(got["tokens"]) < 4000


def test_bad_model_reports_an_error_and_worker_stays_usable(qtbot, ctl, tmp_path: Path) -> None:
    got = _record(ctl)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not a gguf file")
    ctl.load(str(bad), EngineConfig())
    qtbot.waitUntil(lambda: bool(got["errors"]), timeout=10_000)
    assert "not a GGUF" in got["errors"][0] and "Traceback" not in got["errors"][0]
    ctl.load(str(fixture_path(TINY_MOE)), EngineConfig(n_ctx=256))
    qtbot.waitUntil(lambda: got["loaded"] is not None, timeout=30_000)
    assert got["loaded"]["architecture"] == "qwen35moe"


OUT_OF_MEMORY = threading.Event()  # set: the next model file prepared fails as out of memory (`oom_ctl`)


@pytest.fixture
def oom_ctl(qtbot):
    """A controller whose loader fails while preparing a checked file once OUT_OF_MEMORY is set."""
    from engine.errors import OutOfMemoryError
    from engine.generate import load

    def loader(path, config, progress=None, cancel=None):  # type: ignore[no-untyped-def]
        if OUT_OF_MEMORY.is_set() and not isinstance(path, str):  # the new, already checked ModelFile
            raise OutOfMemoryError("not enough memory for the test model")
        return load(path, config, progress, cancel)

    OUT_OF_MEMORY.clear()
    c = EngineController(loader=loader)
    yield c
    c.shutdown()


def test_a_failed_load_keeps_or_reopens_the_previous_model(qtbot, oom_ctl, tmp_path: Path) -> None:
    ctl = oom_ctl
    got = _record(ctl)
    ctl.load(str(fixture_path(TINY_MOE)), EngineConfig(n_ctx=256))
    qtbot.waitUntil(lambda: got["loaded"] is not None, timeout=30_000)
    first = ctl.worker.engine
    # A file that is not a model: refused before anything is unloaded.
    (tmp_path / "notes.txt").write_text("notes")
    ctl.load(str(tmp_path / "notes.txt"), EngineConfig(n_ctx=256))
    qtbot.waitUntil(lambda: len(got["errors"]) == 1, timeout=30_000)
    assert got["errors"][0] == "notes.txt is not a GGUF model file" and ctl.worker.engine is first
    # A valid file that fails while being prepared (out of memory): the previous model is opened again.
    OUT_OF_MEMORY.set()
    got["loaded"] = None
    ctl.load(str(fixture_path(KQUANT_MOE)), EngineConfig(n_ctx=256))
    qtbot.waitUntil(lambda: len(got["errors"]) == 2, timeout=30_000)
    assert got["errors"][1] == "not enough memory for the test model"
    assert got["loaded"] is not None and got["loaded"]["path"] == str(fixture_path(TINY_MOE))
    assert ctl.worker.engine is not None and ctl.worker.engine is not first


def test_cancelling_a_load_reopens_the_previous_model(qtbot, ctl) -> None:
    got = _record(ctl)
    cancelled: list[str] = []
    ctl.worker.loadCancelled.connect(cancelled.append)
    ctl.load(str(fixture_path(TINY_MOE)), EngineConfig(n_ctx=256))
    qtbot.waitUntil(lambda: got["loaded"] is not None, timeout=30_000)
    got["loaded"] = None
    ctl.load(str(fixture_path(KQUANT_MOE)), EngineConfig(n_ctx=256))
    ctl.cancel_load()  # set while the worker is still opening the file
    # `cancelled` is appended to on the worker's thread as the signal is emitted, the recorder's `loaded` (emitted
    # first) arrives queued on this one: wait for both
    qtbot.waitUntil(lambda: bool(cancelled) and got["loaded"] is not None, timeout=30_000)
    assert "cancelled" in cancelled[0] and not got["errors"]
    assert got["loaded"]["path"] == str(fixture_path(TINY_MOE))  # the previous model, loaded again
    got["loaded"] = None
    ctl.load(str(fixture_path(KQUANT_MOE)), EngineConfig(n_ctx=256))  # a new request is not cancelled
    qtbot.waitUntil(lambda: got["loaded"] is not None, timeout=30_000)
    assert got["loaded"]["path"] == str(fixture_path(KQUANT_MOE)) and len(cancelled) == 1
