"""Model files: plain-language checks before a load, and the model library (folder + recent files)."""
from __future__ import annotations

from pathlib import Path

import pytest

from app.library import LibraryPanel, check_model_file, describe, scan
from engine.errors import ModelFormatError
from tests.fixtures import TINY_MOE, fixture_path


def test_check_model_file_says_what_is_wrong_in_plain_words(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("just notes")
    for path, want in ((notes, "notes.txt is not a GGUF model file"), (tmp_path / "gone.gguf", "gone.gguf was not found"),
                       (tmp_path, f"{tmp_path.name} is a folder, not a GGUF model file")):
        with pytest.raises(ModelFormatError) as e:
            check_model_file(path)
        assert str(e.value).startswith(want)
    assert check_model_file(fixture_path(TINY_MOE)).hparams.arch == "qwen35moe"


def test_library_lists_folder_and_recent_files_with_a_fit_estimate(qtbot, tmp_path: Path) -> None:
    model = fixture_path(TINY_MOE)
    (tmp_path / "notes.gguf").write_text("not a model")
    entries = scan(tmp_path, [str(model), str(tmp_path / "deleted.gguf")], n_ctx=512)
    assert [Path(e.path).name for e in entries] == ["notes.gguf", model.name]  # missing recent files are dropped
    bad, good = entries
    assert bad.error == "notes.gguf is not a GGUF model file"
    assert good.architecture == "qwen35moe" and good.params > 0 and good.file_bytes == model.stat().st_size
    assert good.context > 0 and "%" in good.quant_mix and good.fits.startswith("fits in RAM: needs ")
    assert describe(model, 512) == good
    panel = LibraryPanel()
    qtbot.addWidget(panel)
    panel.show_entries(entries, str(tmp_path))
    assert panel.list.count() == 2 and panel.list.item(0).text() == "notes.gguf\nnotes.gguf is not a GGUF model file"
    line = panel.list.item(1).text().splitlines()[1]
    assert line.startswith("qwen35moe · ") and f"MTP {'yes' if good.mtp else 'no'}" in line and "fits in RAM" in line
    with qtbot.waitSignal(panel.openRequested) as sig:
        panel.list.setCurrentRow(1)
        panel.open_btn.click()
    assert sig.args == [good.path]
    with qtbot.assertNotEmitted(panel.openRequested):
        panel._open_row(0)  # a file that cannot be opened is not offered
