"""Draw the app icon (a chat bubble on a rounded square) with QPainter and save it as a PNG.

`python packaging/make_icon.py [OUT.png] [--size N]` (default: resources/icons/foretell.png, 256 px).
The committed PNG is the output of this script; re-run it only to change the design.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "resources" / "icons" / "foretell.png"


def draw_icon(size: int):  # -> QImage (PySide6 is imported lazily: offscreen platform must be set first)
    from PySide6.QtCore import QPointF, QRectF, Qt
    from PySide6.QtGui import QBrush, QColor, QImage, QLinearGradient, QPainter, QPainterPath

    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = float(size)

    # Background: a rounded square with a blue → violet diagonal gradient.
    grad = QLinearGradient(QPointF(0, 0), QPointF(s, s))
    grad.setColorAt(0.0, QColor("#2f6fde"))
    grad.setColorAt(1.0, QColor("#7a3fd1"))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(grad))
    p.drawRoundedRect(QRectF(0.04 * s, 0.04 * s, 0.92 * s, 0.92 * s), 0.2 * s, 0.2 * s)

    # A white speech bubble with a tail at the bottom left.
    bubble = QPainterPath()
    bubble.addRoundedRect(QRectF(0.18 * s, 0.22 * s, 0.64 * s, 0.44 * s), 0.12 * s, 0.12 * s)
    tail = QPainterPath()
    tail.moveTo(0.30 * s, 0.60 * s)
    tail.lineTo(0.26 * s, 0.80 * s)
    tail.lineTo(0.46 * s, 0.64 * s)
    tail.closeSubpath()
    p.setBrush(QColor("#ffffff"))
    p.drawPath(bubble.united(tail))

    # Three dots: "the model is typing", the middle one in the accent colour of accepted drafts.
    for i, colour in enumerate(("#2f6fde", "#19a974", "#7a3fd1")):
        cx = (0.36 + 0.14 * i) * s
        p.setBrush(QColor(colour))
        p.drawEllipse(QPointF(cx, 0.44 * s), 0.055 * s, 0.055 * s)
    p.end()
    return img


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    ap.add_argument("--size", type=int, default=256)
    args = ap.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    _app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not draw_icon(args.size).save(str(out), "PNG"):
        print(f"error: could not write {out}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
