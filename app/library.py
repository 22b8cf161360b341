"""Model files: the check made before a load replaces the current model, and the model library (a folder and
the recent files, each described from its GGUF header with a fits-in-memory estimate from the placement
planner).

Everything here reads metadata and the tensor table only (the file is memory-mapped, no weights are read),
so checking a file or listing a folder is fast enough for the GUI thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QLabel, QListWidget, QListWidgetItem, QPushButton,
                               QVBoxLayout, QWidget)

from engine.errors import EngineError, ModelFormatError
from engine.placement import ModelSizes, PlacementConfig, free_device_bytes, plan_placement
from engine.storage.modelfile import ModelFile, default_model_path, open_model

GiB = 2**30


def models_folder() -> Path:
    """Where downloaded models go until the user chooses a library folder."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("Foretell", appauthor=False)) / "models"


def check_model_file(path: str | Path | None) -> ModelFile:
    """Open and validate a model file (None: the embedded model); the error says in plain words what is wrong."""
    p = Path(path) if path is not None else default_model_path()
    if not p.exists():
        raise ModelFormatError(f"{p.name} was not found (looked for {p})")
    if p.is_dir():
        raise ModelFormatError(f"{p.name} is a folder, not a GGUF model file")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFormatError(f"{p.name} cannot be read: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ModelFormatError(f"{p.name} is not a GGUF model file")
    return open_model(p)


@dataclass(frozen=True)
class LibraryEntry:
    path: str
    name: str = ""
    architecture: str = ""
    params: int = 0
    quant_mix: str = ""
    file_bytes: int = 0
    mtp: bool = False
    context: int = 0
    fits: str = ""
    error: str = ""  # set when the file cannot be opened: the row says why


def fits_estimate(mf: ModelFile, n_ctx: int, device: str = "cpu") -> str:
    """What the placement planner says about this model at `n_ctx`: all on the GPU, split, or whether weights
    plus KV cache fit in the RAM free now."""
    sizes = ModelSizes.from_model(mf, n_ctx)
    need = (sum(sizes.trunk) + sum(sizes.experts) + sum(sizes.kv) + sum(sizes.state) + sizes.output
            + sizes.embedding + sizes.mtp)
    if device.startswith("cuda"):
        try:
            plan = plan_placement(sizes, PlacementConfig(device), free_device_bytes(device))
        except EngineError as e:
            return f"GPU unavailable: {e}"
        return plan.summary().split(" — ")[0]
    free = psutil.virtual_memory().available
    verdict = "fits in RAM" if need <= free else "does not fit in RAM"
    return f"{verdict}: needs {need / GiB:.2f} GiB, {free / GiB:.1f} GiB free"


def describe(path: str | Path, n_ctx: int, device: str = "cpu") -> LibraryEntry:
    try:
        mf = check_model_file(path)
    except EngineError as e:
        return LibraryEntry(str(path), Path(path).name, error=str(e))
    hp = mf.hparams
    mix = mf.type_histogram()
    total = sum(v["bytes"] for v in mix.values()) or 1
    return LibraryEntry(
        path=str(mf.path), name=mf.get("general.name") or mf.path.stem, architecture=hp.arch,
        params=mf.param_counts.total,
        quant_mix=", ".join(f"{k} {v['bytes'] / total:.0%}" for k, v in mix.items() if v["bytes"] / total >= 0.01),
        file_bytes=mf.file_size, mtp=hp.has_mtp, context=hp.n_ctx_train, fits=fits_estimate(mf, n_ctx, device))


def scan(folder: str | Path | None, recent: list[str], n_ctx: int, device: str = "cpu") -> list[LibraryEntry]:
    """The folder's *.gguf files (sorted), then recent files not among them; each described once."""
    paths: list[Path] = sorted(Path(folder).glob("*.gguf")) if folder and Path(folder).is_dir() else []
    seen = {p.resolve() for p in paths}
    paths += [Path(r) for r in recent if Path(r).resolve() not in seen and Path(r).exists()]
    return [describe(p, n_ctx, device) for p in paths]


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def describe_line(e: LibraryEntry) -> str:
    """The library's second line for a model: what it is and whether it fits, or why it cannot be opened."""
    if e.error:
        return e.error
    return (f"{e.architecture} · {_count(e.params)} parameters · {e.quant_mix} · {_size(e.file_bytes)} · "
            f"MTP {'yes' if e.mtp else 'no'} · context {e.context:,} · {e.fits}")


class LibraryPanel(QWidget):
    """The model library: a folder chosen by the user plus the recent files; Open (or a double click) asks the
    window to load the selected model."""

    openRequested = Signal(str)
    folderChanged = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.folder = ""
        self.entries: list[LibraryEntry] = []
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        self.folder_label = QLabel("No folder chosen: recent files only")
        self.folder_label.setWordWrap(True)
        self.choose_btn = QPushButton("Folder…")
        self.choose_btn.setAccessibleName("Choose the model folder")
        self.refresh_btn = QPushButton("Refresh")
        row.addWidget(self.folder_label, 1)
        row.addWidget(self.choose_btn)
        row.addWidget(self.refresh_btn)
        lay.addLayout(row)
        self.list = QListWidget()  # two wrapped lines per model: it reads in a narrow panel, unlike a wide table
        self.list.setAccessibleName("Model library")
        self.list.setWordWrap(True)
        self.list.setAlternatingRowColors(True)
        self.list.setMinimumHeight(140)
        lay.addWidget(self.list, 1)
        self.open_btn = QPushButton("Open selected model")
        lay.addWidget(self.open_btn)
        self.choose_btn.clicked.connect(self._choose)
        self.open_btn.clicked.connect(self._open_selected)
        self.list.itemDoubleClicked.connect(lambda item: self._open_row(self.list.row(item)))

    def show_entries(self, entries: list[LibraryEntry], folder: str) -> None:
        self.folder, self.entries = folder, entries
        self.folder_label.setText(folder or "No folder chosen: recent files only")
        self.list.clear()
        for e in entries:
            item = QListWidgetItem(f"{e.name}\n{describe_line(e)}")
            item.setToolTip(e.path)
            self.list.addItem(item)

    def _choose(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Folder with GGUF models", self.folder)
        if d:
            self.folderChanged.emit(d)

    def _open_selected(self) -> None:
        if self.list.currentRow() >= 0:
            self._open_row(self.list.currentRow())

    def _open_row(self, row: int) -> None:
        if 0 <= row < len(self.entries) and not self.entries[row].error:
            self.openRequested.emit(self.entries[row].path)

