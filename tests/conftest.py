"""Test-wide set-up. Qt runs offscreen: the variable must exist before any QApplication."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
