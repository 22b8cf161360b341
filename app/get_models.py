"""File › Get models…: pick a known Qwen3.5/3.6 GGUF repo, see its files (size, MTP head, whether it fits the
memory free now), download one into the models folder with progress and Cancel, then open it.

The Hub is only reached off the GUI thread (plain threads, results back through queued signals), through the
`Downloader` given (app.hub.HubDownloader; tests pass their own).
"""
from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QListWidget, QListWidgetItem,
                               QProgressBar, QPushButton, QVBoxLayout, QWidget)

from app.hub import KNOWN_REPOS, DownloadCancelled, Downloader, RemoteFile, fits


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.{0 if n >= 10 * 2**20 else 1}f} MiB"


class _Work(QObject):
    """Hub calls on a plain thread; what they give comes back as queued signals."""

    listed = Signal(str, object, str)  # repo, files, error ("" when none)
    progress = Signal(object, object)  # bytes done, of (ints past 2**31: object, not int)
    finished = Signal(str, str)  # the downloaded file's path ("" when none), error or "cancelled"

    def __init__(self, downloader: Downloader):
        super().__init__()
        self.downloader = downloader
        self.cancel = threading.Event()

    def list(self, repo: str) -> None:
        def run() -> None:
            try:
                self.listed.emit(repo, self.downloader.files(repo), "")
            except Exception as e:  # noqa: BLE001 — the Hub's errors are many: the dialog says which, in a line
                self.listed.emit(repo, [], f"{type(e).__name__}: {e}")
        threading.Thread(target=run, name="foretell-hub-list", daemon=True).start()

    def download(self, repo: str, name: str, folder: Path) -> None:
        self.cancel.clear()

        def run() -> None:
            try:
                path = self.downloader.download(repo, name, folder, self.progress.emit, self.cancel)
            except DownloadCancelled:
                self.finished.emit("", "cancelled")
            except Exception as e:  # noqa: BLE001 — a network or disk failure: said in a line, the dialog goes on
                self.finished.emit("", f"{type(e).__name__}: {e}")
            else:
                self.finished.emit(str(path), "")
        threading.Thread(target=run, name="foretell-hub-download", daemon=True).start()


class GetModelsDialog(QDialog):
    opened = Signal(str)  # a downloaded model to load

    def __init__(self, downloader: Downloader, folder: Path, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Get models")
        self.resize(760, 520)
        self.folder = folder
        self.files: list[RemoteFile] = []
        self.downloaded: str | None = None
        self.work = _Work(downloader)
        self.work.listed.connect(self._listed)
        self.work.progress.connect(self._progress)
        self.work.finished.connect(self._finished)
        lay = QVBoxLayout(self)
        intro = QLabel("Qwen3.5 / Qwen3.6 GGUF models on Hugging Face. Builds with an MTP head decode faster with "
                       f"speculative decoding. Downloads go to <b>{folder}</b>.")
        intro.setWordWrap(True)
        lay.addWidget(intro)
        self.repos = QListWidget()
        self.repos.setAccessibleName("Model repositories")
        for repo, about in KNOWN_REPOS:
            item = QListWidgetItem(f"{repo}\n{about}")
            item.setToolTip(f"https://huggingface.co/{repo}")
            self.repos.addItem(item)
        self.file_list = QListWidget()
        self.file_list.setAccessibleName("Files")
        for lst in (self.repos, self.file_list):  # two wrapped lines an entry: no sideways scrolling
            lst.setWordWrap(True)
            lst.setAlternatingRowColors(True)
        row = QHBoxLayout()
        row.addWidget(self.repos, 1)
        row.addWidget(self.file_list, 1)
        lay.addLayout(row, 1)
        self.status = QLabel("Choose a repository to see its files.")
        self.status.setWordWrap(True)
        self.progress_bar = QProgressBar()
        self.progress_bar.setVisible(False)
        lay.addWidget(self.status)
        lay.addWidget(self.progress_bar)
        buttons = QHBoxLayout()
        self.download_btn, self.cancel_btn, self.open_btn = (QPushButton(t) for t in ("Download", "Cancel download",
                                                                                       "Open the model"))
        for b in (self.download_btn, self.cancel_btn, self.open_btn):
            b.setEnabled(False)
            buttons.addWidget(b)
        buttons.addStretch(1)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)
        buttons.addWidget(close)
        lay.addLayout(buttons)
        self.repos.currentRowChanged.connect(self._choose_repo)
        self.file_list.currentRowChanged.connect(lambda r: self.download_btn.setEnabled(r >= 0 and not self.busy))
        self.download_btn.clicked.connect(self.download)
        self.cancel_btn.clicked.connect(self.work.cancel.set)
        self.open_btn.clicked.connect(self._open)
        self.busy = False

    @property
    def repo(self) -> str:
        return KNOWN_REPOS[self.repos.currentRow()][0]

    @Slot(int)
    def _choose_repo(self, row: int) -> None:
        self.file_list.clear()
        self.files = []
        if row < 0:
            return
        self.status.setText(f"Asking Hugging Face for the files of {self.repo}…")
        self.work.list(self.repo)

    @Slot(str, object, str)
    def _listed(self, repo: str, files: list[RemoteFile], error: str) -> None:
        if repo != self.repo:  # the user chose another repository meanwhile
            return
        if error:
            self.status.setText(f"Could not list {repo}: {error}")
            return
        self.files = files
        for f in files:
            quant = f.name.rsplit(".", 1)[0].rsplit("-", 1)[-1]
            item = QListWidgetItem(f"{f.name}\n{quant} · {_size(f.size)} · MTP head {'yes' if f.mtp else 'no'} · "
                                   f"{fits(f.size)}")
            self.file_list.addItem(item)
        self.status.setText(f"{len(files)} GGUF file{'s' if len(files) != 1 else ''} in {repo}." if files else
                            f"{repo} has no GGUF file.")

    def download(self) -> None:
        row = self.file_list.currentRow()
        if row < 0 or self.busy:
            return
        self.busy = True
        f = self.files[row]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.status.setText(f"Downloading {f.name}…")
        self.progress_bar.setRange(0, 1000)
        self.progress_bar.setValue(0)
        self.progress_bar.setVisible(True)
        self.download_btn.setEnabled(False)
        self.cancel_btn.setEnabled(True)
        self.work.download(self.repo, f.name, self.folder)

    @Slot(object, object)
    def _progress(self, done: int, total: int) -> None:
        if total:
            self.progress_bar.setValue(int(1000 * done / total))
            self.progress_bar.setFormat(f"{_size(done)} of {_size(total)}")

    @Slot(str, str)
    def _finished(self, path: str, error: str) -> None:
        self.busy = False
        self.cancel_btn.setEnabled(False)
        self.download_btn.setEnabled(self.file_list.currentRow() >= 0)
        self.progress_bar.setVisible(False)
        if error == "cancelled":
            self.status.setText("Download cancelled.")
        elif error:
            self.status.setText(f"The download failed: {error}")
        else:
            self.downloaded = path
            self.open_btn.setEnabled(True)
            self.status.setText(f"Downloaded to {path}. It is in the model library (Model tab).")

    def _open(self) -> None:
        if self.downloaded:
            self.opened.emit(self.downloaded)
            self.accept()
