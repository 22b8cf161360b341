"""Models from the Hugging Face Hub (no Qt here): a few known GGUF repos of the architectures the engine runs,
their files, and a download with progress and cancel through `huggingface_hub` (which removes the partial file of
a cancelled download: the next one starts again).

The window talks to a `Downloader`; `HubDownloader` is the Hub's, tests pass their own (no network).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import psutil

# (repo, what it is). Builds that keep the MTP head first: they are the ones speculative decoding speeds up.
KNOWN_REPOS = (
    ("localweights/Qwen3.5-4B-MTP-Q4_K_M-GGUF", "Qwen3.5 4B, dense, with its MTP head · Q4_K_M · about 2.7 GB"),
    ("localweights/Qwen3.5-4B-MTP-IQ4_XS-GGUF", "Qwen3.5 4B, dense, with its MTP head · IQ4_XS · smaller"),
    ("localweights/Qwen3.6-35B-A3B-MTP-IQ4_XS-GGUF", "Qwen3.6 35B-A3B, mixture of experts, with its MTP head · "
                                                     "IQ4_XS · about 18.5 GB"),
    ("unsloth/Qwen3.5-4B-GGUF", "Qwen3.5 4B, dense, several quantizations (no MTP head)"),
)
Progress = Callable[[int, int], None]  # bytes done, of (0: not known)


class DownloadCancelled(Exception):
    """The user cancelled the download."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int  # bytes; 0 where the Hub does not say

    @property
    def mtp(self) -> bool:
        """Whether the file's name says it keeps the MTP head (the header says for sure once it is here)."""
        return "mtp" in self.name.lower()


class Downloader(Protocol):
    def files(self, repo: str) -> list[RemoteFile]:
        """The repo's GGUF files."""

    def download(self, repo: str, name: str, folder: Path, progress: Progress, cancel: threading.Event) -> Path:
        """Fetch `name` into `folder`, reporting `progress`; DownloadCancelled once `cancel` is set."""


def fits(size: int) -> str:
    """Whether a file of `size` bytes fits the memory free now (the weights alone: the context adds to it)."""
    free = psutil.virtual_memory().available
    verdict = "fits in RAM" if size < free else "larger than the free RAM"
    return f"{verdict} ({free / 2**30:.1f} GiB free)" if size else "size not given"


class HubDownloader:
    """Through huggingface_hub: the repo's file list with sizes, and `hf_hub_download` into the folder.
    `endpoint`: another Hub than huggingface.co (a mirror; the tests' local server); None: HF_ENDPOINT's or the Hub."""

    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint

    def files(self, repo: str) -> list[RemoteFile]:
        from huggingface_hub import HfApi

        info = HfApi(endpoint=self.endpoint).model_info(repo, files_metadata=True)
        return [RemoteFile(s.rfilename, s.size or 0) for s in info.siblings or [] if s.rfilename.endswith(".gguf")]

    def download(self, repo: str, name: str, folder: Path, progress: Progress, cancel: threading.Event) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo, name, local_dir=folder, endpoint=self.endpoint,
                                    tqdm_class=reporting_bar(progress, cancel)))


def reporting_bar(progress: Progress, cancel: threading.Event) -> type:
    """A tqdm class that reports to `progress` and stops the download when `cancel` is set (huggingface_hub
    takes a progress-bar class; it has no callback or cancel of its own)."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True  # nothing printed: the dialog shows the progress
            super().__init__(*args, **kwargs)
            self.done, self.size = int(kwargs.get("initial") or 0), int(kwargs.get("total") or 0)

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            progress(self.done, self.size)
            if cancel.is_set():
                raise DownloadCancelled("cancelled")
            return super().update(n)

    return Bar
