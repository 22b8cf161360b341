"""The store's SQLite schema and its migrations (PRAGMA user_version), kept apart from the queries.

Version 2 made conversations a tree so that editing or regenerating never destroys a message: every message
names its parent, siblings are versions of the same turn, and a conversation's `leaf_id` says which branch is
shown. Conversations are deleted softly (`deleted`) so a delete can be undone until the store is next opened.
A version-1 database (a flat list: one position per message) is rebuilt in place in one transaction, each
message's parent being the one before it, so nothing in it is lost.

Version 3 gives a conversation settings of its own (`conversations.settings`: JSON of app.conversation_settings'
ConversationSettings; NULL: the global defaults) and keeps the saved system-prompt presets (`presets`). A version-2
database gets the column and the table in one transaction; its rows are untouched.
"""
from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from typing import Iterator

VERSION = 3

CONVERSATIONS = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    leaf_id INTEGER,
    deleted REAL,
    settings TEXT
);
"""

MESSAGES = """
CREATE TABLE IF NOT EXISTS {name} (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES {name}(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    stats TEXT,
    created REAL NOT NULL
);
"""

PRESETS = """
CREATE TABLE IF NOT EXISTS presets (
    name TEXT PRIMARY KEY,
    text TEXT NOT NULL
);
"""

INDEXES = """
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, position);
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(conversation_id, parent_id);
"""


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def ensure_schema(db: sqlite3.Connection) -> None:
    """Create the tables, or bring an older database up to VERSION without losing a row."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version >= VERSION:
        return
    if "id" not in _columns(db, "messages"):  # a new database
        db.executescript(CONVERSATIONS + MESSAGES.format(name="messages") + PRESETS + INDEXES
                         + f"PRAGMA user_version = {VERSION};")
        return
    if version < 2:
        _migrate_1_to_2(db)
    _migrate_2_to_3(db)


@contextmanager
def _step(db: sqlite3.Connection, version: int) -> Iterator[None]:
    """One migration step in one transaction that ends at `version` (rolled back whole on any failure)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute(f"PRAGMA user_version = {version}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _migrate_1_to_2(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA foreign_keys=OFF")  # the old table is dropped and the new one renamed into its place
    try:
        with _step(db, 2):
            cols = _columns(db, "conversations")
            for col, kind in (("leaf_id", "INTEGER"), ("deleted", "REAL")):
                if col not in cols:
                    db.execute(f"ALTER TABLE conversations ADD COLUMN {col} {kind}")
            db.execute(MESSAGES.format(name="messages_v2"))
            db.execute(
                "INSERT INTO messages_v2 (id, conversation_id, parent_id, position, role, content, stats, created) "
                "SELECT m.id, m.conversation_id, (SELECT p.id FROM messages p WHERE p.conversation_id = "
                "m.conversation_id AND p.position < m.position ORDER BY p.position DESC LIMIT 1), m.position, m.role, "
                "m.content, m.stats, m.created FROM messages m ORDER BY m.conversation_id, m.position")
            db.execute("DROP TABLE messages")
            db.execute("ALTER TABLE messages_v2 RENAME TO messages")
            db.execute("UPDATE conversations SET leaf_id = (SELECT id FROM messages WHERE conversation_id = "
                       "conversations.id ORDER BY position DESC LIMIT 1)")
            for stmt in INDEXES.strip().splitlines():
                db.execute(stmt)
    finally:
        db.execute("PRAGMA foreign_keys=ON")


def _migrate_2_to_3(db: sqlite3.Connection) -> None:
    with _step(db, 3):
        if "settings" not in _columns(db, "conversations"):
            db.execute("ALTER TABLE conversations ADD COLUMN settings TEXT")
        db.execute(PRESETS)
