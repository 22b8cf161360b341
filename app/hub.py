"""Models from the Hugging Face Hub (no Qt here): the Hub's search for GGUF repos of the architectures the engine
runs (known MTP builds first), a repo's files, whether one fits this machine, a first model to suggest, and a
download through `huggingface_hub` that can pause and resume and is checked against the Hub's SHA-256.

A download writes `<name>.incomplete` in the models folder and renames it once its SHA-256 matches; a pause (or a
dropped connection) keeps that file, and the next download of the name continues it with a Range request
(`huggingface_hub.file_download.http_get` with `resume_size`: `hf_hub_download` of huggingface_hub 2.4 writes to a
file of its own and removes it on any failure, so it cannot resume across calls).

The window talks to a `Downloader`; `HubDownloader` is the Hub's (tests point it at a local server).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from engine.memory import available_bytes, plan_memory
from engine.placement import DEFAULT_MARGIN, free_device_bytes
from engine.storage.modelfile import SUPPORTED_ARCHS

GiB = 2**30
# Known MTP builds, largest first: (repo, what it is, about how many bytes its file has). The size picks a first
# model before the Hub is asked; the file list then gives the real one.
KNOWN_REPOS = (
    ("localweights/Qwen3.6-35B-A3B-MTP-IQ4_XS-GGUF", "Qwen3.6 35B-A3B, mixture of experts, with its MTP head · "
                                                     "IQ4_XS · about 18.5 GB", 18_500_000_000),
    ("localweights/Qwen3.5-4B-MTP-Q4_K_M-GGUF", "Qwen3.5 4B, dense, with its MTP head · Q4_K_M · about 2.7 GB",
     2_700_000_000),
    ("localweights/Qwen3.5-4B-MTP-IQ4_XS-GGUF", "Qwen3.5 4B, dense, with its MTP head · IQ4_XS · about 2.5 GB",
     2_500_000_000),
)
SEARCH_TERMS = ("Qwen3.5", "Qwen3.6")  # what an empty search asks the Hub for
SEARCH_LIMIT = 50  # repos asked for per search term, most downloaded first
# KV cache bytes a token of context takes at most in the family (Qwen3.5-27B: 16 attention layers × 4 KV heads ×
# (256 + 256) float32): the fit of a file not yet here is judged with it, its header being unknown.
KV_BYTES_PER_TOKEN = 16 * 4 * 512 * 4
Progress = Callable[[int, int], None]  # bytes done, of (0: not known)


class DownloadStopped(Exception):
    """The user paused or cancelled the download; what was fetched stays in the partial file."""


class CorruptDownload(Exception):
    """The finished file's SHA-256 is not the Hub's: the file was removed."""


@dataclass(frozen=True)
class RemoteRepo:
    repo: str
    about: str  # one line: what it is, or the Hub's architecture and downloads
    known: bool = False  # one of KNOWN_REPOS

    @property
    def mtp(self) -> bool:
        return "mtp" in self.repo.lower()


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int  # bytes; 0 where the Hub does not say

    @property
    def mtp(self) -> bool:
        """Whether the file's name says it keeps the MTP head (the header says for sure once it is here)."""
        return "mtp" in self.name.lower()

    @property
    def quant(self) -> str:
        return self.name.rsplit(".", 1)[0].rsplit("-", 1)[-1]


class Downloader(Protocol):
    def search(self, text: str) -> list[RemoteRepo]:
        """GGUF repos of the engine's architectures whose name has `text` (empty: SEARCH_TERMS), known first."""

    def files(self, repo: str) -> list[RemoteFile]:
        """The repo's GGUF files."""

    def download(self, repo: str, name: str, folder: Path, progress: Progress, stop: threading.Event) -> Path:
        """Fetch `name` into `folder` (continuing its partial file), reporting `progress`; DownloadStopped once
        `stop` is set (the partial file stays), CorruptDownload where the SHA-256 is not the Hub's."""


def known_repos(text: str = "") -> list[RemoteRepo]:
    return [RemoteRepo(r, about, True) for r, about, _ in KNOWN_REPOS if text.lower() in r.lower()]


def ranked(text: str, found: list[RemoteRepo]) -> list[RemoteRepo]:
    """Known MTP builds (those that match `text`) first, then other MTP builds, then the rest, each once."""
    known = known_repos(text)
    rest = list({r.repo: r for r in found if r.repo not in {k.repo for k in known}}.values())
    return known + [r for r in rest if r.mtp] + [r for r in rest if not r.mtp]


def partial_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.incomplete"


def partial_bytes(folder: Path, name: str) -> int:
    p = partial_path(folder, name)
    return p.stat().st_size if p.is_file() else 0


def fits(size: int, n_ctx: int, device: str = "cpu") -> str:
    """Whether a file of `size` bytes fits this machine at `n_ctx` tokens of context: its weights and at most
    KV_BYTES_PER_TOKEN a token, against the GPU's free memory (less the planner's margin) on CUDA, else the
    memory plan's verdict on the RAM available (engine.memory.plan_memory)."""
    if not size:
        return "size not given"
    state = n_ctx * KV_BYTES_PER_TOKEN
    if device.startswith("cuda"):
        free = free_device_bytes(device)
        if free is not None and size + state <= free - DEFAULT_MARGIN:
            return f"fits the GPU: needs about {(size + state) / GiB:.1f} of {free / GiB:.1f} GiB free"
    available = available_bytes()
    plan = plan_memory("", size, state, available, size, packs=False)
    need = f"about {(size + state) / GiB:.1f} GiB, {available / GiB:.1f} GiB free"
    if plan.notice is None:
        return f"fits this machine ({need})"
    if size + state <= available:
        return f"fits, just ({need}): the weights stay mapped from the file"
    return f"too large for this machine ({need}): it would run from disk, many times slower"


def fitting(size: int, n_ctx: int, device: str = "cpu") -> bool:
    return fits(size, n_ctx, device).startswith("fits")


def suggestion(n_ctx: int, device: str = "cpu") -> RemoteRepo:
    """The first model to suggest: the largest known MTP build that fits, else the smallest; its `about` says
    whether it fits."""
    repo, about, size = next((k for k in KNOWN_REPOS if fitting(k[2], n_ctx, device)), KNOWN_REPOS[-1])
    return RemoteRepo(repo, f"{about} · {fits(size, n_ctx, device)}", True)


class HubDownloader:
    """Through huggingface_hub: the Hub's model search, a repo's file list with sizes, and a resumable download
    checked against the SHA-256 the Hub records for the file. `endpoint`: another Hub than huggingface.co (a
    mirror; the tests' local server); None: HF_ENDPOINT's or the Hub."""

    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint)

    def search(self, text: str) -> list[RemoteRepo]:
        found: list[RemoteRepo] = []
        for term in [text.strip()] if text.strip() else SEARCH_TERMS:
            for m in self._api().list_models(search=term, filter="gguf", expand=["gguf", "downloads"],
                                             sort="downloads", limit=SEARCH_LIMIT):
                arch = (m.gguf or {}).get("architecture")
                if arch in SUPPORTED_ARCHS:
                    found.append(RemoteRepo(m.id, f"{arch} · {m.downloads or 0:,} downloads"))
        return ranked(text.strip(), found)

    def files(self, repo: str) -> list[RemoteFile]:
        info = self._api().model_info(repo, files_metadata=True)
        return [RemoteFile(s.rfilename, s.size or 0) for s in info.siblings or [] if s.rfilename.endswith(".gguf")]

    def download(self, repo: str, name: str, folder: Path, progress: Progress, stop: threading.Event) -> Path:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers
        from huggingface_hub.utils.sha import sha_fileobj

        meta = get_hf_file_metadata(hf_hub_url(repo, name, endpoint=self.endpoint), endpoint=self.endpoint)
        info = self._api().get_paths_info(repo, [name], revision=meta.commit_hash)
        sha = info[0].lfs.sha256 if info and getattr(info[0], "lfs", None) else None
        part = partial_path(folder, name)
        if meta.size is not None and partial_bytes(folder, name) > meta.size:
            part.unlink()  # not a part of this file: start again
        with open(part, "ab") as f:
            http_get(meta.location, f, resume_size=f.tell(), headers=build_hf_headers(),
                     expected_size=meta.size, tqdm_class=reporting_bar(progress, stop))
        if sha is not None:
            with open(part, "rb") as f:
                if sha_fileobj(f).hex() != sha:
                    part.unlink()
                    raise CorruptDownload(f"{name} arrived damaged: its SHA-256 is not the one Hugging Face "
                                          "records for it, so it was removed. Download it again.")
        return part.replace(folder / name)


def reporting_bar(progress: Progress, stop: threading.Event) -> type:
    """A tqdm class that reports to `progress` and stops the download when `stop` is set (huggingface_hub takes a
    progress-bar class; it has no callback or cancel of its own). It stops before the chunk it is told of is
    written, so the partial file holds whole chunks only."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True  # nothing printed: the dialog shows the progress
            super().__init__(*args, **kwargs)
            self.done, self.size = int(kwargs.get("initial") or 0), int(kwargs.get("total") or 0)

        def update(self, n: float | None = 1) -> bool | None:
            if stop.is_set():
                raise DownloadStopped("stopped")
            self.done += int(n or 0)
            progress(self.done, self.size)
            return super().update(n)

    return Bar
