"""Help › Keyboard shortcuts: every key the window answers, read from its menus' actions and its shortcuts, so
the list cannot drift from what the keys do."""
from __future__ import annotations

import html
from typing import Iterable, Sequence

from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QMenu, QVBoxLayout, QWidget

# Keys the message box handles itself (no action or shortcut object stands for them).
TYPING = (("Enter", "Send the message"), ("Shift+Enter", "A new line in the message"),
          ("Tab / Shift+Tab", "Move to the next / previous control (out of the message box too)"))


def _keys(seq: QKeySequence) -> str:
    return seq.toString(QKeySequence.SequenceFormat.NativeText)


def shortcut_rows(menus: Iterable[QMenu], shortcuts: Sequence[QShortcut]) -> list[tuple[str, str]]:
    """(keys, what they do) for the typing keys, the window's shortcuts (their whatsThis says what they do) and
    every menu action that has keys, in menu order."""
    return list(TYPING) + [(_keys(s.key()), s.whatsThis()) for s in shortcuts] + \
        [row for menu in menus for row in _menu_rows(menu)]


def _menu_rows(menu: QMenu) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for a in menu.actions():
        if a.menu() is not None:
            rows += _menu_rows(a.menu())
        elif not a.shortcut().isEmpty():
            rows.append((_keys(a.shortcut()), a.text().replace("&", "").rstrip("…")))
    return rows


class ShortcutsDialog(QDialog):
    def __init__(self, rows: list[tuple[str, str]], parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Keyboard shortcuts")
        lay = QVBoxLayout(self)
        cells = "".join(f"<tr><td style='padding-right:18px'><b>{html.escape(k)}</b></td><td>{html.escape(t)}</td></tr>"
                        for k, t in rows)
        self.table = QLabel(f"<table>{cells}</table>")
        self.table.setAccessibleName("Keyboard shortcuts")
        lay.addWidget(self.table)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
