"""auto's memory kept across processes (engine.speculative.remembered, EngineConfig.auto_memory_dir): what a reply
learned is written when it ends, and an engine opened later on the same file, backend and threads starts from it; a
file that cannot be read is set aside with a warning, never an error."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from engine import ops
from engine.events import EngineConfig
from engine.generate import load
from engine.speculative import AutoMemory, load_memory, memory_path, save_memory
from tests.generation import collect

EMBEDDED = Path(__file__).resolve().parent.parent / "resources" / "models" / "foretell-demo.gguf"
CHAT = [{"role": "user", "content": "Who made the heaven?"}]


def test_an_engine_starts_from_what_the_last_one_learned(tmp_path: Path) -> None:
    config = EngineConfig(n_ctx=256, n_threads=2, auto_memory_dir=str(tmp_path))
    first = load(EMBEDDED, config)
    assert first.auto_memory == AutoMemory() and not list(tmp_path.iterdir())
    first.tokenizer.eog_ids = frozenset()  # the whole reply decodes
    collect(first, CHAT, max_tokens=48, mtp=True, draft=None)
    assert first.auto_memory.t_decode is not None and first.auto_memory.compared > 0
    (path,) = tmp_path.iterdir()
    assert path == memory_path(tmp_path, EMBEDDED, ops.default_backend().name, 2)
    assert load_memory(path) == first.auto_memory
    second = load(EMBEDDED, config)
    assert second.auto_memory == first.auto_memory
    alone = load(EMBEDDED, EngineConfig(n_ctx=256, n_threads=2))  # no directory: nothing read, nothing written
    alone.tokenizer.eog_ids = frozenset()
    collect(alone, CHAT, max_tokens=16, mtp=True, draft=None)
    assert alone.auto_memory != first.auto_memory and list(tmp_path.iterdir()) == [path]


def test_the_file_is_per_model_file_backend_and_threads(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 64)
    base = memory_path(tmp_path, model, "native-avx2", 2)
    assert base == memory_path(tmp_path, model, "native-avx2", 2)
    others = {memory_path(tmp_path, model, "native-avx512vnni", 2), memory_path(tmp_path, model, "native-avx2", 1)}
    assert len(others | {base}) == 3
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: a fresh memory
    assert memory_path(tmp_path, model, "native-avx2", 2) != base


@pytest.mark.parametrize("text", ["{not json", '{"format": 0, "memory": {}}', '{"format": 1, "memory": {"nope": 1}}',
                                  '[1, 2]'])
def test_a_file_that_cannot_be_read_is_set_aside(tmp_path: Path, text: str, caplog) -> None:
    path = tmp_path / "memory.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        assert load_memory(path) == AutoMemory()
    assert "set aside" in caplog.text
    save_memory(path, AutoMemory(t_decode=0.01, t_verify={3: 0.02}))  # the next reply writes a good one over it
    assert load_memory(path) == AutoMemory(t_decode=0.01, t_verify={3: 0.02})


def test_a_folder_that_cannot_be_written_costs_only_the_head_start(tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        save_memory(blocked / "sub" / "memory.json", AutoMemory(t_decode=0.01))
    assert "not written" in caplog.text
