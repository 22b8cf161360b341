"""Store and app faults: damaged, read-only or unwritable stores at start-up; disk full and read-only while
chatting; the smoke test on a bad model. Typed errors with plain messages, nothing deleted, the app usable."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings

from app.main import open_store
from app.store import LOCK_WAIT_S, Store, StoreError
from app.window import MainWindow
from tests.fixtures import TINY_MOE, fixture_path


def _filled(path: Path, n: int = 200) -> None:
    st = Store(path)
    c = st.new_conversation("t")
    for i in range(n):
        st.add_message(c.id, "user", f"message {i} " + "x" * 200)
    st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    st.close()


def test_garbage_file_is_damaged_and_moved_aside_never_deleted(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite3"
    db.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError) as e:
        Store(db)
    assert e.value.kind == "damaged" and "damaged" in str(e.value) and "\n" not in str(e.value)
    asked: list[StoreError] = []
    st = open_store(db, lambda err: asked.append(err) or "move")
    assert asked and st is not None and st.persistent
    aside = [p for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].read_bytes() == b"this is not a database" * 100
    c = st.new_conversation("fresh")
    st.add_message(c.id, "user", "hello")
    assert [m.content for m in st.messages(c.id)] == ["hello"]


def test_damaged_pages_are_found_at_open(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite3"
    _filled(db)
    raw = bytearray(db.read_bytes())
    page = 4096
    for p in range(2, len(raw) // page - 1, 3):  # scribble over b-tree pages in the middle
        raw[p * page + 8:p * page + 64] = os.urandom(56)
    db.write_bytes(bytes(raw))
    with pytest.raises(StoreError) as e:
        Store(db)
    assert e.value.kind == "damaged"
    st = open_store(db, lambda err: "memory")  # run without history: nothing touched on disk
    assert st is not None and not st.persistent and db.read_bytes() == bytes(raw)
    assert open_store(db, lambda err: "quit") is None


def test_read_only_and_unwritable_stores(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreError) as e:
        Store(blocker / "c.sqlite3")  # its folder cannot be created
    assert e.value.kind == "unwritable"
    # A read-only database (root ignores file modes, so sqlite's own read-only switch stands in for chmod).
    real_open = Store._open

    def read_only(self, target):  # type: ignore[no-untyped-def]
        real_open(self, target)
        self.db.execute("PRAGMA query_only=ON")

    db = tmp_path / "c.sqlite3"
    _filled(db, 3)
    monkeypatch.setattr(Store, "_open", read_only)
    with pytest.raises(StoreError) as e:
        Store(db)
    assert e.value.kind == "readonly" and "read-only" in str(e.value)


ROOT = str(Path(__file__).resolve().parent.parent)


def test_a_shm_file_truncated_under_an_open_store_does_not_kill_the_app(tmp_path: Path) -> None:
    """Issue 48: a `-shm` file truncated (or made immutable) beside an open store killed the process with SIGBUS at
    its next write (exit 135). The store maps no such file now: the writes go on and every message is kept."""
    db = str(tmp_path / "c.sqlite3")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from app.store import Store
        st = Store({db!r})
        c = st.new_conversation("t")
        st.add_message(c.id, "user", "before")
        open({db!r} + "-shm", "w").close()  # truncated, or made, under the open store
        for i in range(50):
            st.add_message(c.id, "user", "after " * 100)
        print(len(st.messages(c.id)))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-1500:])
    assert r.stdout.split() == ["51"]
    assert len(Store(db).messages(1)) == 51


def test_a_shm_path_that_cannot_be_used_at_open_does_not_stop_the_store(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite3"
    _filled(db, 3)
    (tmp_path / "c.sqlite3-shm").mkdir()  # nothing can open, write or map it
    st = Store(db)
    st.add_message(1, "user", "still saved")
    st.close()
    assert [m.content for m in Store(db).messages(1)][-1] == "still saved"


def test_a_second_app_on_the_same_store_gets_a_locked_error(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite3"
    _filled(db, 3)
    holder = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r})\n"
                               f"from app.store import Store\nst = Store({str(db)!r})\nprint('open', flush=True)\n"
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        Store(db)
    assert e.value.kind == "locked" and "another program" in str(e.value) and "\n" not in str(e.value)
    assert time.monotonic() - t0 < LOCK_WAIT_S + 10
    holder.communicate("", timeout=60)
    assert len(Store(db).messages(1)) == 3  # the holder's exit frees it, every message kept


def _window(qtbot, store: Store, tmp_path: Path) -> MainWindow:
    win = MainWindow(store, QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat), str(fixture_path(TINY_MOE)))
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.model_info is not None or bool(win.errors), timeout=30_000)
    win.settings.max_tokens = 8
    return win


def test_disk_full_while_saving_a_reply_keeps_it_and_the_app_usable(qtbot, tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    win = _window(qtbot, store, tmp_path)
    win.prompt.setPlainText("Hello there")
    win.send()
    qtbot.waitUntil(lambda: win.generating, timeout=10_000)
    # The disk fills while the reply is generated: sqlite's page limit gives the real SQLITE_FULL path.
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count={pages}")
    store.db.execute("PRAGMA wal_autocheckpoint=0")
    for size in (200_000, 20_000, 2_000, 200, 20, 1):  # fill every page's free space
        with pytest.raises(StoreError, match="disk is full"):
            for _ in range(10_000):
                store.add_message(win.conv_id, "system", "y" * size)
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    reply = win.chat.last_reply()
    assert reply and reply in win.chat.toPlainText()  # shown, though not saved
    assert any("disk is full" in e and "not saved" in e for e in win.errors)
    assert [m.role for m in store.messages(win.conv_id)][-1] == "system"  # the reply is not there
    # Space again: the app goes on.
    store.db.execute("PRAGMA max_page_count=1073741823")
    win.prompt.setPlainText("Again")
    win.send()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    assert [m.role for m in store.messages(win.conv_id)][-2:] == ["user", "assistant"]
    assert not win.generating


def test_read_only_store_makes_send_say_so_and_keep_the_text(qtbot, tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    win = _window(qtbot, store, tmp_path)
    store.db.execute("PRAGMA query_only=ON")
    win.prompt.setPlainText("Will this be saved?")
    win.send()
    assert not win.generating and win.prompt.toPlainText() == "Will this be saved?"
    assert win.errors and "read-only" in win.errors[-1]


def test_smoke_test_on_a_bad_model_exits_2_with_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    good = fixture_path(TINY_MOE).read_bytes()
    bad.write_bytes(good[:len(good) // 2])  # truncated download
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    r = subprocess.run([sys.executable, "-m", "app.main", str(bad), "--smoke-test", "--data-dir",
                        str(tmp_path / "data"), "--timeout", "60"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr[-1500:])
    assert "truncated" in r.stderr and "Traceback" not in r.stderr and "QThread" not in r.stderr
    # A damaged store at start-up: the smoke test runs without history and says so (no traceback).
    data = tmp_path / "data2"
    data.mkdir()
    (data / "conversations.sqlite3").write_bytes(b"garbage" * 1000)
    r = subprocess.run([sys.executable, "-m", "app.main", str(bad), "--smoke-test", "--data-dir", str(data),
                        "--timeout", "60"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 2 and "without history" in r.stderr and "Traceback" not in r.stderr, r.stderr[-1500:]
    assert (data / "conversations.sqlite3").read_bytes() == b"garbage" * 1000  # untouched
