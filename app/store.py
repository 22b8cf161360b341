"""Conversations and messages in SQLite (WAL), in the user data directory.

Every completed message is committed in its own transaction the moment it is complete, so a crash (even
kill -9 mid-generation) never loses a message the window already showed as complete; WAL keeps readers
and the writer from blocking each other. Per-message generation stats are stored with the message.
No Qt here: the window calls this from the GUI thread.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    stats TEXT,
    created REAL NOT NULL,
    UNIQUE (conversation_id, position)
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, position);
"""


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
        self.db.executescript(SCHEMA)

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
                "LEFT JOIN messages m ON m.conversation_id = c.id "
                "WHERE c.title LIKE ? ESCAPE '\\' OR m.content LIKE ? ESCAPE '\\' ORDER BY c.updated DESC, c.id DESC",
                (like, like)).fetchall()
        else:
            rows = self.db.execute(
                "SELECT id, title, created, updated FROM conversations ORDER BY updated DESC, id DESC").fetchall()
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
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- messages ----------------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str,
                    stats: dict[str, Any] | None = None) -> StoredMessage:
        """Append a complete message (committed before returning)."""
        now = time.time()
        with _transaction(self.db):
            pos = self.db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id = ?",
                                  (conversation_id,)).fetchone()[0]
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, stats, created) VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, pos, role, content, json.dumps(stats) if stats else None, now))
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return StoredMessage(int(cur.lastrowid), conversation_id, pos, role, content, stats or {}, now)

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self.db.execute(
            "SELECT id, conversation_id, position, role, content, stats, created FROM messages "
            "WHERE conversation_id = ? ORDER BY position", (conversation_id,)).fetchall()
        return [StoredMessage(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]) if r[5] else {}, r[6]) for r in rows]

    def truncate_from(self, conversation_id: int, position: int) -> None:
        """Drop messages at `position` and after (edit a user message and re-run, or regenerate)."""
        with _transaction(self.db):
            self.db.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?",
                            (conversation_id, position))
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))

    # -- export ------------------------------------------------------------------------------------
    def export_json(self, conversation_id: int) -> str:
        c = self.conversation(conversation_id)
        return json.dumps({
            "title": c.title, "created": c.created, "updated": c.updated,
            "messages": [{"role": m.role, "content": m.content, "stats": m.stats, "created": m.created}
                         for m in self.messages(conversation_id)],
        }, indent=2, ensure_ascii=False)

    def export_markdown(self, conversation_id: int) -> str:
        c = self.conversation(conversation_id)
        parts = [f"# {c.title}", ""]
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
