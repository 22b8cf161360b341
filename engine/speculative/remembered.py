"""auto's memory kept across processes: what runs of a model learned about its draft and verify costs and its
acceptance by depth (depth.AutoMemory), one small JSON file per model file, backend and thread count in a directory
(EngineConfig.auto_memory_dir), so the next process that opens the same model starts drafting at the depth that
paid instead of spending its first replies measuring again. The memory halves its evidence at every reply that drafts,
so what a file holds fades as new replies come. A file that cannot be read is set aside (a fresh memory instead, and a
warning); one that cannot be written costs only the next run's head start."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from engine.speculative.depth import AutoMemory

FORMAT = 1  # the files' layout; a file of another is not read
_log = logging.getLogger(__name__)


def default_dir() -> str:
    """Where the app and the command line keep the memories: the user's cache folder."""
    from platformdirs import user_cache_dir

    return str(Path(user_cache_dir("Foretell", appauthor=False)) / "auto-depth")


def memory_path(directory: str | os.PathLike[str], model: str | os.PathLike[str], backend: str,
                threads: int) -> Path:
    """The file for one model file (its resolved path, size and modification time: a changed file starts afresh),
    backend and thread count: costs measured with other kernels or cores say little about these."""
    p = Path(model).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{backend}|{threads}"
    return Path(directory) / f"{p.stem[:48]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _memory_of(data: dict[str, Any]) -> AutoMemory:
    fields = {f.name for f in dataclasses.fields(AutoMemory)}
    if data.get("format") != FORMAT or not fields >= set(data["memory"]):
        raise ValueError("not an auto-depth memory of this version")
    m = dict(data["memory"])
    for name in ("t_verify", "verify_timings"):
        m[name] = {int(k): float(v) for k, v in m.get(name, {}).items()}
    if "below_cut" in m:
        m["below_cut"] = tuple(m["below_cut"])
    return AutoMemory(**m)


def load_memory(path: Path) -> AutoMemory:
    """The memory in `path`; a fresh one where there is none or it cannot be read."""
    try:
        return _memory_of(json.loads(path.read_text()))
    except FileNotFoundError:
        return AutoMemory()
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        _log.warning("auto-depth memory %s set aside (%s): starting afresh", path, e)
        return AutoMemory()


def save_memory(path: Path, memory: AutoMemory) -> None:
    """Write the memory (whole or not at all: a temporary file renamed over the old one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "memory": dataclasses.asdict(memory)}))
        os.replace(tmp, path)
    except OSError as e:
        _log.warning("auto-depth memory not written to %s (%s)", path, e)
