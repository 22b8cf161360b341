"""System monitor for the live charts: RAM/CPU (psutil), GPU memory (NVML via pynvml, guarded) and the
process's torch CUDA allocations. Every source is optional: what is unavailable is simply absent."""
from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class SystemSample:
    rss_bytes: int
    ram_used_bytes: int
    ram_total_bytes: int
    cpu_percent: float
    vram_used_bytes: int | None = None  # NVML, whole GPU
    vram_total_bytes: int | None = None
    torch_cuda_bytes: int | None = None  # this process's torch allocations


class SystemMonitor:
    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # prime: the first call always returns 0
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception:  # no NVIDIA driver / GPU: CPU-only monitoring
            self._nvml = None

    @property
    def has_gpu(self) -> bool:
        return self._nvml is not None

    def sample(self) -> SystemSample:
        vm = psutil.virtual_memory()
        used = total = torch_bytes = None
        if self._nvml is not None:
            nv, handle = self._nvml
            try:
                info = nv.nvmlDeviceGetMemoryInfo(handle)
                used, total = int(info.used), int(info.total)
            except Exception:
                pass
            try:
                import torch

                if torch.cuda.is_available():
                    torch_bytes = int(torch.cuda.memory_allocated())
            except Exception:
                pass
        return SystemSample(int(self._proc.memory_info().rss), int(vm.total - vm.available), int(vm.total),
                            float(self._proc.cpu_percent(None)), used, total, torch_bytes)


def cuda_status() -> tuple[bool, str]:
    """(CUDA usable, why not, or a note on what runs): what the app's GPU controls and the CLI's --device cuda
    depend on."""
    import torch

    if torch.version.cuda is None:
        return False, (f"this build of torch ({torch.__version__}) has no CUDA support; in a source checkout, "
                       "make setup-cuda installs the CUDA build (see README)")
    if not torch.cuda.is_available():
        return False, "no usable NVIDIA GPU or driver was found"
    from engine.ops.backend import triton_runs

    if not triton_runs("cuda"):
        return True, ("Triton kernels unavailable (install triton==3.7.1): quantized products on the GPU run in "
                      "torch, several times slower")
    return True, ""
