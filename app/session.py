"""The conversation the window shows, without Qt (GPT4All's `Chat`): which conversation is open, the branch of it
that is shown, the user message being edited, the reply under way and the message it answers, and the model the
engine has loaded. It reads and writes the store and decides what is sent to the engine; `MainWindow` lays out,
draws, and wires the worker's signals to it.

Nothing the user made is lost: an edit or a regenerate adds a sibling (a version) of its turn, a stopped reply is
kept and marked, a deleted conversation or message comes back with Undo. What is sent fits the context
(app.context): the oldest exchanges are left out and the reply says so; a message that cannot fit is refused before
it is stored. A store that fails (disk full, read-only) never stops the session: `report` is told why, a write
says it did nothing (False or None), and a read that fails stands for no rows.

A conversation may have settings of its own (ConversationSettings: system prompt, sampling, MTP), stored with it;
one without them follows the global defaults (`effective`).
"""
from __future__ import annotations

import datetime as dt
import enum
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Callable, Mapping, TypeVar

from app import context
from app.context import Fit, TokenCounter
from app.reply_stats import mtp_mode, stats_dict
from app.speedup import SERVER
from app.store import Conversation, Removed, Store, StoredMessage, StoreError
from engine.chat import Message
from engine.events import GenerationConfig, Stats

T = TypeVar("T")
TITLE_CHARS = 48  # a new conversation is titled with the start of its first message


def auto_title(text: str) -> str:
    return text[:TITLE_CHARS].replace("\n", " ")


def list_labels(convs: list[Conversation], models: Mapping[int, str]) -> list[tuple[str, str]]:
    """(text, tooltip) of each conversation in the list: a title that several conversations share is followed by
    when each was started and its model, so they can be told apart."""
    seen = Counter(c.title for c in convs)
    out = []
    for c in convs:
        started = dt.datetime.fromtimestamp(c.created).strftime("%d %b %Y, %H:%M")
        about = " · ".join([started] + ([models[c.id]] if c.id in models else []))
        out.append((f"{c.title}\n{about}" if seen[c.title] > 1 else c.title, f"{c.title}\nStarted {about}"))
    return out


def system_messages(system_prompt: str) -> list[Message]:
    return [Message("system", system_prompt.strip())] if system_prompt.strip() else []


@dataclass(frozen=True)
class ConversationSettings:
    """What a conversation sets of its own, in place of the same fields of the global defaults (AppSettings)."""

    system_prompt: str = ""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    mtp: bool = True
    draft: str = "auto"  # "auto" or a depth's digits, as AppSettings.draft

    @classmethod
    def of(cls, defaults: Any) -> ConversationSettings:
        """The defaults' values of these fields (what a conversation starts from when it takes its own)."""
        return cls(**{f.name: getattr(defaults, f.name) for f in fields(cls)})

    @classmethod
    def stored(cls, d: Mapping[str, Any] | None) -> ConversationSettings | None:
        """From the store's JSON; None (the defaults) where there is none or it cannot be read."""
        if not isinstance(d, Mapping):
            return None
        try:
            return cls(**{f.name: type(f.default)(d[f.name]) for f in fields(cls) if f.name in d})
        except (TypeError, ValueError):
            return None

    def apply(self, defaults: T) -> T:
        """`defaults` (an AppSettings) with this conversation's values in place of its own."""
        return replace(defaults, **asdict(self))  # type: ignore[type-var]


class State(enum.Enum):
    IDLE = "idle"  # no reply under way: the user may send, edit, switch versions, open another conversation
    WAITING = "waiting"  # the engine has the prompt (it may still be processing it); no token yet
    STREAMING = "streaming"  # the reply's tokens are arriving


@dataclass(frozen=True)
class ModelInfo:
    """The engine the window talks to, as the worker reported it on loading."""

    name: str
    path: str  # the model file, or a remote server's URL
    context: int  # tokens; 0 where a remote server does not say
    architecture: str  # "" for a remote engine
    server: str | None  # a remote server's kind (llama.cpp, vllm, …); None for a local model
    notices: tuple[str, ...]
    server_mtp: bool = False  # MTP and its depth are a remote server's own setting (it takes none per request)

    @property
    def remote(self) -> bool:
        return self.server is not None

    @property
    def engine(self) -> str:
        """Which engine and model replies come from: replies of different engines are never compared."""
        return f"{self.name} · remote {self.server} server" if self.remote else f"{self.name} · this computer"

    def mode(self, mtp: bool, draft: str) -> str:
        """How a reply is decoded (app.reply_stats.mtp_mode), or SERVER where the server chooses."""
        return SERVER if self.server_mtp else mtp_mode(mtp, draft)

    @classmethod
    def of(cls, info: Mapping[str, Any]) -> ModelInfo:
        """From the worker's report: app.worker.model_info (a local file) or app.remote.remote_info."""
        remote = bool(info.get("remote", False))
        return cls(name=info["name"], path=info["path"], context=info["context"],
                   architecture="" if remote else info["architecture"], server=info["server"] if remote else None,
                   notices=tuple(info["notices"]), server_mtp=remote and not info["mtp_per_request"])


def stopped_early(reason: str) -> bool:
    """A reply stopped by the user or cut off by a remote server: kept, and marked."""
    return reason in ("stopped", "interrupted")


@dataclass(frozen=True)
class Finished:
    """A reply that ended: the stats stored with it and, where it was saved, the stored message."""

    stats: dict[str, Any]
    saved: StoredMessage | None  # None: not saved (nothing to save, or the store failed: `report` said why)
    versions: int  # the saved reply is the newest of this many versions of its turn (0 when not saved)
    stopped: bool


class ChatSession:
    def __init__(self, store: Store, report: Callable[[str], None]):
        self.store = store
        self.report = report  # why a store call failed (the window shows it); the session goes on
        self.conv_id: int | None = None
        self.shown: list[StoredMessage] = []  # the shown branch, as stored
        self.editing: StoredMessage | None = None  # the user message being edited (its turn gets a new version)
        self.reply_parent: int | None = None  # the user message the reply under way answers
        self.reply_mode = "off"  # how the reply is decoded (app.reply_stats.mtp_mode)
        self.state = State.IDLE
        self.model: ModelInfo | None = None
        self.last_stats: Stats | None = None
        self.counter: TokenCounter | None = None  # the engine's prompt length and context; None: not fitted
        self.left_out = 0  # the oldest messages the reply under way was sent without (they did not fit)
        self.deleted: int | None = None  # the conversation an Undo would bring back
        self.removed: Removed | None = None  # or the message(s) it would put back
        self.own: ConversationSettings | None = None  # the open (or next) conversation's own settings

    @property
    def generating(self) -> bool:
        return self.state is not State.IDLE

    def _failed(self, e: StoreError, note: str = "") -> None:
        self.report(f"{e} {note}".strip())

    def _read(self, call: Callable[[], T], empty: T) -> T:
        """call(); where the store fails, the failure is reported and `empty` stands for what it would have read."""
        try:
            return call()
        except StoreError as e:
            self._failed(e)
            return empty

    # -- conversations -----------------------------------------------------------------------------
    def conversations(self, search: str | None = None) -> list[Conversation]:
        return self._read(lambda: self.store.conversations(search), [])

    def models(self) -> dict[int, str]:
        """Each conversation's model (that of its newest reply)."""
        return self._read(self.store.models, {})

    def open(self, conv_id: int) -> None:
        self.conv_id, self.editing = conv_id, None
        shown, own = self._read(lambda: (self.store.messages(conv_id), self.store.conversation_settings(conv_id)),
                                ([], None))
        self.shown, self.own = shown, ConversationSettings.stored(own)

    def new(self) -> bool:
        """No conversation open (the next message starts one, with the defaults); False while a reply is under
        way."""
        if self.generating:
            return False
        self.conv_id, self.editing, self.shown, self.own = None, None, [], None
        return True

    # -- settings ----------------------------------------------------------------------------------
    def effective(self, defaults: T) -> T:
        """The settings a reply in the open conversation is made with: its own where it has them, else
        `defaults`."""
        return self.own.apply(defaults) if self.own is not None else defaults

    def set_own(self, own: ConversationSettings | None) -> bool:
        """Give the open conversation settings of its own (None: the defaults again), stored with it; with none
        open, they go with the conversation the next message starts. False where the store failed."""
        if self.conv_id is not None:
            try:
                self.store.set_conversation_settings(self.conv_id, asdict(own) if own is not None else None)
            except StoreError as e:
                self._failed(e)
                return False
        self.own = own
        return True

    def presets(self) -> dict[str, str]:
        return self._read(self.store.presets, {})

    def save_preset(self, name: str, text: str) -> bool:
        return self._write(lambda: self.store.save_preset(name, text))

    def delete_preset(self, name: str) -> bool:
        return self._write(lambda: self.store.delete_preset(name))

    def _write(self, call: Callable[[], None]) -> bool:
        try:
            call()
        except StoreError as e:
            self._failed(e)
            return False
        return True

    def rename(self, title: str) -> None:
        if self.conv_id is not None:
            try:
                self.store.rename(self.conv_id, title)
            except StoreError as e:
                self._failed(e)

    def delete(self) -> Conversation | None:
        """Delete the open conversation (`undo_delete` brings it back until the store is next opened) and leave
        none open; the conversation deleted, or None when nothing was."""
        if self.conv_id is None or self.generating:
            return None
        try:
            conv = self.store.conversation(self.conv_id)
            self.store.delete(conv.id)
        except StoreError as e:
            self._failed(e)
            return None
        self.deleted, self.removed = conv.id, None
        self.new()
        return conv

    def delete_message(self, index: int) -> bool:
        """Delete shown message `index` (`undo_delete` puts it back); False when it cannot be (a reply is under way,
        no such message, or the store failed)."""
        if self.generating or self.conv_id is None or not 0 <= index < len(self.shown):
            return False
        try:
            self.removed = self.store.delete_message(self.shown[index].id)
        except StoreError as e:
            self._failed(e)
            return False
        self.deleted, self.editing = None, None
        self.open(self.conv_id)
        return True

    def undo_delete(self) -> bool:
        """Bring back what was deleted last (a conversation, opened, or a message in its conversation); False when
        there is nothing or the store failed."""
        try:
            if self.removed is not None:
                self.store.restore(self.removed)
                conv = self.removed.conversation_id
            elif self.deleted is not None:
                self.store.undelete(self.deleted)
                conv = self.deleted
            else:
                return False
        except StoreError as e:
            self._failed(e)
            return False
        self.deleted, self.removed = None, None
        self.open(conv)
        return True

    def version_of(self, m: StoredMessage) -> tuple[int, int]:
        """(i, n): stored message `m` is version i of the n versions of its turn."""
        versions = self._read(lambda: self.store.versions(m.id), []) or [m.id]
        return versions.index(m.id) + 1, len(versions)

    def switch_version(self, index: int, step: int) -> bool:
        """Show the branch through the version `step` away from shown message `index`'s; False when there is none
        (or a reply is under way)."""
        if self.generating or self.conv_id is None or not 0 <= index < len(self.shown):
            return False
        m = self.shown[index]
        versions = self._read(lambda: self.store.versions(m.id), [])
        k = versions.index(m.id) + step if versions else -1
        if not 0 <= k < len(versions):
            return False
        try:
            self.store.show_version(versions[k])
        except StoreError as e:
            self._failed(e)
            return False
        self.open(self.conv_id)
        return True

    # -- editing -----------------------------------------------------------------------------------
    def edit(self, index: int) -> StoredMessage | None:
        """Edit shown user message `index`: the next `post` becomes a new version of it and the old one stays.
        The message, or None when it cannot be edited (not a user message, or a reply is under way)."""
        if self.generating or not 0 <= index < len(self.shown) or self.shown[index].role != "user":
            return None
        self.editing = self.shown[index]
        return self.editing

    def cancel_edit(self) -> bool:
        """Stop editing; False when nothing was being edited."""
        was, self.editing = self.editing is not None, None
        return was

    # -- replies -----------------------------------------------------------------------------------
    def refusal(self, text: str, system_prompt: str) -> str | None:
        """Why `text` cannot be sent — it does not fit the context even alone — or None when it can."""
        return context.refusal(system_messages(system_prompt), text, self.counter)

    def post(self, text: str) -> bool:
        """Store the user's message at the end of the shown branch, or as a new version of the message being
        edited (a new first message retitles a conversation still named after the old one); a conversation is
        started when none is open. False when nothing was stored (no text, no model, a reply under way, or the
        store failed): the text stays the user's."""
        if not text or self.generating or self.model is None:
            return False
        try:
            if self.conv_id is None:
                self.conv_id = self.store.new_conversation(auto_title(text)).id
                if self.own is not None:
                    self.store.set_conversation_settings(self.conv_id, asdict(self.own))
            parent = self.editing.parent_id if self.editing is not None else ...
            self.store.add_message(self.conv_id, "user", text, parent_id=parent)
            if self.editing is not None and parent is None and \
                    self.store.conversation(self.conv_id).title == auto_title(self.editing.content):
                self.store.rename(self.conv_id, auto_title(text))  # still named after the old first message
        except StoreError as e:
            self._failed(e)
            return False
        self.editing = None
        return True

    def measure(self, system_prompt: str, max_tokens: int) -> Fit | None:
        """How much of the context the shown branch takes (as the next reply would send it); None where there is
        none or prompts are not counted."""
        if self.counter is None or not self.shown:
            return None
        return context.measure(system_messages(system_prompt), [Message(m.role, m.content) for m in self.shown],
                               self.counter, max_tokens)

    def reply(self, system_prompt: str, mode: str, max_tokens: int = GenerationConfig.max_tokens
              ) -> list[Message] | None:
        """Begin a reply to the stored branch — a new version of its last reply where it ends with one (a
        regenerate). The messages to send to the engine, the oldest left out where they do not all fit with room
        for `max_tokens` (`left_out` says how many), or None when there is nothing to answer. DoesNotFit (nothing
        begun) when the message to answer does not fit even alone."""
        if self.generating or self.conv_id is None or self.model is None:
            return None
        conv = self.conv_id
        branch = self._read(lambda: self.store.messages(conv), [])
        if branch and branch[-1].role == "assistant":
            branch = branch[:-1]
        if not branch or branch[-1].role != "user":
            return None
        system, turns = system_messages(system_prompt), [Message(m.role, m.content) for m in branch]
        msgs, left_out = system + turns, 0
        if self.counter is not None:
            sent = context.fit(system, turns, self.counter, max_tokens)
            msgs, left_out = sent.messages, sent.left_out
        self.shown, self.reply_parent, self.reply_mode, self.left_out = branch, branch[-1].id, mode, left_out
        self.state, self.last_stats = State.WAITING, None
        return msgs

    def token_arrived(self) -> bool:
        """A token of the reply arrived; True for the first (the session goes from waiting to streaming)."""
        if self.state is not State.WAITING:
            return False
        self.state = State.STREAMING
        return True

    def finish(self, text: str, reason: str) -> Finished:
        """The reply ended (`reason`: the engine's stop reason). It is saved as a child of the message it answers,
        stopped or empty too — all but an empty reply to a conversation that does not fit."""
        self.state = State.IDLE  # first: a failed save below must not leave the session generating
        stats = stats_dict(self.last_stats, reason, self.reply_mode, self.model.name if self.model else "",
                           self.left_out)
        stopped = stopped_early(reason)
        conv, parent = self.conv_id, self.reply_parent
        if conv is None or parent is None or (not text and reason == "context_overflow"):
            return Finished(stats, None, 0, stopped)
        try:
            saved = self.store.add_message(conv, "assistant", text, stats, parent_id=parent)
        except StoreError as e:
            self._failed(e, "The reply is shown but was not saved.")  # the window still shows it
            return Finished(stats, None, 0, stopped)
        self.shown = self.shown + [saved]
        return Finished(stats, saved, self.version_of(saved)[1], stopped)

    def fail(self) -> None:
        """The reply failed: its partial text was never saved, so the shown branch is read again."""
        self.state = State.IDLE
        if self.conv_id is not None:
            self.open(self.conv_id)
