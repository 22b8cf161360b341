"""Conversation store: CRUD, search, exports, edit/regenerate truncation, and crash safety."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.store import Store


def test_conversations_and_messages(tmp_path: Path) -> None:
    st = Store(tmp_path / "c.db")
    a = st.new_conversation("Cooking")
    b = st.new_conversation()
    st.add_message(a.id, "user", "How long do I boil an egg?")
    m = st.add_message(a.id, "assistant", "About 9 minutes.", {"decode_tok_s": 12.5, "stop_reason": "eos"})
    assert m.position == 1 and st.messages(a.id)[1].stats == {"decode_tok_s": 12.5, "stop_reason": "eos"}
    assert [c.id for c in st.conversations()] == [a.id, b.id]  # most recently updated first
    st.rename(b.id, "  Travel ")
    assert st.conversation(b.id).title == "Travel"
    assert [c.id for c in st.conversations(search="egg")] == [a.id]
    assert [c.id for c in st.conversations(search="travel")] == [b.id]
    assert st.conversations(search="100%_") == []  # LIKE wildcards are escaped
    st.delete(a.id)
    assert [c.id for c in st.conversations()] == [b.id] and st.messages(a.id) == []
    with pytest.raises(KeyError):
        st.conversation(a.id)


def test_truncate_for_edit_and_regenerate(tmp_path: Path) -> None:
    st = Store(tmp_path / "c.db")
    c = st.new_conversation()
    for i, role in enumerate(["user", "assistant", "user", "assistant"]):
        st.add_message(c.id, role, f"m{i}")
    st.truncate_from(c.id, 2)
    assert [m.content for m in st.messages(c.id)] == ["m0", "m1"]
    assert st.add_message(c.id, "user", "edited").position == 2


def test_exports(tmp_path: Path) -> None:
    st = Store(tmp_path / "c.db")
    c = st.new_conversation("Maths")
    st.add_message(c.id, "user", "2+2?")
    st.add_message(c.id, "assistant", "2 + 2 = 4.", {"tokens": 7, "decode_tok_s": 3.25})
    data = json.loads(st.export_json(c.id))
    assert data["title"] == "Maths" and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    md = st.export_markdown(c.id)
    assert md.startswith("# Maths") and "## Assistant" in md and "2 + 2 = 4." in md and "decode tok s: 3.25" in md


def test_store_survives_reopen_and_uses_wal(tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    st = Store(path)
    c = st.new_conversation("Kept")
    st.add_message(c.id, "user", "hello")
    st.close()
    st2 = Store(path)
    assert st2.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert [m.content for m in st2.messages(c.id)] == ["hello"]


def test_kill_9_loses_no_completed_message(tmp_path: Path) -> None:
    # A child process stores messages as a chat would (each completed message committed), prints after
    # each commit, and is SIGKILLed mid-"generation"; everything it reported must be in the database.
    path = tmp_path / "c.db"
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from app.store import Store
        st = Store({str(path)!r})
        c = st.new_conversation("crash")
        for i in range(1000):
            st.add_message(c.id, "user" if i % 2 == 0 else "assistant", f"message {{i}}")
            print(i, flush=True)
            time.sleep(0.002)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    shown = -1
    assert p.stdout is not None
    deadline = time.time() + 30
    while shown < 25 and time.time() < deadline:
        shown = int(p.stdout.readline())
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    st = Store(path)
    convs = st.conversations()
    assert len(convs) == 1
    got = [m.content for m in st.messages(convs[0].id)]
    assert len(got) >= shown + 1 and got[:shown + 1] == [f"message {i}" for i in range(shown + 1)]
