"""The chat transcript: Markdown replies with highlighted code blocks (each with its own Copy), LaTeX left readable
(its source in monospace), collapsible thinking, optional colouring of tokens that came from accepted drafts, and a
stats footer per reply. Each message has Copy and Delete, user messages Edit, and a turn with several versions
‹ i/n › links to switch between them. An empty conversation shows the welcome pane with example questions. Lines
stay readable on wide screens: the text column is at most READABLE_WIDTH pixels, centred.

Streaming text is buffered and the view re-rendered on a 75 ms tick, never per token.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound
from PySide6.QtCore import QTimer, QUrl, Signal, Slot
from PySide6.QtGui import QGuiApplication, QTextDocument
from PySide6.QtWidgets import QTextBrowser, QWidget

READABLE_WIDTH = 860
EXAMPLES = ("Hello!", "What is 12 plus 30?", "Count from 3 to 9.", "Convert 5 km to metres.",
            "What does json.dumps do?", "What day comes after Tuesday?")
WELCOME = """<h2>Welcome to Foretell</h2>
<p>Foretell runs language models on this computer: nothing you type leaves it.</p>
<p>The built-in demonstration model is tiny: it answers short questions of the kinds it was trained on —
sums, counting, dates, unit conversions, what a Python standard-library function does, greetings.
For real work download a Qwen3.5/3.6 GGUF model (<b>File › Get models…</b>) or open one you have (<b>File › Open
model…</b>, the <b>Model</b> tab's library, or drop a .gguf file on the window).</p>
<p>Try one of these:</p>
{examples}
<p style="color:{muted}">Replies show their speed; the <b>Metrics</b> tab shows whether speculative decoding with the
model's MTP head makes them faster (switch it in <b>Settings</b>).</p>"""
FENCE = re.compile(r"```([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
# LaTeX, left as its source in monospace (Qt's Markdown would eat its backslashes and read * and _ as emphasis):
# `code` spans pass through; $$…$$ and \[…\] are display math, $…$ and \(…\) inline. An inline $ opens only before
# a non-space and closes only after one, not before a digit: "$5 and $6" stays text.
MATH = re.compile(r"(`+)[^`]*?\1|\$\$(?P<d1>.+?)\$\$|\\\[(?P<d2>.+?)\\\]|\\\((?P<i1>.+?)\\\)"
                  r"|(?<![\\$\w])\$(?P<i2>\S(?:[^$\n]*?\S)?)\$(?![\d$])", re.S)
THINK = re.compile(r"<think>(.*?)(?:</think>|\Z)", re.S)


@dataclass
class ViewMessage:
    role: str
    text: str = ""
    spans: list[tuple[str, bool]] = field(default_factory=list)  # (text, from accepted draft)
    footer: str = ""
    show_thinking: bool = False
    version: tuple[int, int] = (1, 1)  # this message's version of its turn, of how many
    stopped: bool = False  # stopped by the user (kept, and marked)


def _code_html(code: str, lang: str, idx: int, dark: bool) -> str:
    try:
        lexer = get_lexer_by_name(lang) if lang else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    fmt = HtmlFormatter(noclasses=True, nowrap=True, style="monokai" if dark else "default")
    body = highlight(code, lexer, fmt)
    bg = "#272822" if dark else "#f6f8fa"
    return (f'<table width="100%" cellpadding="6" style="background:{bg}; margin:4px 0"><tr><td>'
            f'<div style="font-size:small"><a href="copy:{idx}">Copy</a> {html.escape(lang)}</div>'
            f'<pre style="margin:0">{body}</pre></td></tr></table>')


def render_markdown(text: str, dark: bool, codes: list[str]) -> str:
    """HTML for one message: Qt renders the Markdown, pygments the fenced code (each block appended to `codes`, its
    Copy link copies it), and LaTeX is shown as its source in monospace."""
    blocks: list[str] = []
    maths: list[str] = []

    def stash(m: re.Match[str]) -> str:
        codes.append(m.group(2))
        blocks.append(_code_html(m.group(2), m.group(1), len(codes) - 1, dark))
        return f"\n\nFORETELLCODE{len(blocks) - 1}\n\n"

    def stash_math(m: re.Match[str]) -> str:
        if m.group(1):  # a code span: Markdown's own
            return m.group(0)
        src = html.escape(m.group(0))
        if m.group("d1") is not None or m.group("d2") is not None:
            maths.append(f'<pre style="margin:4px 0 4px 24px">{src}</pre>')
            return f"\n\nFORETELLMATH{len(maths) - 1}Z\n\n"
        maths.append(f"<code>{src}</code>")
        return f"FORETELLMATH{len(maths) - 1}Z"

    doc = QTextDocument()
    doc.setMarkdown(MATH.sub(stash_math, FENCE.sub(stash, text)))
    out = doc.toHtml()
    body = re.search(r"<body[^>]*>(.*)</body>", out, re.S)
    out = body.group(1) if body else out
    for i, b in enumerate(blocks):
        out = re.sub(rf"<p[^>]*>FORETELLCODE{i}</p>", lambda _m, b=b: b, out)
    for i, m in enumerate(maths):  # a display block is its own paragraph; inline math sits in one
        out = re.sub(rf"<p[^>]*>FORETELLMATH{i}Z</p>|FORETELLMATH{i}Z", lambda _m, m=m: m, out)
    return out


class ChatView(QTextBrowser):
    copied = Signal(str)
    editRequested = Signal(int)  # index of a user message in `messages`
    versionRequested = Signal(int, int)  # index in `messages`, step (-1 previous version, +1 next)
    deleteRequested = Signal(int)  # index in `messages`
    exampleChosen = Signal(str)  # an example question on the welcome pane

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setAccessibleName("Conversation")
        self.setOpenLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        self.messages: list[ViewMessage] = []
        self.dark = False
        self.color_drafts = False
        self._codes: list[str] = []
        self._pending: list[tuple[str, bool]] = []
        self.context_start = 0  # the first message the model is sent: those above it no longer fit its context
        self.at_end = True  # the view follows the end of the conversation until the user scrolls up
        bar = self.verticalScrollBar()
        bar.rangeChanged.connect(self._follow)
        bar.valueChanged.connect(self._scrolled)
        self._setting = False
        self.timer = QTimer(self)
        self.timer.setInterval(75)
        self.timer.timeout.connect(self.flush)
        self.timer.start()

    # -- content -----------------------------------------------------------------------------------
    def set_messages(self, msgs: list[ViewMessage]) -> None:
        """A conversation loaded from the store."""
        self._pending.clear()
        self.messages = list(msgs)
        self.render()

    def add_message(self, role: str, text: str = "") -> None:
        self.flush()
        self.messages.append(ViewMessage(role, text, [(text, False)] if text else []))
        self.render()

    @Slot(str, bool)
    def append_token(self, text: str, accepted_draft: bool) -> None:
        """Buffered: shown on the next tick."""
        self._pending.append((text, accepted_draft))

    def set_footer(self, footer: str) -> None:
        self.flush()
        if self.messages:
            self.messages[-1].footer = footer
        self.render()

    @Slot()
    def flush(self) -> None:
        if not self._pending or not self.messages:
            return
        m = self.messages[-1]
        for text, acc in self._pending:
            m.text += text
            m.spans.append((text, acc))
        self._pending.clear()
        self.render()

    def last_reply(self) -> str:
        return next((m.text for m in reversed(self.messages) if m.role == "assistant"), "")

    def copy(self, text: str) -> None:
        """Put `text` on the clipboard and say so (`copied`: the window confirms it in its status bar)."""
        QGuiApplication.clipboard().setText(text)
        self.copied.emit(text)

    def copy_last_reply(self) -> None:
        self.copy(self.last_reply())

    # -- rendering ---------------------------------------------------------------------------------
    @property
    def muted(self) -> str:
        """Secondary text (footers, thinking) readable on either theme's background."""
        return "#a4a8ae" if self.dark else "#666666"

    def resizeEvent(self, e) -> None:  # noqa: N802 (Qt override)
        side = max(0, (self.width() - READABLE_WIDTH) // 2)
        self.setViewportMargins(side, 0, side, 0)
        super().resizeEvent(e)

    def render(self) -> None:
        self._codes = []
        parts = []
        if not self.messages:
            items = "".join(f'<li><a href="ask:{quote(q)}">{html.escape(q)}</a></li>' for q in EXAMPLES)
            parts.append(WELCOME.format(examples=f"<ul>{items}</ul>", muted=self.muted))
        for i, m in enumerate(self.messages):
            if i == self.context_start and i > 0:
                parts.append(f'<p style="color:{self.muted}; font-size:small" align="center">▲ The messages above '
                             "are no longer sent to the model: they do not fit its context. ▼</p><hr>")
            who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(m.role, m.role)
            links = []
            k, n = m.version
            if n > 1:
                prev = f'<a href="ver:{i}:-1">‹</a>' if k > 1 else "‹"
                nxt = f'<a href="ver:{i}:1">›</a>' if k < n else "›"
                links.append(f"{prev} {k}/{n} {nxt}")
            if m.role == "user":
                links.append(f'<a href="edit:{i}">Edit</a>')
            links.append(f'<a href="copymsg:{i}">Copy</a>')
            links.append(f'<a href="del:{i}">Delete</a>')
            tools = " &nbsp; ".join(links)
            parts.append(f'<p style="margin-top:10px"><b>{who}</b> &nbsp; <span style="font-size:small">{tools}</span></p>')
            parts.append(self._message_html(m, i))
            if m.footer:
                parts.append(f'<p style="color:{self.muted}; font-size:small">{html.escape(m.footer)}</p>')
        follow, self._setting = self.at_end, True  # setHtml moves the bar to the top on its way: not the user
        self.setHtml("".join(parts))
        self._setting, self.at_end = False, follow
        if follow:  # and it stays there while Qt lays a long document out in steps (_follow)
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    @Slot(int)
    def _scrolled(self, value: int) -> None:
        if not self._setting:
            self.at_end = value >= self.verticalScrollBar().maximum() - 4

    @Slot(int, int)
    def _follow(self, _lo: int, hi: int) -> None:
        """The document grew (a visible view lays a long one out in steps, after setHtml returned): stay at the end
        where the view was there."""
        if self.at_end:
            self.verticalScrollBar().setValue(hi)

    def _message_html(self, m: ViewMessage, idx: int) -> str:
        if m.role == "assistant" and m.stopped and not m.text.strip():
            return f'<p style="color:{self.muted}"><i>Stopped before any text.</i></p>'
        if m.role != "assistant":
            return f"<p>{html.escape(m.text).replace(chr(10), '<br>')}</p>"
        if self.color_drafts:  # token-level view: accepted-draft tokens highlighted, no Markdown
            bg = "#1f4d2b" if self.dark else "#d9f2dc"
            return "<p>" + "".join(
                f'<span style="background:{bg}">{html.escape(t)}</span>' if acc else html.escape(t)
                for t, acc in m.spans).replace("\n", "<br>") + "</p>"
        out, text = [], m.text
        think = THINK.search(text)
        if think:
            label = "▾ Thinking" if m.show_thinking else "▸ Thinking (click to show)"
            out.append(f'<p><a href="think:{idx}">{label}</a></p>')
            if m.show_thinking:
                out.append(f'<p style="color:{self.muted}">{html.escape(think.group(1).strip())}</p>')
            text = text[:think.start()] + text[think.end():]
        out.append(render_markdown(text.strip(), self.dark, self._codes))
        return "".join(out)

    @Slot(QUrl)
    def _on_anchor(self, url: QUrl) -> None:
        kind, _, arg = url.toString().partition(":")
        if kind == "copy" and arg.isdigit() and int(arg) < len(self._codes):
            self.copy(self._codes[int(arg)])
        elif kind == "copymsg" and arg.isdigit() and int(arg) < len(self.messages):
            self.copy(self.messages[int(arg)].text)
        elif kind == "edit" and arg.isdigit() and int(arg) < len(self.messages):
            self.editRequested.emit(int(arg))
        elif kind == "del" and arg.isdigit() and int(arg) < len(self.messages):
            self.deleteRequested.emit(int(arg))
        elif kind == "ver":
            i, _, step = arg.partition(":")
            if i.isdigit() and int(i) < len(self.messages) and step in ("-1", "1"):
                self.versionRequested.emit(int(i), int(step))
        elif kind == "ask":
            self.exampleChosen.emit(unquote(arg))
        elif kind == "think" and arg.isdigit() and int(arg) < len(self.messages):
            self.messages[int(arg)].show_thinking = not self.messages[int(arg)].show_thinking
            self.render()
