"""Conversations and messages in SQLite (WAL, the lock held), in the user data directory.

Every completed message is committed in its own transaction the moment it is complete, so a crash (even
kill -9 mid-generation) never loses a message the window already showed as complete. The store holds the database's
lock while open (WAL in exclusive locking mode): the WAL index then lives in this process's memory instead of a
`-shm` file mapped into it, which anything that truncates it or takes its write access away (a sync tool, chattr +i)
turned into a SIGBUS that killed the app at its next write. One app at a time holds the history; another one gets
StoreError("locked"). Per-message generation stats are stored with the message.
A conversation is a tree (app/store_schema.py): an edited message or a regenerated reply is a new sibling
(a version) of the old one, and the conversation's leaf picks the branch that `messages` returns.
No Qt here: the window calls this from the GUI thread.

Faults are StoreError with a plain message, never a sqlite traceback: opening checks the file's integrity and
that it can be written (`kind` says which: "damaged", "readonly", "unwritable", "locked"), and every read or write that
fails later (disk full, a file made read-only, a damaged page) raises it too, so the window can say so and go on.
`move_aside` renames a damaged database (never deletes it); `Store.in_memory()` runs without history.
"""
from __future__ import annotations

import functools
import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import Any, Callable, Sequence, TypeVar

from app.store_schema import ensure_schema

F = TypeVar("F", bound=Callable[..., Any])
LOCK_WAIT_S = 2.0  # how long opening waits for another program's lock on the database


class StoreError(Exception):
    """The conversation store cannot be opened, read or written; `kind`: damaged | readonly | unwritable | locked |
    failed."""

    def __init__(self, message: str, kind: str = "failed"):
        super().__init__(message)
        self.kind = kind


def _reason(e: BaseException) -> tuple[str, str]:
    """(kind, plain reason) of a sqlite or OS error."""
    text = str(e).strip() or type(e).__name__
    low = text.lower()
    if "readonly" in low or "read-only" in low or isinstance(e, PermissionError):
        return "readonly", "the file or its folder is read-only"
    if "database is locked" in low:
        return "locked", "another program has it open (another Foretell?)"
    if "disk is full" in low or "no space" in low:
        return "failed", "the disk is full"
    if "malformed" in low or "not a database" in low or "corrupt" in low:
        return "damaged", "the database file is damaged"
    if "unable to open" in low or isinstance(e, OSError):
        return "unwritable", f"the file cannot be opened or created ({getattr(e, 'strerror', None) or text})"
    return "failed", text.splitlines()[0][:200]


def _guarded(what: str) -> Callable[[F], F]:
    """Turn sqlite/OS failures of a store method into StoreError("could not <what>: <reason>")."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(self: "Store", *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except (sqlite3.Error, OSError) as e:
                kind, why = _reason(e)
                raise StoreError(f"Could not {what}: {why}.", kind) from None
        return run  # type: ignore[return-value]
    return wrap


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
_RAW_COLS = "id, conversation_id, parent_id, position, role, content, stats, created"  # rows as stored, to restore


@dataclass(frozen=True)
class Removed:
    """What `Store.delete_message` took out: enough for `Store.restore` to put it back as it was."""

    conversation_id: int
    rows: tuple[tuple, ...]  # the deleted rows as stored, parents before children
    spliced: tuple[int, ...]  # the messages moved up to the deleted one's parent (it was its turn's only version)
    leaf_id: int | None  # the leaf shown before


def _message(r: tuple) -> StoredMessage:
    return StoredMessage(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]) if r[5] else {}, r[6], r[7])


def default_db_path() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("Foretell", appauthor=False)) / "conversations.sqlite3"


class Store:
    def __init__(self, path: str | Path | None = None):
        """Open (or create) the database; StoreError if it is damaged, read-only or cannot be created."""
        self.path: Path | None = Path(path) if path is not None else default_db_path()
        self.db: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._open(str(self.path))
            bad = self.db.execute("PRAGMA quick_check").fetchall()  # type: ignore[union-attr]
            if bad != [("ok",)]:
                raise StoreError(f"The conversation database {self.path} is damaged "
                                 f"({str(bad[0][0])[:120]}).", "damaged")
            with _transaction(self.db):  # type: ignore[arg-type]
                self.db.execute("CREATE TABLE IF NOT EXISTS _write_probe (x)")  # type: ignore[union-attr]
                self.db.execute("DROP TABLE _write_probe")  # type: ignore[union-attr]
        except StoreError:
            self.close()
            raise
        except (sqlite3.Error, OSError) as e:
            self.close()
            kind, why = _reason(e)
            raise StoreError(f"The conversation database {self.path} cannot be used: {why}.", kind) from None

    @staticmethod
    def default_path() -> Path:
        return default_db_path()

    @classmethod
    def in_memory(cls) -> "Store":
        """A store that keeps this session's chats in memory only ("run without history")."""
        st = cls.__new__(cls)
        st.path = None
        st._open(":memory:")
        return st

    def _open(self, target: str) -> None:
        self.db = sqlite3.connect(target, isolation_level=None, timeout=LOCK_WAIT_S)  # autocommit; transactions below
        self.db.execute("PRAGMA locking_mode=EXCLUSIVE")  # before WAL is entered: no -shm file is ever mapped
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        self.db.execute("PRAGMA foreign_keys=ON")
        ensure_schema(self.db)
        self.purge_deleted()

    @property
    def persistent(self) -> bool:
        return self.path is not None

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    # -- conversations -----------------------------------------------------------------------------
    @_guarded("start a conversation")
    def new_conversation(self, title: str = "New chat") -> Conversation:
        now = time.time()
        cur = self.db.execute("INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)",
                              (title, now, now))
        return Conversation(int(cur.lastrowid), title, now, now)

    @_guarded("list the conversations")
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

    @_guarded("read the models")
    def models(self) -> dict[int, str]:
        """Each conversation's model: the one that made its newest reply (from the reply's stats)."""
        return dict(self.db.execute(
            "SELECT m.conversation_id, json_extract(m.stats, '$.model') FROM messages m JOIN (SELECT MAX(id) AS id "
            "FROM messages WHERE role = 'assistant' AND stats IS NOT NULL GROUP BY conversation_id) last "
            "ON last.id = m.id WHERE json_extract(m.stats, '$.model') IS NOT NULL").fetchall())

    @_guarded("read the conversation")
    def conversation(self, conversation_id: int) -> Conversation:
        row = self.db.execute("SELECT id, title, created, updated FROM conversations WHERE id = ?",
                              (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return Conversation(*row)

    @_guarded("rename the conversation")
    def rename(self, conversation_id: int, title: str) -> None:
        title = title.strip() or "Untitled"
        self.db.execute("UPDATE conversations SET title = ?, updated = ? WHERE id = ?",
                        (title, time.time(), conversation_id))

    @_guarded("read the conversation's settings")
    def conversation_settings(self, conversation_id: int) -> dict[str, Any] | None:
        """The settings the conversation has of its own (as stored by `set_conversation_settings`); None: it
        uses the defaults."""
        row = self.db.execute("SELECT settings FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        return json.loads(row[0]) if row and row[0] else None

    @_guarded("save the conversation's settings")
    def set_conversation_settings(self, conversation_id: int, settings: dict[str, Any] | None) -> None:
        self.db.execute("UPDATE conversations SET settings = ? WHERE id = ?",
                        (json.dumps(settings) if settings is not None else None, conversation_id))

    @_guarded("read the system prompt presets")
    def presets(self) -> dict[str, str]:
        """Saved system prompts by name, in name order."""
        return dict(self.db.execute("SELECT name, text FROM presets ORDER BY name COLLATE NOCASE").fetchall())

    @_guarded("save the preset")
    def save_preset(self, name: str, text: str) -> None:
        self.db.execute("INSERT INTO presets (name, text) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET "
                        "text = excluded.text", (name.strip(), text))

    @_guarded("delete the preset")
    def delete_preset(self, name: str) -> None:
        self.db.execute("DELETE FROM presets WHERE name = ?", (name,))

    @_guarded("delete the conversation")
    def delete(self, conversation_id: int) -> None:
        """Hide the conversation; `undelete` brings it back until the store is next opened (then it is purged)."""
        self.db.execute("UPDATE conversations SET deleted = ? WHERE id = ?", (time.time(), conversation_id))

    @_guarded("restore the conversation")
    def undelete(self, conversation_id: int) -> None:
        self.db.execute("UPDATE conversations SET deleted = NULL WHERE id = ?", (conversation_id,))

    def purge_deleted(self) -> None:
        self.db.execute("DELETE FROM conversations WHERE deleted IS NOT NULL")

    # -- messages ----------------------------------------------------------------------------------
    @_guarded("save the message")
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

    @_guarded("read the messages")
    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """The shown branch, first message first."""
        rows = self.db.execute(
            "WITH RECURSIVE path(id) AS (SELECT leaf_id FROM conversations WHERE id = ? AND leaf_id IS NOT NULL "
            "UNION ALL SELECT m.parent_id FROM messages m JOIN path ON m.id = path.id WHERE m.parent_id IS NOT NULL) "
            f"SELECT {_MSG_COLS} FROM messages WHERE id IN (SELECT id FROM path) ORDER BY position",
            (conversation_id,)).fetchall()
        return [_message(r) for r in rows]

    @_guarded("read the versions")
    def versions(self, message_id: int) -> list[int]:
        """Ids of the versions of this message's turn (it and its siblings), oldest first."""
        return [r[0] for r in self.db.execute(
            "SELECT s.id FROM messages m JOIN messages s ON s.conversation_id = m.conversation_id "
            "AND s.parent_id IS m.parent_id WHERE m.id = ? ORDER BY s.id", (message_id,))]

    @_guarded("show the version")
    def show_version(self, message_id: int) -> None:
        """Show the branch through `message_id`, down to its newest message."""
        with _transaction(self.db):
            row = self.db.execute(
                "WITH RECURSIVE sub(id) AS (SELECT ? UNION ALL SELECT m.id FROM messages m JOIN sub "
                "ON m.parent_id = sub.id) SELECT MAX(id) FROM sub", (message_id,)).fetchone()
            self.db.execute("UPDATE conversations SET leaf_id = ? WHERE id = (SELECT conversation_id FROM messages "
                            "WHERE id = ?)", (row[0], message_id))

    @_guarded("delete the message")
    def delete_message(self, message_id: int) -> Removed:
        """Take one message out of its conversation. A message that is the only version of its turn is spliced
        out (what followed it moves up a turn); one of several versions goes with the branch it leads (another
        version is shown). What `restore` needs to put it all back."""
        with _transaction(self.db):
            row = self.db.execute("SELECT conversation_id, parent_id FROM messages WHERE id = ?",
                                  (message_id,)).fetchone()
            if row is None:
                raise KeyError(f"no message {message_id}")
            conv, parent = row
            leaf = self.db.execute("SELECT leaf_id FROM conversations WHERE id = ?", (conv,)).fetchone()[0]
            siblings = [r[0] for r in self.db.execute(
                "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id", (conv, parent))]
            below = self._subtree(message_id)
            if len(siblings) > 1:
                rows = self.db.execute(f"SELECT {_RAW_COLS} FROM messages WHERE id IN ({_marks(below)}) "
                                       "ORDER BY position, id", below).fetchall()
                self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))  # its branch goes with it
                earlier = [i for i in siblings if i < message_id]
                other = earlier[-1] if earlier else next(i for i in siblings if i > message_id)
                new_leaf = max(self._subtree(other)) if leaf in below else leaf
                spliced: tuple[int, ...] = ()
            else:
                rows = self.db.execute(f"SELECT {_RAW_COLS} FROM messages WHERE id = ?", (message_id,)).fetchall()
                spliced = tuple(r[0] for r in self.db.execute("SELECT id FROM messages WHERE parent_id = ?",
                                                              (message_id,)))
                self._shift(below[1:], -1)
                self.db.execute("UPDATE messages SET parent_id = ? WHERE parent_id = ?", (parent, message_id))
                self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
                new_leaf = parent if leaf == message_id else leaf
            self.db.execute("UPDATE conversations SET leaf_id = ?, updated = ? WHERE id = ?",
                            (new_leaf, time.time(), conv))
        return Removed(conv, tuple(rows), spliced, leaf)

    @_guarded("restore the message")
    def restore(self, removed: Removed) -> None:
        """Put back what `delete_message` took out, with the same ids, and show the branch that was shown."""
        with _transaction(self.db):
            self.db.executemany(f"INSERT INTO messages ({_RAW_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", removed.rows)
            if removed.spliced:
                top = removed.rows[0][0]
                self.db.execute(f"UPDATE messages SET parent_id = ? WHERE id IN ({_marks(removed.spliced)})",
                                (top, *removed.spliced))
                self._shift(self._subtree(top)[1:], 1)
            self.db.execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (removed.leaf_id,
                                                                                  removed.conversation_id))

    def _subtree(self, message_id: int) -> list[int]:
        """The message and every message below it, the message first."""
        return [r[0] for r in self.db.execute(
            "WITH RECURSIVE sub(id) AS (SELECT ? UNION ALL SELECT m.id FROM messages m JOIN sub ON m.parent_id = "
            "sub.id) SELECT id FROM sub", (message_id,))]

    def _shift(self, ids: list[int], by: int) -> None:
        if ids:
            self.db.execute(f"UPDATE messages SET position = position + ? WHERE id IN ({_marks(ids)})", (by, *ids))

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
        if exc_type is None:
            self.db.execute("COMMIT")
        elif self.db.in_transaction:  # sqlite has already rolled back after SQLITE_FULL: keep its error
            self.db.execute("ROLLBACK")


def move_aside(path: str | Path) -> Path:
    """Rename a damaged database (and its WAL files) to `<name>.damaged-<time>`; never deletes. Returns the new
    name of the database file."""
    p = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = p.with_name(f"{p.name}.damaged-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(p) + suffix)
        if src.exists():
            src.rename(Path(str(target) + suffix))
    return target


def _marks(ids: Sequence[int]) -> str:
    return ", ".join("?" * len(ids))


def _escape_like(s: str) -> str:
    return s.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
