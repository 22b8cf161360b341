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
    assert [c.id for c in st.conversations()] == [b.id] and st.conversations(search="egg") == []
    st.undelete(a.id)  # a delete can be undone while the store is open
    assert {c.id for c in st.conversations()} == {a.id, b.id} and len(st.messages(a.id)) == 2
    st.delete(a.id)
    st.close()
    st = Store(tmp_path / "c.db")  # reopening purges what was deleted
    assert [c.id for c in st.conversations()] == [b.id] and st.messages(a.id) == []
    with pytest.raises(KeyError):
        st.conversation(a.id)


def test_versions_branch_without_losing_anything(tmp_path: Path) -> None:
    st = Store(tmp_path / "c.db")
    c = st.new_conversation()
    u0 = st.add_message(c.id, "user", "q0")
    a0 = st.add_message(c.id, "assistant", "a0")
    u1 = st.add_message(c.id, "user", "q1")
    st.add_message(c.id, "assistant", "a1")
    # Regenerate the last reply: a sibling of it, shown; the old one stays.
    a1b = st.add_message(c.id, "assistant", "a1 again", parent_id=u1.id)
    assert [m.content for m in st.messages(c.id)] == ["q0", "a0", "q1", "a1 again"] and a1b.position == 3
    assert len(st.versions(a1b.id)) == 2
    # Edit the first question: a new branch from the root.
    e0 = st.add_message(c.id, "user", "q0 edited", parent_id=None)
    st.add_message(c.id, "assistant", "e0")
    assert [m.content for m in st.messages(c.id)] == ["q0 edited", "e0"]
    assert st.versions(e0.id) == [u0.id, e0.id]
    st.show_version(u0.id)  # back to version 1: its newest branch (the regenerated reply)
    assert [m.content for m in st.messages(c.id)] == ["q0", "a0", "q1", "a1 again"]
    st.show_version(st.versions(a1b.id)[0])
    assert [m.content for m in st.messages(c.id)][-1] == "a1"
    assert st.messages(c.id)[1].id == a0.id
    with pytest.raises(KeyError):
        st.add_message(c.id, "user", "x", parent_id=10_000)


def test_a_version_1_database_migrates_without_loss(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)  # the version-1 schema, as the app created it before branches
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, created REAL NOT NULL,
            updated REAL NOT NULL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL
            REFERENCES conversations(id) ON DELETE CASCADE, position INTEGER NOT NULL, role TEXT NOT NULL
            CHECK (role IN ('system', 'user', 'assistant')), content TEXT NOT NULL, stats TEXT, created REAL NOT NULL,
            UNIQUE (conversation_id, position));
        INSERT INTO conversations VALUES (1, 'Old', 1.0, 2.0), (2, 'Empty', 1.0, 1.0), (3, 'Other', 1.0, 3.0);
        INSERT INTO messages VALUES (1, 1, 0, 'user', 'hi', NULL, 1.0), (2, 1, 1, 'assistant', 'hello',
            '{"tokens": 3}', 1.5), (3, 3, 0, 'user', 'x', NULL, 1.0), (4, 1, 3, 'user', 'after a gap', NULL, 1.6);
    """)
    db.commit()
    db.close()
    st = Store(path)
    assert [(m.id, m.content, m.parent_id) for m in st.messages(1)] == [(1, "hi", None), (2, "hello", 1),
                                                                           (4, "after a gap", 2)]
    assert st.messages(1)[1].stats == {"tokens": 3} and st.messages(2) == [] and st.messages(3)[0].content == "x"
    assert {c.title for c in st.conversations()} == {"Old", "Empty", "Other"}
    assert st.db.execute("PRAGMA user_version").fetchone()[0] == 3 and st.conversation_settings(1) is None
    st.add_message(1, "assistant", "new")  # the migrated tree takes new messages where it ended
    assert [m.position for m in st.messages(1)] == [0, 1, 3, 4]
    st.close()
    assert [m.content for m in Store(path).messages(1)][-1] == "new"  # migrates once; reopening keeps it


def test_exports(tmp_path: Path) -> None:
    st = Store(tmp_path / "c.db")
    c = st.new_conversation("Maths")
    st.add_message(c.id, "user", "2+2?")
    st.add_message(c.id, "assistant", "2 + 2 = 4.", {"tokens": 7, "decode_tok_s": 3.25})
    meta = {"model": "tiny", "settings": {"mtp": True, "temperature": 0.0}}
    data = json.loads(st.export_json(c.id, meta))
    assert data["title"] == "Maths" and [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["model"] == "tiny" and data["settings"]["mtp"] is True
    md = st.export_markdown(c.id, meta)
    assert md.startswith("# Maths") and "## Assistant" in md and "2 + 2 = 4." in md and "decode tok s: 3.25" in md
    assert "- **Model:** tiny" in md and "mtp True" in md


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


def test_delete_one_message_and_restore_it(tmp_path: Path) -> None:
    st = Store(tmp_path / "c.db")
    c = st.new_conversation()
    u0 = st.add_message(c.id, "user", "q0")
    a0 = st.add_message(c.id, "assistant", "a0", {"tokens": 2})
    u1 = st.add_message(c.id, "user", "q1")
    a1 = st.add_message(c.id, "assistant", "a1")
    before = st.messages(c.id)
    # The only version of its turn: spliced out, what followed moves up a turn.
    gone = st.delete_message(u1.id)
    assert [(m.content, m.position) for m in st.messages(c.id)] == [("q0", 0), ("a0", 1), ("a1", 2)]
    assert st.messages(c.id)[2].parent_id == a0.id
    st.restore(gone)
    assert st.messages(c.id) == before
    # The last message: the one before it is shown.
    gone = st.delete_message(a1.id)
    assert [m.content for m in st.messages(c.id)] == ["q0", "a0", "q1"]
    st.restore(gone)
    assert st.messages(c.id) == before
    # One of several versions: it goes with the branch it leads, and the other version is shown.
    a0b = st.add_message(c.id, "assistant", "a0 again", parent_id=u0.id)
    st.add_message(c.id, "user", "q1 after a0b")
    shown = st.messages(c.id)
    gone = st.delete_message(a0b.id)
    assert st.messages(c.id) == before and st.versions(a0.id) == [a0.id]
    st.restore(gone)
    assert st.messages(c.id) == shown and st.versions(a0.id) == [a0.id, a0b.id]
    # The first message of a one-message conversation: nothing left shown, and back again.
    d = st.new_conversation()
    only = st.add_message(d.id, "user", "alone")
    gone = st.delete_message(only.id)
    assert st.messages(d.id) == []
    st.restore(gone)
    assert [m.content for m in st.messages(d.id)] == ["alone"]
    with pytest.raises(KeyError):
        st.delete_message(10_000)
