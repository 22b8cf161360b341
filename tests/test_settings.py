"""Settings persist across restarts, survive corrupted values, and map onto the engine's configs."""
from __future__ import annotations

from PySide6.QtCore import QSettings

from app.settings import AppSettings, SettingsPanel, load_settings, save_settings


def _qs(tmp_path) -> QSettings:
    return QSettings(str(tmp_path / "foretell.ini"), QSettings.Format.IniFormat)


def test_persisted_and_applied(tmp_path, qtbot) -> None:
    s = AppSettings(mtp=False, draft="3", temperature=0.7, top_k=40, top_p=0.9, seed=7, context=8192,
                    system_prompt="Be brief.", theme="dark")
    s.add_recent("/a.gguf")
    s.add_recent("/b.gguf")
    s.add_recent("/a.gguf")
    save_settings(_qs(tmp_path), s)
    back = load_settings(_qs(tmp_path))  # a fresh QSettings: what the next start reads
    assert back == s and back.recent_models == ["/a.gguf", "/b.gguf"]
    g = back.generation_config()
    assert g.mtp is False and g.draft == 3 and g.sampling.temperature == 0.7 and g.sampling.top_k == 40
    assert g.sampling.seed == 7 and back.engine_config().n_ctx == 8192
    assert AppSettings().generation_config().draft is None and AppSettings().generation_config().sampling.seed is None


def test_corrupted_values_fall_back(tmp_path) -> None:
    qs = _qs(tmp_path)
    qs.setValue("temperature", "hot")
    qs.setValue("draft", "99")
    qs.setValue("theme", "neon")
    qs.setValue("context", "2048")
    qs.sync()
    s = load_settings(_qs(tmp_path))
    assert s.temperature == 0.0 and s.draft == "auto" and s.theme == "system" and s.context == 2048


def test_panel_emits_changes(qtbot) -> None:
    panel = SettingsPanel(AppSettings())
    qtbot.addWidget(panel)
    seen = []
    panel.changed.connect(seen.append)
    panel.draft.setCurrentText("4")
    panel.temperature.setValue(0.5)
    panel.mtp.setChecked(False)
    assert seen and seen[-1].draft == "4" and seen[-1].temperature == 0.5 and seen[-1].mtp is False
    assert panel.draft.accessibleName() == "Draft depth"
