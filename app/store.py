"""Conversations and messages in SQLite (WAL), in the user data directory.

Every completed message is committed in its own transaction the moment it is complete, so a crash (even
kill -9 mid-generation) never loses a message the window already showed as complete; WAL keeps readers
and the writer from blocking each other. Per-message generation stats are stored with the message.
A conversation is a tree (app/store_schema.py): an edited message or a regenerated reply is a new sibling
(a version) of the old one, and the conversation's leaf picks the branch that `messages` returns.
No Qt here: the window calls this from the GUI thread.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import Any

from app.store_schema import ensure_schema

@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created: float
    updated: float


@dataclass(frozen=True)
class StoredMessage:
    id: int
    conversation_id: int
    position: int
    role: str
    content: str
    stats: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    parent_id: int | None = None


_MSG_COLS = "id, conversation_id, position, role, content, stats, created, parent_id"


def _message(r: tuple) -> StoredMessage:
    return StoredMessage(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]) if r[5] else {}, r[6], r[7])


def default_db_path() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("Foretell", appauthor=False)) / "conversations.sqlite3"


class Store:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None)  # autocommit; explicit transactions below
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        self.db.execute("PRAGMA foreign_keys=ON")
        ensure_schema(self.db)
        self.purge_deleted()

    def close(self) -> None:
        self.db.close()

    # -- conversations -----------------------------------------------------------------------------
    def new_conversation(self, title: str = "New chat") -> Conversation:
        now = time.time()
        cur = self.db.execute("INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)",
                              (title, now, now))
        return Conversation(int(cur.lastrowid), title, now, now)

    def conversations(self, search: str | None = None) -> list[Conversation]:
        """Most recently updated first; `search` matches titles and message text (case-insensitive)."""
        if search:
            like = f"%{_escape_like(search)}%"
            rows = self.db.execute(
                "SELECT DISTINCT c.id, c.title, c.created, c.updated FROM conversations c "
                "LEFT JOIN messages m ON m.conversation_id = c.id WHERE c.deleted IS NULL AND "
                "(c.title LIKE ? ESCAPE '\\' OR m.content LIKE ? ESCAPE '\\') ORDER BY c.updated DESC, c.id DESC",
                (like, like)).fetchall()
        else:
            rows = self.db.execute(
                "SELECT id, title, created, updated FROM conversations WHERE deleted IS NULL "
                "ORDER BY updated DESC, id DESC").fetchall()
        return [Conversation(*r) for r in rows]

    def conversation(self, conversation_id: int) -> Conversation:
        row = self.db.execute("SELECT id, title, created, updated FROM conversations WHERE id = ?",
                              (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return Conversation(*row)

    def rename(self, conversation_id: int, title: str) -> None:
        title = title.strip() or "Untitled"
        self.db.execute("UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                        (title, time.time(), conversation_id))

    def delete(self, conversation_id: int) -> None:
        """Hide the conversation; `undelete` brings it back until the store is next opened (then it is purged)."""
        self.db.execute("UPDATE conversations SET deleted = ? WHERE id = ?", (time.time(), conversation_id))

    def undelete(self, conversation_id: int) -> None:
        self.db.execute("UPDATE conversations SET deleted = NULL WHERE id = ?", (conversation_id,))

    def purge_deleted(self) -> None:
        self.db.execute("DELETE FROM conversations WHERE deleted IS NOT NULL")

    # -- messages ----------------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str, stats: dict[str, Any] | None = None,
                    parent_id: int | None | EllipsisType = ...) -> StoredMessage:
        """Add a complete message (committed before returning) after `parent_id` — by default the end of the
        shown branch; an earlier message makes a new version of the turn after it — and show its branch."""
        now = time.time()
        with _transaction(self.db):
            if parent_id is ...:
                parent_id = self.db.execute("SELECT leaf_id FROM conversations WHERE id = ?",
                                            (conversation_id,)).fetchone()[0]
            row = self.db.execute("SELECT position FROM messages WHERE id = ? AND conversation_id = ?",
                                  (parent_id, conversation_id)).fetchone() if parent_id is not None else None
            if parent_id is not None and row is None:
                raise KeyError(f"no message {parent_id} in conversation {conversation_id}")
            pos = row[0] + 1 if row else 0
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, parent_id, position, role, content, stats, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, parent_id, pos, role, content, json.dumps(stats) if stats else None, now))
            self.db.execute("UPDATE conversations SET updated = ?, leaf_id = ? WHERE id = ?",
                            (now, cur.lastrowid, conversation_id))
        return StoredMessage(int(cur.lastrowid), conversation_id, pos, role, content, stats or {}, now, parent_id)

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """The shown branch, first message first."""
        rows = self.db.execute(
            "WITH RECURSIVE path(id) AS (SELECT leaf_id FROM conversations WHERE id = ? AND leaf_id IS NOT NULL "
            "UNION ALL SELECT m.parent_id FROM messages m JOIN path ON m.id = path.id WHERE m.parent_id IS NOT NULL) "
            f"SELECT {_MSG_COLS} FROM messages WHERE id IN (SELECT id FROM path) ORDER BY position",
            (conversation_id,)).fetchall()
        return [_message(r) for r in rows]

    def versions(self, message_id: int) -> list[int]:
        """Ids of the versions of this message's turn (it and its siblings), oldest first."""
        return [r[0] for r in self.db.execute(
            "SELECT s.id FROM messages m JOIN messages s ON s.conversation_id = m.conversation_id "
            "AND s.parent_id IS m.parent_id WHERE m.id = ? ORDER BY s.id", (message_id,))]

    def show_version(self, message_id: int) -> None:
        """Show the branch through `message_id`, down to its newest message."""
        with _transaction(self.db):
            row = self.db.execute(
                "WITH RECURSIVE sub(id) AS (SELECT ? UNION ALL SELECT m.id FROM messages m JOIN sub "
                "ON m.parent_id = sub.id) SELECT MAX(id) FROM sub", (message_id,)).fetchone()
            self.db.execute("UPDATE conversations SET leaf_id = ? WHERE id = (SELECT conversation_id FROM messages "
                            "WHERE id = ?)", (row[0], message_id))

    # -- export ------------------------------------------------------------------------------------
    def export_json(self, conversation_id: int, meta: dict[str, Any] | None = None) -> str:
        """The shown branch; `meta` (the model and settings it was made with) is recorded alongside."""
        c = self.conversation(conversation_id)
        return json.dumps({
            "title": c.title, "created": c.created, "updated": c.updated, **(meta or {}),
            "messages": [{"role": m.role, "content": m.content, "stats": m.stats, "created": m.created}
                         for m in self.messages(conversation_id)],
        }, indent=2, ensure_ascii=False)

    def export_markdown(self, conversation_id: int, meta: dict[str, Any] | None = None) -> str:
        c = self.conversation(conversation_id)
        parts = [f"# {c.title}", ""]
        for k, v in (meta or {}).items():
            if isinstance(v, dict):
                v = ", ".join(f"{a.replace('_', ' ')} {_fmt(b)}" for a, b in v.items())
            parts.append(f"- **{k.replace('_', ' ').capitalize()}:** {_fmt(v)}")
        if meta:
            parts.append("")
        for m in self.messages(conversation_id):
            parts += [f"## {m.role.capitalize()}", "", m.content, ""]
            if m.stats:
                s = m.stats
                bits = [f"{k.replace('_', ' ')}: {_fmt(v)}" for k, v in s.items() if not isinstance(v, (dict, list))]
                parts += [f"<sub>{' · '.join(bits)}</sub>", ""]
        return "\n".join(parts)


class _transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _escape_like(s: str) -> str:
    return s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
