"""The command lines' writes to standard output: a result that cannot be written (standard output closed, a full
disk) is an OutputError, so a command never exits 0 having written nothing. Light: the CLI imports it before any
kernel is loaded."""
from __future__ import annotations

import os
import sys
from typing import TextIO

from engine.errors import EngineError


class OutputError(EngineError):
    """Standard output is closed or a write to it failed (a full disk): the command's result is lost."""


def stdout() -> TextIO:
    """sys.stdout, which Python sets to None when the process starts with its descriptor closed (`>&-`)."""
    if sys.stdout is None:
        raise OutputError("the standard output is closed: nothing could be written")
    return sys.stdout


def emit(text: str, end: str = "\n", flush: bool = False) -> None:
    """Write to standard output; a failed write is an OutputError naming the reason."""
    out = stdout()
    try:
        out.write(text + end)
        if flush:
            out.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write the output: {e.strerror or e}") from None


def drop_stdout() -> None:
    """After a failed write: point standard output at the null device, so the interpreter's flush at exit finds
    nothing to fail on (it would print a traceback and exit 120)."""
    if sys.stdout is not None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
