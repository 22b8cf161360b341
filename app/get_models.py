"""File › Get models…: search Hugging Face for GGUF repos of the architectures the engine runs (known MTP builds
first, a first model suggested by what fits), see a repo's files (quant, size, MTP head, whether it fits this
machine), download one into the models folder with progress, Pause / Resume and Cancel, checked against the Hub's
SHA-256, then open it.

The Hub is only reached off the GUI thread (plain threads, results back through queued signals), through the
`Downloader` given (app.hub.HubDownloader; tests point it at a local server).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, Signal, Slot
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QProgressBar, QPushButton, QVBoxLayout, QWidget)

from app.hub import (CorruptDownload, DownloadStopped, Downloader, RemoteFile, RemoteRepo, fits, known_repos,
                     partial_bytes, partial_path, suggestion)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.{0 if n >= 10 * 2**20 else 1}f} MiB"


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class _Work(QObject):
    """Hub calls on a plain thread; what they give comes back as queued signals."""

    found = Signal(str, object, str)  # search text, repos, error ("" when none)
    listed = Signal(str, object, str)  # repo, files, error ("" when none)
    progress = Signal(object, object)  # bytes done, of (ints past 2**31: object, not int)
    finished = Signal(str, str, str)  # the downloaded file's path ("" when none), error, and its kind:
    # "" (none), "stopped" (paused or cancelled), "corrupt", "failed"

    def __init__(self, downloader: Downloader):
        super().__init__()
        self.downloader = downloader
        self.stop = threading.Event()

    @staticmethod
    def _run(name: str, fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, name=f"foretell-hub-{name}", daemon=True).start()

    def search(self, text: str) -> None:
        def run() -> None:
            try:
                self.found.emit(text, self.downloader.search(text), "")
            except Exception as e:  # noqa: BLE001 — the Hub's errors are many: the dialog says which, in a line
                self.found.emit(text, [], _line(e))
        self._run("search", run)

    def list(self, repo: str) -> None:
        def run() -> None:
            try:
                self.listed.emit(repo, self.downloader.files(repo), "")
            except Exception as e:  # noqa: BLE001
                self.listed.emit(repo, [], _line(e))
        self._run("list", run)

    def download(self, repo: str, name: str, folder: Path) -> None:
        self.stop.clear()

        def run() -> None:
            try:
                path = self.downloader.download(repo, name, folder, self.progress.emit, self.stop)
            except DownloadStopped:
                self.finished.emit("", "stopped", "stopped")
            except CorruptDownload as e:
                self.finished.emit("", str(e), "corrupt")
            except Exception as e:  # noqa: BLE001 — a network or disk failure: said in a line, the dialog goes on
                self.finished.emit("", _line(e), "failed")
            else:
                self.finished.emit(str(path), "", "")
        self._run("download", run)


class GetModelsDialog(QDialog):
    opened = Signal(str)  # a downloaded model to load

    def __init__(self, downloader: Downloader, folder: Path, parent: QWidget | None = None, n_ctx: int = 4096,
                 device: str = "cpu"):
        """`n_ctx`, `device`: what a model is judged to fit with (the settings' context and device)."""
        super().__init__(parent)
        self.setWindowTitle("Get models")
        self.resize(820, 560)
        self.folder, self.n_ctx, self.device = folder, n_ctx, device
        self.found: list[RemoteRepo] = known_repos()
        self.files: list[RemoteFile] = []
        self.downloading: tuple[str, str] | None = None  # (repo, file) under way
        self.cancelling = False  # the stop asked for is a Cancel (the partial file goes), not a Pause
        self.downloaded: str | None = None
        self.work = _Work(downloader)
        self.work.found.connect(self._found)
        self.work.listed.connect(self._listed)
        self.work.progress.connect(self._progress)
        self.work.finished.connect(self._finished)
        lay = QVBoxLayout(self)
        intro = QLabel("Qwen3.5 / Qwen3.6 GGUF models on Hugging Face. Builds with an MTP head decode faster with "
                       f"speculative decoding. Downloads go to <b>{folder}</b>.")
        intro.setWordWrap(True)
        lay.addWidget(intro)
        self.suggested = suggestion(n_ctx, device)
        row = QHBoxLayout()
        self.suggestion_label = QLabel(f"Suggested first model: <b>{self.suggested.repo}</b> — "
                                       f"{self.suggested.about}")
        self.suggestion_label.setWordWrap(True)
        self.suggest_btn = QPushButton("Show it")
        self.suggest_btn.setAccessibleName("Show the suggested model")
        row.addWidget(self.suggestion_label, 1)
        row.addWidget(self.suggest_btn)
        lay.addLayout(row)
        row = QHBoxLayout()
        self.search_box = QLineEdit()
        self.search_box.setPlaceholderText("Search Hugging Face (empty: every Qwen3.5 and Qwen3.6 GGUF)")
        self.search_box.setAccessibleName("Search models")
        self.search_btn = QPushButton("Search")
        row.addWidget(self.search_box, 1)
        row.addWidget(self.search_btn)
        lay.addLayout(row)
        self.repos = QListWidget()
        self.repos.setAccessibleName("Model repositories")
        self.file_list = QListWidget()
        self.file_list.setAccessibleName("Files")
        for lst in (self.repos, self.file_list):  # two wrapped lines an entry: no sideways scrolling
            lst.setWordWrap(True)
            lst.setAlternatingRowColors(True)
        row = QHBoxLayout()
        row.addWidget(self.repos, 1)
        row.addWidget(self.file_list, 1)
        lay.addLayout(row, 1)
        self.status = QLabel("Choose a repository to see its files, or search.")
        self.status.setWordWrap(True)
        self.progress_bar = QProgressBar()
        self.progress_bar.setVisible(False)
        lay.addWidget(self.status)
        lay.addWidget(self.progress_bar)
        buttons = QHBoxLayout()
        self.download_btn, self.pause_btn, self.cancel_btn, self.open_btn = (
            QPushButton(t) for t in ("Download", "Pause", "Cancel download", "Open the model"))
        for b in (self.download_btn, self.pause_btn, self.cancel_btn, self.open_btn):
            b.setEnabled(False)
            buttons.addWidget(b)
        buttons.addStretch(1)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)
        buttons.addWidget(close)
        lay.addLayout(buttons)
        self._show_repos()
        self.repos.currentRowChanged.connect(self._choose_repo)
        self.file_list.currentRowChanged.connect(lambda _r: self._update_buttons())
        self.search_btn.clicked.connect(self.search)
        self.search_box.returnPressed.connect(self.search)
        self.suggest_btn.clicked.connect(self.show_suggestion)
        self.download_btn.clicked.connect(self.download)
        self.pause_btn.clicked.connect(self.work.stop.set)
        self.cancel_btn.clicked.connect(self.cancel)
        self.open_btn.clicked.connect(self._open)

    @property
    def busy(self) -> bool:
        return self.downloading is not None

    @property
    def repo(self) -> str:
        return self.found[self.repos.currentRow()].repo

    def _file(self) -> RemoteFile | None:
        row = self.file_list.currentRow()
        return self.files[row] if 0 <= row < len(self.files) else None

    def _show_repos(self) -> None:
        self.repos.blockSignals(True)
        self.repos.clear()
        for r in self.found:
            item = QListWidgetItem(f"{r.repo}\n{r.about}")
            item.setToolTip(f"https://huggingface.co/{r.repo}")
            self.repos.addItem(item)
        self.repos.blockSignals(False)

    def search(self) -> None:
        text = self.search_box.text().strip()
        self.status.setText(f"Searching Hugging Face for {text or 'Qwen3.5 and Qwen3.6'} GGUF models…")
        self.work.search(text)

    @Slot(str, object, str)
    def _found(self, text: str, repos: list[RemoteRepo], error: str) -> None:
        if text != self.search_box.text().strip():  # the user searched for something else meanwhile
            return
        if error:
            self.status.setText(f"Could not search Hugging Face: {error}")
            return
        self.found = repos
        self._show_repos()
        self.file_list.clear()
        self.files = []
        self._update_buttons()
        n = len(repos)
        self.status.setText(f"{n} repositor{'ies' if n != 1 else 'y'} of the models this app runs (known MTP "
                            "builds first)." if repos else "No GGUF repository of the models this app runs matches.")

    def show_suggestion(self) -> None:
        rows = [i for i, r in enumerate(self.found) if r.repo == self.suggested.repo]
        if not rows:
            self.found = [self.suggested] + self.found
            self._show_repos()
            rows = [0]
        self.repos.setCurrentRow(rows[0])

    @Slot(int)
    def _choose_repo(self, row: int) -> None:
        self.file_list.clear()
        self.files = []
        self._update_buttons()
        if row < 0:
            return
        self.status.setText(f"Asking Hugging Face for the files of {self.repo}…")
        self.work.list(self.repo)

    @Slot(str, object, str)
    def _listed(self, repo: str, files: list[RemoteFile], error: str) -> None:
        if self.repos.currentRow() < 0 or repo != self.repo:  # the user chose another repository meanwhile
            return
        if error:
            self.status.setText(f"Could not list {repo}: {error}")
            return
        self.files = files
        for _ in files:
            self.file_list.addItem(QListWidgetItem())
        self._show_files()
        self.status.setText(f"{len(files)} GGUF file{'s' if len(files) != 1 else ''} in {repo}." if files else
                            f"{repo} has no GGUF file.")

    def _show_files(self) -> None:
        """Each file's two lines: quant, size, MTP head, fit, and what of it is here from a paused download."""
        for i, f in enumerate(self.files):
            part = partial_bytes(self.folder, f.name)
            paused = f" · {_size(part)} here, paused" if part else ""
            self.file_list.item(i).setText(f"{f.name}\n{f.quant} · {_size(f.size)} · MTP head "
                                           f"{'yes' if f.mtp else 'no'} · {fits(f.size, self.n_ctx, self.device)}"
                                           f"{paused}")

    def _update_buttons(self) -> None:
        self._show_files()
        f = self._file()
        part = partial_bytes(self.folder, f.name) if f is not None else 0
        self.download_btn.setText("Resume" if part and not self.busy else "Download")
        self.download_btn.setEnabled(f is not None and not self.busy)
        self.pause_btn.setEnabled(self.busy)
        self.cancel_btn.setEnabled(self.busy or bool(part))

    def download(self) -> None:
        f = self._file()
        if f is None or self.busy:
            return
        self.downloading, self.cancelling = (self.repo, f.name), False
        self.folder.mkdir(parents=True, exist_ok=True)
        part = partial_bytes(self.folder, f.name)
        self.status.setText(f"Resuming {f.name} from {_size(part)}…" if part else f"Downloading {f.name}…")
        self.progress_bar.setRange(0, 1000)
        self.progress_bar.setValue(int(1000 * part / f.size) if f.size else 0)
        self.progress_bar.setFormat(f"{_size(part)} of {_size(f.size)}")
        self.progress_bar.setVisible(True)
        self._update_buttons()
        self.work.download(self.repo, f.name, self.folder)

    def cancel(self) -> None:
        """Stop the download under way, or drop a paused one: its partial file is removed."""
        if self.busy:
            self.cancelling = True
            self.work.stop.set()
            return
        f = self._file()
        if f is not None:
            partial_path(self.folder, f.name).unlink(missing_ok=True)
            self.status.setText(f"Cancelled: the paused download of {f.name} was removed.")
            self._update_buttons()

    @Slot(object, object)
    def _progress(self, done: int, total: int) -> None:
        if total:  # the text first: setValue repaints at once
            self.progress_bar.setFormat(f"{_size(done)} of {_size(total)}" if done < total else
                                        "Checking the file's SHA-256…")
            self.progress_bar.setValue(int(1000 * done / total))

    @Slot(str, str, str)
    def _finished(self, path: str, error: str, kind: str) -> None:
        assert self.downloading is not None
        name = self.downloading[1]
        self.downloading = None
        self.progress_bar.setVisible(False)
        part = partial_bytes(self.folder, name)
        size = next((f.size for f in self.files if f.name == name), 0)
        if kind == "stopped" and self.cancelling:
            partial_path(self.folder, name).unlink(missing_ok=True)
            self.status.setText("Download cancelled.")
        elif kind == "stopped":
            self.status.setText(f"Paused at {_size(part)} of {_size(size)}. Resume continues from there.")
        elif kind == "corrupt":
            self.status.setText(error)
        elif kind and part:
            self.status.setText(f"The download stopped at {_size(part)} of {_size(size)} ({error}). Resume "
                                "continues from there.")
        elif kind:
            self.status.setText(f"The download failed: {error}")
        else:
            self.downloaded = path
            self.open_btn.setEnabled(True)
            self.status.setText(f"Downloaded to {path}; its SHA-256 matches the Hub's. It is in the model library "
                                "(Model tab).")
        self._update_buttons()

    def _open(self) -> None:
        if self.downloaded:
            self.opened.emit(self.downloaded)
            self.accept()
