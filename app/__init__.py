"""Foretell desktop app (PySide6 + pyqtgraph): the GUI only, no model math."""
