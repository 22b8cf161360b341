"""The engine on its own QThread (GPT4All's shape): the GUI talks to it only through queued signals.

`EngineController` lives in the GUI thread and owns the thread and the worker. Requests go GUI → worker as
signals (queued: they run on the worker thread); results come back as signals (queued: they run on the GUI
thread). Stop is a `threading.Event` set directly from the GUI thread — the worker is busy inside the
decode loop and would never see a queued call in time; the engine checks it every decode step.
Errors never escape as tracebacks: typed engine errors become their message, anything else a short line.
Loading is safe: the new file is validated (app.library.check_model_file) while the current model stays
loaded; only a valid file replaces it, and if preparing it still fails the previous model is reopened.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from engine.api import EngineLike, ServedEngine
from engine.errors import EngineError, LoadCancelled
from app.library import check_model_file
from engine.events import Done, EngineConfig, GenerationConfig, Progress, Stats, Token
from engine.generate import Engine, load
from engine.remote import RemoteConfig
from engine.remote import connect as connect_remote
from app.remote import remote_info


def model_info(eng: Engine) -> dict[str, Any]:
    """What the model panel shows (plain data: safe to pass between threads)."""
    mf, hp = eng.mf, eng.hp
    pc = mf.param_counts
    return {
        "path": str(mf.path), "name": mf.get("general.name") or mf.path.stem, "architecture": hp.arch,
        "file_bytes": mf.file_size, "layers": hp.n_layer, "layer_pattern": mf.layer_pattern(),
        "hidden": hp.n_embd, "vocab": hp.n_vocab, "context_train": hp.n_ctx_train, "context": eng.n_ctx,
        "experts": hp.n_expert, "experts_used": hp.n_expert_used, "mtp": hp.has_mtp,
        "params_total": pc.total, "params_active": pc.active,
        "quant_mix": {k: v["bytes"] for k, v in mf.type_histogram().items()},
        "notices": list(eng.notices),
        "placement": eng.plan.summary(),
    }


class EngineWorker(QObject):
    loadProgress = Signal(float, str)
    loaded = Signal(object)  # model_info dict
    loadFailed = Signal(str)  # plain-language reason; the previous model (if any) is still loaded
    loadCancelled = Signal(str)  # the user cancelled; the previous model (if any) is loaded again
    prefill = Signal(int, int)  # prompt tokens processed, of
    token = Signal(str, bool)  # text, came from an accepted draft
    stats = Signal(object)  # engine.generate.Stats
    finished = Signal(str, str)  # stop reason, message
    failed = Signal(str)

    def __init__(self, loader: Callable[..., Engine] = load) -> None:
        """`loader`: how a model file becomes an Engine (engine.generate.load's arguments)."""
        super().__init__()
        self.loader = loader
        self.engine: EngineLike | None = None  # a local Engine or a RemoteEngine
        self.stop_flag = threading.Event()
        self.load_cancel = threading.Event()  # set by the GUI thread; cleared when a load is requested
        # Held while generating; app.serve_panel's server takes the same lock, so the window and the
        # server never generate on one engine at once.
        self.gen_lock = threading.Lock()

    @property
    def served(self) -> ServedEngine | None:
        """The engine where it is a local one — the model's own tokenizer, template and file, what the server
        serves and prompts are counted with — else None (a remote engine, or none)."""
        return self.engine if isinstance(self.engine, Engine) else None

    @Slot(object, object)
    def load(self, path: str | None, config: EngineConfig) -> None:
        try:
            mf = check_model_file(path)
        except EngineError as e:
            self.loadFailed.emit(str(e))
            return
        previous = (str(self.engine.mf.path), self.engine.config) if isinstance(self.engine, Engine) else None
        self.engine = None  # the old weights go before the new ones are prepared: never two models in memory
        try:
            eng = self.loader(mf, config, progress=lambda f, m: self.loadProgress.emit(f, m), cancel=self.load_cancel)
        except LoadCancelled as e:
            if previous is not None:
                self._reopen(*previous)
            self.loadCancelled.emit(str(e))
            return
        except Exception as e:
            if not isinstance(e, EngineError):  # a bug: one readable line for the dialog, details on stderr
                traceback.print_exc()
            msg = str(e) if isinstance(e, EngineError) else f"Unexpected error while loading: {type(e).__name__}: {e}"
            if previous is not None:
                self._reopen(*previous)
            self.loadFailed.emit(msg)
            return
        self.engine = eng
        self.loaded.emit(model_info(eng))

    @Slot(object)
    def connect_remote(self, config: RemoteConfig) -> None:
        """A remote engine replaces the current one only once its server, key and model have been checked."""
        self.loadProgress.emit(0.0, f"connecting to {config.url}")
        try:
            eng = connect_remote(config)
        except EngineError as e:
            self.loadFailed.emit(str(e))
            return
        except Exception as e:  # a bug: one readable line for the dialog, details on stderr
            traceback.print_exc()
            self.loadFailed.emit(f"Unexpected error while connecting: {type(e).__name__}: {e}")
            return
        self.engine = eng
        self.loaded.emit(remote_info(eng))

    def _reopen(self, path: str, config: EngineConfig) -> None:
        try:
            eng = self.loader(path, config)
        except EngineError:
            return  # the window then says no model is loaded
        self.engine = eng
        self.loaded.emit(model_info(eng))

    @Slot(object, object)
    def generate(self, messages: list, gen: GenerationConfig) -> None:
        if self.engine is None:
            self.failed.emit("No model is loaded.")
            return
        self.stop_flag.clear()
        try:
            with self.gen_lock:
                for ev in self.engine.generate(messages, gen, self.stop_flag):
                    if isinstance(ev, Token):
                        if ev.text:
                            self.token.emit(ev.text, ev.accepted_draft)
                    elif isinstance(ev, Stats):
                        self.stats.emit(ev)
                    elif isinstance(ev, Progress):
                        self.prefill.emit(ev.done, ev.total)
                    elif isinstance(ev, Done):
                        self.finished.emit(ev.reason, ev.message)
        except EngineError as e:
            self.failed.emit(str(e))
        except Exception as e:
            traceback.print_exc()
            self.failed.emit(f"Unexpected error while generating: {type(e).__name__}: {e}")


class EngineController(QObject):
    """GUI-side handle: starts the worker thread and forwards requests to it as queued signals."""

    requestLoad = Signal(object, object)
    requestGenerate = Signal(object, object)
    requestRemote = Signal(object)

    def __init__(self, parent: QObject | None = None, loader: Callable[..., Engine] = load) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("foretell-engine")
        self.worker = EngineWorker(loader)
        self.worker.moveToThread(self.thread)
        self.requestLoad.connect(self.worker.load)
        self.requestGenerate.connect(self.worker.generate)
        self.requestRemote.connect(self.worker.connect_remote)
        self.thread.start()

    def load(self, path: str | None, config: EngineConfig = EngineConfig()) -> None:
        self.worker.load_cancel.clear()
        self.requestLoad.emit(path, config)

    def cancel_load(self) -> None:
        """Stops a load between layers (an Event: the worker is busy loading)."""
        self.worker.load_cancel.set()

    def connect_remote(self, config: RemoteConfig) -> None:
        self.requestRemote.emit(config)

    def generate(self, messages: list, gen: GenerationConfig) -> None:
        self.requestGenerate.emit(messages, gen)

    def stop(self) -> None:
        """Honoured within one decode step (an Event, not a queued call: the worker is busy)."""
        self.worker.stop_flag.set()

    def shutdown(self) -> None:
        self.stop()
        self.cancel_load()
        self.thread.quit()
        self.thread.wait(10_000)
