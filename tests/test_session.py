"""The chat session without a window: send, regenerate (a sibling reply), edit (a sibling user message), version
switching, failed, stopped and unsaved replies, delete and undo, and the model the worker reports."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.reply_stats import footer
from app.session import ChatSession, ModelInfo, State
from app.store import Store
from engine.chat import Message

MODEL = ModelInfo(name="tiny", path="/models/tiny.gguf", context=4096, architecture="qwen35moe", server=None,
                  notices=())


@pytest.fixture
def reported() -> list[str]:
    return []


@pytest.fixture
def session(tmp_path: Path, reported: list[str]) -> ChatSession:
    s = ChatSession(Store(tmp_path / "c.db"), reported.append)
    s.model = MODEL
    return s


def _exchange(s: ChatSession, text: str, reply: str) -> list[Message]:
    """Post `text`, begin the reply and finish it with `reply`; the messages that went to the engine."""
    assert s.post(text)
    msgs = s.reply("", "auto")
    assert msgs is not None
    s.finish(reply, "eos")
    return msgs


def test_send_stores_the_question_and_its_reply(session: ChatSession, reported: list[str]) -> None:
    blank = ChatSession(session.store, reported.append)  # no model loaded: nothing is sent
    assert not blank.post("Hi") and blank.conv_id is None
    assert not session.post("")
    assert session.post("What is 12 plus 30?")
    assert session.conv_id is not None and session.store.conversation(session.conv_id).title == "What is 12 plus 30?"
    msgs = session.reply("  Be brief. ", "K=2")
    assert msgs == [Message("system", "Be brief."), Message("user", "What is 12 plus 30?")]
    assert session.state is State.WAITING and session.generating and session.reply_mode == "K=2"
    assert [m.role for m in session.shown] == ["user"] and session.reply_parent == session.shown[0].id
    assert not session.post("Another while it answers") and session.reply("", "off") is None
    assert session.token_arrived() and session.state is State.STREAMING and not session.token_arrived()
    done = session.finish("42", "eos")
    assert session.state is State.IDLE and not done.stopped and done.versions == 1
    assert done.saved is not None and done.saved.parent_id == session.reply_parent
    assert done.stats == {"stop_reason": "eos", "mtp": "K=2", "model": "tiny"}  # no Stats came: the mode asked
    assert [m.content for m in session.store.messages(session.conv_id)] == ["What is 12 plus 30?", "42"]
    assert session.shown[-1] == done.saved and not reported
    assert session.reply("", "off") == [Message("user", "What is 12 plus 30?")]  # no system prompt: none sent


def test_regenerate_makes_a_sibling_reply(session: ChatSession) -> None:
    _exchange(session, "Hello", "Hi there")
    first = session.shown[-1]
    msgs = session.reply("", "auto")  # the branch ends with a reply: a new version of it
    assert msgs == [Message("user", "Hello")] and [m.role for m in session.shown] == ["user"]
    done = session.finish("Hello!", "eos")
    assert done.saved is not None and done.versions == 2 and done.saved.parent_id == first.parent_id
    assert session.store.versions(first.id) == [first.id, done.saved.id]
    assert [m.content for m in session.store.messages(session.conv_id)] == ["Hello", "Hello!"]
    assert session.version_of(first) == (1, 2) and session.version_of(done.saved) == (2, 2)


def test_edit_makes_a_sibling_user_message_and_nothing_is_lost(session: ChatSession) -> None:
    _exchange(session, "First question", "First answer")
    _exchange(session, "Second question", "Second answer")
    assert session.edit(1) is None and session.edit(9) is None  # a reply, or no such message
    old = session.edit(0)
    assert old is not None and session.editing == old and old.content == "First question"
    assert session.cancel_edit() and session.editing is None and not session.cancel_edit()
    session.edit(0)
    msgs = _exchange(session, "First question, edited", "Edited answer")
    assert msgs == [Message("user", "First question, edited")] and session.editing is None
    now = session.store.messages(session.conv_id)
    assert [m.content for m in now] == ["First question, edited", "Edited answer"]
    assert session.store.versions(now[0].id) == [old.id, now[0].id]
    assert len(session.store.messages(session.conv_id)) == 2
    session.reply("", "auto")
    assert session.edit(0) is None  # not while a reply is under way
    session.finish("", "stopped")


def test_switching_versions_shows_the_other_branch(session: ChatSession) -> None:
    _exchange(session, "Question", "Answer")
    _exchange(session, "Follow-up", "More")
    session.edit(0)
    _exchange(session, "Question again", "Answer again")
    assert not session.switch_version(0, 1)  # the newest version already
    session.edit(0)
    assert session.switch_version(0, -1) and session.editing is None  # switching ends an edit
    assert [m.content for m in session.shown] == ["Question", "Answer", "Follow-up", "More"]
    assert session.version_of(session.shown[0]) == (1, 2) and session.version_of(session.shown[2]) == (1, 1)
    assert not session.switch_version(0, -1) and not session.switch_version(7, 1)
    assert session.switch_version(0, 1) and [m.content for m in session.shown] == ["Question again", "Answer again"]
    session.reply("", "auto")
    assert not session.switch_version(0, -1)  # not while a reply is under way


def test_a_failed_reply_is_not_saved_and_the_branch_is_read_again(session: ChatSession) -> None:
    _exchange(session, "Question", "Answer")
    assert session.post("Will this fail?") and session.reply("", "auto") is not None
    session.token_arrived()
    session.fail()
    assert session.state is State.IDLE
    assert [m.content for m in session.shown] == ["Question", "Answer", "Will this fail?"]
    assert session.store.messages(session.conv_id)[-1].role == "user"
    again = session.reply("", "auto")  # Retry answers the same question
    assert again is not None and again[-1] == Message("user", "Will this fail?")


def test_stopped_replies_are_kept_and_marked(session: ChatSession) -> None:
    session.post("Go on forever")
    session.reply("", "off")
    done = session.finish("and on and", "stopped")
    assert done.stopped and done.saved is not None and done.saved.stats["stop_reason"] == "stopped"
    session.reply("", "off")
    done = session.finish("", "stopped")  # stopped before any text: the empty reply is kept too
    assert done.stopped and done.saved is not None and done.saved.content == "" and done.versions == 2
    session.reply("", "off")
    cut = session.finish("half", "interrupted")  # a remote reply cut mid-way
    assert cut.stopped and cut.saved is not None and cut.versions == 3
    session.post("x " * 10)
    session.reply("", "off")
    done = session.finish("", "context_overflow")  # nothing was generated: nothing to keep
    assert done.saved is None and not done.stopped and session.state is State.IDLE
    assert session.store.messages(session.conv_id)[-1].role == "user"


def test_a_failing_store_is_reported_and_the_session_goes_on(session: ChatSession, reported: list[str]) -> None:
    _exchange(session, "Question", "Answer")
    answer = session.shown[-1]
    assert session.post("Next") and session.reply("", "auto") is not None
    session.store.db.execute("PRAGMA query_only=ON")  # the file turned read-only
    done = session.finish("An answer", "eos")
    assert done.saved is None and session.state is State.IDLE
    assert "read-only" in reported[-1] and reported[-1].endswith("The reply is shown but was not saved.")
    assert not session.post("Will this be saved?") and len(reported) == 2
    assert not session.switch_version(1, -1)  # one version only: nothing to write
    session.store.db.execute("PRAGMA query_only=OFF")
    session.store.db.close()  # now every read fails too: it reads as no rows
    session.open(session.conv_id)
    assert session.shown == [] and session.conversations() == [] and session.version_of(answer) == (1, 1)
    assert len(reported) == 5 and all("closed database" in r for r in reported[2:])


def test_new_delete_and_undo(session: ChatSession) -> None:
    _exchange(session, "Keep me", "Kept")
    conv = session.conv_id
    deleted = session.delete()
    assert deleted is not None and deleted.id == conv and session.conv_id is None and session.shown == []
    assert session.conversations() == [] and session.delete() is None
    assert session.undo_delete() and session.conv_id == conv and len(session.shown) == 2
    assert not session.undo_delete()
    session.rename("Renamed")
    assert [c.title for c in session.conversations()] == ["Renamed"]
    session.reply("", "auto")
    assert not session.new() and session.delete() is None  # not while a reply is under way
    session.finish("", "stopped")
    assert session.new() and session.conv_id is None


def test_model_info_from_the_workers_report() -> None:
    local = ModelInfo.of({"path": "/m/a.gguf", "name": "a", "architecture": "qwen35moe", "context": 2048,
                          "notices": ["native kernels"], "layers": 2})
    assert local == ModelInfo("a", "/m/a.gguf", 2048, "qwen35moe", None, ("native kernels",)) and not local.remote
    remote = ModelInfo.of({"remote": True, "name": "box", "path": "http://h:8080", "server": "llama.cpp",
                           "context": 0, "notices": [], "mtp_per_request": False})
    assert remote.remote and remote.server == "llama.cpp" and remote.context == 0 and remote.architecture == ""
    # Replies of different engines are told apart; a server that chooses its own MTP is never called "auto".
    assert local.engine == "a · this computer" and remote.engine == "box · remote llama.cpp server"
    assert local.mode(True, "auto") == "auto" and local.mode(False, "auto") == "off"
    assert remote.server_mtp and remote.mode(True, "auto") == "server" and remote.mode(False, "3") == "server"
    foretell = ModelInfo.of({"remote": True, "name": "f", "path": "http://h:8000", "server": "foretell",
                             "context": 4096, "notices": [], "mtp_per_request": True})
    assert not foretell.server_mtp and foretell.mode(True, "2") == "K=2"


def _words(msgs: list[Message]) -> int:
    """A token counter: each word a token, and 2 of template per message."""
    return sum(len(m.content.split()) + 2 for m in msgs)


def test_a_long_message_never_breaks_the_conversation(session: ChatSession) -> None:
    from app.context import DoesNotFit, TokenCounter

    session.counter = TokenCounter(_words, 400)
    _exchange(session, "word " * 150, "answer " * 100)
    long = "word " * 390  # does not fit even alone: refused before it is stored
    assert "holds 400 tokens" in (session.refusal(long, "") or "") and session.refusal("Hello!", "") is None
    stored = session.store.messages(session.conv_id)
    # The next message fits only without the first exchange: it is left out, the system prompt kept.
    assert session.post("next " * 120)
    msgs = session.reply("Be brief.", "auto", max_tokens=100)
    assert msgs == [Message("system", "Be brief."), Message("user", "next " * 120)] and session.left_out == 2
    done = session.finish("Fine.", "eos")
    assert done.stats["left_out"] == 2 and "made without the 2 oldest messages" in footer(done.stats)
    assert len(session.store.messages(session.conv_id)) == len(stored) + 2  # nothing was deleted
    # A conversation that already holds a message too long for the context (stored before this check) goes on.
    session.store.add_message(session.conv_id, "user", long)
    with pytest.raises(DoesNotFit):
        session.reply("", "auto")
    assert session.state is State.IDLE
    session.store.add_message(session.conv_id, "assistant", "")
    assert session.post("Hello!") and session.reply("", "auto") == [Message("user", "Hello!")]
    session.finish("Hi", "eos")
    fit = session.measure("", 100)  # the meter: what the next reply would be sent without
    assert fit is not None and fit.left_out == 6 and fit.tokens == _words([Message("user", "Hello!"),
                                                                          Message("assistant", "Hi")])


def test_delete_one_message_and_undo(session: ChatSession) -> None:
    _exchange(session, "Question", "Answer")
    _exchange(session, "Too long to keep", "Reply to it")
    assert session.delete_message(2) and session.removed is not None
    assert [m.content for m in session.shown] == ["Question", "Answer", "Reply to it"]
    assert not session.delete_message(7)
    assert session.undo_delete() and session.removed is None
    assert [m.content for m in session.shown] == ["Question", "Answer", "Too long to keep", "Reply to it"]
    assert session.delete_message(3) and [m.content for m in session.shown][-1] == "Too long to keep"
    conv = session.delete()  # a later delete is what Undo brings back
    assert conv is not None and session.removed is None and session.undo_delete()
    assert session.conv_id == conv.id and len(session.shown) == 3
    session.reply("", "auto")
    assert not session.delete_message(0)  # not while a reply is under way


def test_titles_tell_conversations_apart_and_follow_the_first_message(session: ChatSession) -> None:
    from app.session import list_labels

    _exchange(session, "Hello!", "Hi")
    first = session.conv_id
    session.edit(0)
    _exchange(session, "Hello, how are you?", "Fine")
    assert session.store.conversation(first).title == "Hello, how are you?"  # still named after its first message
    session.rename("Greetings")
    session.edit(0)
    _exchange(session, "Hey", "Hi")
    assert session.store.conversation(first).title == "Greetings"  # a title the user chose stays
    _exchange(session, "Second question", "Answer")
    session.edit(2)  # not the first message: the title stays
    _exchange(session, "Second question, edited", "Answer")
    assert session.store.conversation(first).title == "Greetings"
    session.new()
    _exchange(session, "Hello!", "Hi")
    session.new()
    _exchange(session, "Hello!", "Hi")
    convs = session.conversations()
    labels = list_labels(convs, session.models())
    assert session.models() == {c.id: "tiny" for c in convs}
    twins = [text for c, (text, _tip) in zip(convs, labels) if c.title == "Hello!"]
    assert len(twins) == 2 and all(t.startswith("Hello!\n") and t.endswith(" · tiny") for t in twins)
    assert dict(zip([c.title for c in convs], labels))["Greetings"][0] == "Greetings"  # unique: the title alone
    assert all(tip.split("\n")[1].startswith("Started ") for _t, tip in labels)
