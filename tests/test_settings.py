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


def test_gpu_settings_persist_and_are_disabled_with_the_reason_without_cuda(tmp_path, qtbot) -> None:
    usable, missing = (True, ""), (False, "no usable NVIDIA GPU or driver was found")
    s = AppSettings(device="cuda", gpu_layers=24, cpu_moe=True, expert_cache="64")
    save_settings(_qs(tmp_path), s)
    back = load_settings(_qs(tmp_path))
    assert (back.device, back.gpu_layers, back.cpu_moe, back.expert_cache) == ("cuda", 24, True, "64")
    # With CUDA the hybrid settings reach the engine config; without, the load stays on the CPU.
    cfg = back.engine_config(usable)
    assert (cfg.device, cfg.gpu_layers, cfg.cpu_moe, cfg.expert_cache) == ("cuda", 24, True, "64")
    assert AppSettings(device="cuda").engine_config(usable).gpu_layers is None  # −1 = auto
    assert back.engine_config(missing).device == "cpu"
    panel = SettingsPanel(back, cuda_state=missing)
    qtbot.addWidget(panel)
    assert not panel.gpu_layers.isEnabled() and not panel.device.isEnabled() and not panel.expert_cache.isEnabled()
    assert "no usable NVIDIA GPU" in panel.gpu_reason.text()
    panel = SettingsPanel(AppSettings(), cuda_state=usable)
    qtbot.addWidget(panel)
    seen = []
    panel.changed.connect(seen.append)
    assert panel.gpu_layers.isEnabled() and panel.gpu_layers_label.text() == "auto"
    panel.gpu_layers.setValue(12)
    panel.cpu_moe.setChecked(True)
    panel.expert_cache.setCurrentText("512MiB")
    assert (seen[-1].gpu_layers, seen[-1].cpu_moe, seen[-1].expert_cache) == (12, True, "512MiB")
    assert panel.gpu_layers_label.text() == "12"
    # CUDA without the Triton kernels: the controls work, and the panel says what will run slower
    panel = SettingsPanel(AppSettings(), cuda_state=(True, "Triton kernels unavailable (install triton==3.7.1)"))
    qtbot.addWidget(panel)
    assert panel.gpu_layers.isEnabled() and "Triton kernels unavailable" in panel.gpu_reason.text()
