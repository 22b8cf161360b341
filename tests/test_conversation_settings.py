"""Per-conversation settings (system prompt with saved presets, sampling, MTP) beside the global defaults: stored
with the conversation (schema v3, a v2 database migrated in place without loss), and applied to the replies of
that conversation only, through the real window."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from PySide6.QtCore import QSettings
from PySide6.QtTest import QTest

from app.conversation_settings import DEFAULTS, OWN
from app.session import ConversationSettings
from app.store import Store
from app.window import MainWindow
from engine.chat import Message
from engine.events import GenerationConfig
from tests.fixtures import TINY_MOE, fixture_path


def test_a_version_2_database_gains_conversation_settings_and_presets(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    db = sqlite3.connect(path)  # the version-2 schema, as the app created it before per-conversation settings
    db.executescript("""
        CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, created REAL NOT NULL,
            updated REAL NOT NULL, leaf_id INTEGER, deleted REAL);
        CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL
            REFERENCES conversations(id) ON DELETE CASCADE, parent_id INTEGER REFERENCES messages(id) ON DELETE
            CASCADE, position INTEGER NOT NULL, role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL, stats TEXT, created REAL NOT NULL);
        INSERT INTO conversations VALUES (1, 'Old', 1.0, 2.0, 2, NULL);
        INSERT INTO messages VALUES (1, 1, NULL, 0, 'user', 'hi', NULL, 1.0), (2, 1, 1, 1, 'assistant', 'hello',
            '{"tokens": 3}', 1.5);
        PRAGMA user_version = 2;
    """)
    db.commit()
    db.close()
    st = Store(path)
    assert [(m.id, m.content, m.parent_id, m.stats) for m in st.messages(1)] == [
        (1, "hi", None, {}), (2, "hello", 1, {"tokens": 3})]
    assert st.conversation_settings(1) is None and st.presets() == {}
    own = {"system_prompt": "Be brief.", "temperature": 0.5, "top_p": 0.9, "top_k": 20, "mtp": False, "draft": "2"}
    st.set_conversation_settings(1, own)
    st.save_preset("Brief", "Be brief.")
    st.save_preset("brief two", "Shorter.")
    st.save_preset("Brief", "Be very brief.")  # a name saved again replaces its text
    st.close()
    st = Store(path)  # migrated once: reopening keeps it all
    assert st.db.execute("PRAGMA user_version").fetchone()[0] == 3
    assert st.conversation_settings(1) == own and ConversationSettings.stored(own) == ConversationSettings(
        "Be brief.", 0.5, 0.9, 20, False, "2")
    assert st.presets() == {"Brief": "Be very brief.", "brief two": "Shorter."}
    st.delete_preset("brief two")
    assert list(st.presets()) == ["Brief"] and [m.content for m in st.messages(1)] == ["hi", "hello"]
    assert ConversationSettings.stored({"temperature": "warm"}) is None  # unreadable: the defaults


def test_own_settings_apply_to_their_conversation_only(qtbot, tmp_path: Path) -> None:
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    win = MainWindow(Store(tmp_path / "c.db"), qs, str(fixture_path(TINY_MOE)))
    qtbot.addWidget(win)
    qtbot.waitUntil(lambda: win.model_info is not None, timeout=30_000)
    win.show()
    win.settings.max_tokens = 8
    sent: list[tuple[list[Message], GenerationConfig]] = []
    win.engine.requestGenerate.connect(lambda msgs, gen: sent.append((msgs, gen)))
    panel = win.conv_panel

    def send(text: str) -> tuple[list[Message], GenerationConfig]:
        win.prompt.setPlainText(text)
        win.send()
        qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
        return sent[-1]

    # A conversation on the defaults: the panel is one line that says so.
    assert panel.state.text() == DEFAULTS and not panel.own.isChecked() and not panel.system_prompt.isVisible()
    msgs, gen = send("Hello!")
    a = win.conv_id
    assert msgs[0].role == "user" and gen.mtp and gen.sampling.temperature == 0.0 and gen.sampling.top_k == 0
    assert win.store.conversation_settings(a) is None
    # A new conversation takes its own settings (a copy of the defaults to change) and a saved preset.
    win.new_conversation()
    panel.own.click()
    assert panel.own.isChecked() and panel.state.text() == OWN and panel.system_prompt.isVisible()
    assert panel.temperature.value() == 0.0 and panel.mtp.isChecked()
    panel.system_prompt.setPlainText("You answer in one word.")
    panel.temperature.setValue(0.7)
    panel.top_p.setValue(0.9)
    panel.top_k.setValue(40)
    panel.mtp.setChecked(False)
    QTest.keyClicks(panel.preset.lineEdit(), "One word")
    panel.save_preset_btn.click()
    assert win.store.presets() == {"One word": "You answer in one word."} and panel.preset.count() == 1
    msgs, gen = send("Hello!")
    b = win.conv_id
    assert b != a and msgs[0] == Message("system", "You answer in one word.")
    assert (gen.sampling.temperature, gen.sampling.top_p, gen.sampling.top_k, gen.mtp) == (0.7, 0.9, 40, False)
    assert win.store.conversation_settings(b) == {"system_prompt": "You answer in one word.", "temperature": 0.7,
                                                  "top_p": 0.9, "top_k": 40, "mtp": False, "draft": "auto"}
    assert win.export_meta()["settings"]["temperature"] == 0.7
    # Back in the first conversation: the defaults, changed meanwhile, and the panel says so.
    win.open_conversation(a)
    assert panel.state.text() == DEFAULTS and not panel.own.isChecked()
    win.settings_panel.temperature.setValue(0.3)
    win.regenerate()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    msgs, gen = sent[-1]
    assert msgs[0].role == "user" and gen.sampling.temperature == 0.3 and gen.mtp
    # The second keeps its own; a preset picked there sets its system prompt.
    win.open_conversation(b)
    assert panel.state.text() == OWN and panel.temperature.value() == 0.7 and not panel.mtp.isChecked()
    panel.system_prompt.setPlainText("Chat freely.")
    panel.preset.setCurrentIndex(-1)
    panel.preset.setCurrentIndex(0)
    assert panel.system_prompt.toPlainText() == "You answer in one word."
    panel.mtp.setChecked(True)
    panel.draft.setCurrentText("2")
    win.regenerate()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    msgs, gen = sent[-1]
    assert msgs[0] == Message("system", "You answer in one word.") and gen.mtp and gen.draft == 2
    assert gen.sampling.temperature == 0.7
    # Back to the defaults: stored as none of its own.
    panel.own.click()
    assert win.store.conversation_settings(b) is None and panel.state.text() == DEFAULTS
    win.regenerate()
    qtbot.waitUntil(lambda: not win.generating, timeout=60_000)
    assert sent[-1][0][0].role == "user" and sent[-1][1].sampling.temperature == 0.3
