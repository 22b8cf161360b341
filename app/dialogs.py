"""Error dialogs in plain words: a sentence that starts with a capital and ends with a full stop, the reason a user
can act on first, and the engine's technical message under "Show details" where it is not that sentence already.
Dialog buttons carry no icons (the generic Unix theme puts a stray icon on OK; desktops other than KDE show none).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from PySide6.QtWidgets import QApplication, QMessageBox, QProxyStyle, QStyle, QStyleOption, QWidget

# A message that starts with a file's name ("notes.txt is not a GGUF model file"), and one the GGUF reader made
# ("name.gguf: damaged GGUF: …" / "name.gguf: tensor 'x' ends at byte …").
STARTS_WITH_FILE = re.compile(r"^[\w.\- ]*?[\w\-]\.[A-Za-z]\w*(?=[ :])")
READER = re.compile(r"^(?P<name>[^:\n]+?): (?P<what>damaged GGUF: |tensor '[^']*' ends at byte )")
TRUNCATED = re.compile(r"truncated|file ends inside|past the end of the file")


@dataclass(frozen=True)
class Explained:
    text: str  # the plain sentence the dialog shows
    details: str = ""  # the technical message behind it, "" when the text is that message


def sentence(msg: str) -> str:
    """`msg` as a sentence: a capital first letter (a file name first is introduced: "The file notes.txt …") and a
    full stop where it ends without one."""
    text = msg.strip()
    if not text:
        return text
    if STARTS_WITH_FILE.match(text) and not text[0].isupper():
        text = f"The file {text}"
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?…" else text + "."


def explain(msg: str) -> Explained:
    """What a user is told about `msg`: a damaged or incomplete model file in plain words (the reader's message as
    the details), anything else as a sentence."""
    m = READER.match(msg)
    if m is not None:
        name = m.group("name")
        if TRUNCATED.search(msg):
            return Explained(f"The file {name} is incomplete: it ends before the model does, probably because its "
                             "download was interrupted. Download it again.", msg)
        return Explained(f"The file {name} is damaged: it is not laid out as a GGUF model file, so it cannot be "
                         "opened. Download it again, or choose another file.", msg)
    return Explained(sentence(msg))


def error_box(parent: QWidget | None, title: str, msg: str) -> QMessageBox:
    """A warning box for `msg` in plain words, the technical message under "Show details"."""
    said = explain(msg)
    box = QMessageBox(QMessageBox.Icon.Warning, title, said.text, QMessageBox.StandardButton.Ok, parent)
    if said.details:
        box.setDetailedText(said.details)
    return box


class PlainButtons(QProxyStyle):
    """The app's style with icon-less dialog buttons."""

    def styleHint(self, hint: QStyle.StyleHint, option: QStyleOption | None = None,  # noqa: N802 (Qt override)
                  widget: QWidget | None = None, returnData: object = None) -> int:  # noqa: N803
        if hint == QStyle.StyleHint.SH_DialogButtonBox_ButtonsHaveIcons:
            return 0
        return super().styleHint(hint, option, widget, returnData)


def use_plain_buttons() -> None:
    """Install PlainButtons over the application's style, once."""
    app = QApplication.instance()
    if isinstance(app, QApplication) and not isinstance(app.style(), PlainButtons):
        app.setStyle(PlainButtons(app.style().name()))
