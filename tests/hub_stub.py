"""A stand-in for the Hugging Face Hub (no network) for the Get models dialog: the tests' and the screenshots'."""
from __future__ import annotations

import threading
from pathlib import Path

from app.hub import DownloadCancelled, Progress, RemoteFile
from tests.fixtures import TINY_MOE, fixture_path

CHUNK = 64 * 1024


class FakeHub:
    """Serves the tiny fixture as every repository's MTP file, in chunks (as the Hub, a cancelled download leaves
    nothing behind)."""

    def __init__(self) -> None:
        self.data = fixture_path(TINY_MOE).read_bytes()
        self.listed: list[str] = []
        self.slow = threading.Event()  # set: every chunk waits a little, so the test can cancel mid-way

    def files(self, repo: str) -> list[RemoteFile]:
        self.listed.append(repo)
        return [RemoteFile("Tiny-MTP-Q8_0.gguf", len(self.data)), RemoteFile("Tiny-Q4_K_M.gguf", 5 * 2**40)]

    def download(self, repo: str, name: str, folder: Path, progress: Progress, cancel: threading.Event) -> Path:
        part = folder / f"{name}.part"
        done = 0
        with open(part, "wb") as f:
            while done < len(self.data):
                if cancel.is_set():
                    f.close()
                    part.unlink()
                    raise DownloadCancelled("cancelled")
                f.write(self.data[done:done + CHUNK])
                done = min(done + CHUNK, len(self.data))
                progress(done, len(self.data))
                if self.slow.is_set():
                    cancel.wait(0.05)
        return part.replace(folder / name)
