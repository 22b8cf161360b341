"""Chat transcript rendering: Markdown, highlighted copyable code, thinking blocks, throttled streaming."""
from __future__ import annotations

from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication

from app.chat_view import ChatView


def test_markdown_code_and_copy(qtbot) -> None:
    v = ChatView()
    qtbot.addWidget(v)
    v.add_message("user", "Show me code")
    v.add_message("assistant", "Here is **bold** and code:\n\n```python\ndef f(x):\n    return x + 1\n```\nDone.")
    html = v.toHtml()
    assert "font-weight" in html or "<b>" in html  # bold rendered by Qt's Markdown
    assert "copy:0" in html and "def" in v.toPlainText() and "Done." in v.toPlainText()
    assert "```" not in v.toPlainText()
    v._on_anchor(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == "def f(x):\n    return x + 1\n"


def test_thinking_is_collapsible(qtbot) -> None:
    v = ChatView()
    qtbot.addWidget(v)
    v.add_message("assistant", "<think>secret plan</think>The answer is 4.")
    assert "secret plan" not in v.toPlainText() and "The answer is 4." in v.toPlainText()
    v._on_anchor(QUrl("think:0"))
    assert "secret plan" in v.toPlainText()


def test_streaming_is_buffered_and_drafts_coloured(qtbot) -> None:
    v = ChatView()
    qtbot.addWidget(v)
    v.add_message("assistant")
    renders = []
    orig = v.render
    v.render = lambda: (renders.append(1), orig())
    for i in range(50):
        v.append_token(f"w{i} ", i % 2 == 0)
    qtbot.waitUntil(lambda: "w49" in v.toPlainText(), timeout=2000)
    assert len(renders) < 5  # one render per tick, not per token
    v.color_drafts = True
    v.render()
    assert "background:#d9f2dc" in v.toHtml().replace(" ", "") or "#d9f2dc" in v.toHtml()
    v.set_footer("12.0 tok/s · 50 tokens")
    assert "12.0 tok/s" in v.toPlainText() and v.last_reply().startswith("w0 w1")


def test_welcome_versions_copy_and_readable_width(qtbot) -> None:
    from app.chat_view import EXAMPLES, READABLE_WIDTH, ViewMessage

    v = ChatView()
    qtbot.addWidget(v)
    v.render()
    assert "Welcome to Foretell" in v.toPlainText() and all(q in v.toPlainText() for q in EXAMPLES)
    with qtbot.waitSignal(v.exampleChosen) as sig:
        v._on_anchor(QUrl("ask:What%20is%2012%20plus%2030%3F"))
    assert sig.args == ["What is 12 plus 30?"]
    v.set_messages([ViewMessage("user", "q", version=(2, 3)), ViewMessage("assistant", "", stopped=True)])
    assert "Welcome" not in v.toPlainText() and "2/3" in v.toPlainText() and "Stopped before any text" in v.toPlainText()
    assert "ver:0:-1" in v.toHtml() and "ver:0:1" in v.toHtml()
    with qtbot.waitSignal(v.versionRequested) as sig:
        v._on_anchor(QUrl("ver:0:1"))
    assert sig.args == [0, 1]
    v._on_anchor(QUrl("copymsg:0"))
    assert QGuiApplication.clipboard().text() == "q"
    v.resize(2400, 800)
    v.show()
    qtbot.waitUntil(lambda: v.viewport().width() <= READABLE_WIDTH + 40, timeout=2000)


def test_the_view_follows_the_end_while_a_long_document_is_laid_out(qtbot) -> None:
    from app.chat_view import ViewMessage

    v = ChatView()
    qtbot.addWidget(v)
    v.resize(500, 300)
    v.show()
    long = " ".join(f"Note {i}: the meeting is on day {i}." for i in range(300))
    v.set_messages([ViewMessage("user", "hi"), ViewMessage("user", long)])
    bar = v.verticalScrollBar()
    assert bar.maximum() > 0 and bar.value() == bar.maximum()
    bar.setRange(0, bar.maximum() + 500)  # as a visible view's layout grows after setHtml has returned
    assert bar.value() == bar.maximum()
    bar.setValue(10)  # the user scrolls up: the view stays where they put it
    v.add_message("assistant", "ok")
    bar.setRange(0, bar.maximum() + 100)
    assert not v.at_end and bar.value() < bar.maximum()
