"""Which kernels run: a Backend is chosen once, when a model is built, and stored with each weight and layer.

Native backends run engine/native's kernels in one instruction-set form each:
  - ``native-avx512vnni``: Q4_K, Q6_K and Q8_0 weights packed 16 rows interleaved for dpbusd (where a matrix is
    made of whole 16-row groups; the others read their stored blocks), AVX512 float kernels;
  - ``native-avx512``: AVX512 kernels (Q8_0 with VNNI where the CPU has it); Q4_K, Q6_K and Q8_0 packed as for VNNI
    and multiplied in the AVX2 packed form (on the Qwen3.5-9B shape 19.6 tok/s against 14.4 for its stored-order
    AVX512 products: bench/results/sweep_9b.json);
  - ``native-avxvnni``: AVX2 with the VEX AVX-VNNI of Intel's desktop cores from Alder Lake on (most without
    AVX512): the AVX2 backend's kernels, its packed and Q8_0 products with dpbusd/dpwssd (the same bits);
  - ``native-avx2``: AVX2 (+FMA, F16C) products, Q4_K, Q6_K and Q8_0 packed as for VNNI (maddubs over each
    vector's two 8-row halves: the VNNI form's bits), the others in the stored block order; the float kernels'
    loops built for AVX2 (what most desktop CPUs run);
  - ``native-portable``: the portable C loops.
The ``triton`` backend runs quantized products on CUDA in engine.ops.triton_q's kernels over the stored blocks
(everything else in torch ops on the device); a native backend used for a layer on a CUDA device becomes it (`on`)
where Triton is installed and its kernels pass a self-check on the device. Without a GPU its kernels run on CPU
tensors only in Triton's interpreter (TRITON_INTERPRET=1: the tests).
The ``torch`` backend runs everything in torch ops (Q8_0 in integer GEMMs, other types dequantized tile by tile,
attention and the delta rule as torch loops): the twin the native kernels are tested against, and the path on
other accelerators and where the native library or Triton is missing. Tests and benchmarks pick a backend from
`available_backends()` (or TRITON) and pass it to the model (or to EngineConfig); nothing is chosen by module flags.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from engine.ops import native

NATIVE_ISAS = ("avx512vnni", "avx512", "avxvnni", "avx2", "portable")
# the level each asks the native library for (kernels.h ISA_*, checked against the library by the tests): a kernel
# runs its best form at or below it that the CPU has
ISA_LEVEL = {"portable": 0, "avx2": 1, "avxvnni": 2, "avx512": 3, "avx512vnni": 4}
PACKED_ISAS = ("avx512vnni", "avx512", "avxvnni", "avx2")  # the forms with packed products (engine/native/packed_x16.c)


@dataclass(frozen=True)
class OpEvent:
    """What one op did, for a backend's observer (benchmarks count calls, bytes and time through it)."""

    op: str  # "linear", "linear_many", "moe_experts", "attention", "delta_rule"
    nbytes: int  # weight bytes the op read (stored size of the weights or experts it used)
    rows: int  # activation rows (tokens) of the pass
    seconds: float  # wall time of the op
    experts: int = 0  # moe_experts: distinct experts the pass used


Observer = Callable[[OpEvent], None]


@dataclass(frozen=True)
class Int8Layouts:
    """Where the torch backend's integer Q8_0 products switch layouts (engine.ops.torch_int8). Every layout gives
    the same exact integer sums; tests move the thresholds to force each one."""

    blockdiag_rows: int = 32  # up to this many rows, one block-diagonal GEMM (nb× the multiplies) per product
    dense_expert_macs: int = 1 << 25  # expert passes up to this size run as one GEMM over all selected experts
    down_blockdiag_macs: int = 1 << 22  # down projections up to this size in block-diagonal form
    gate_up_blockdiag_macs: int = 1 << 22  # gate/up over tokens × selected experts likewise
    max_cols: int = 512  # widest Q8_0 rows taken in integers; wider ones dequantize (bench/results/q8dot.json)


@dataclass(frozen=True)
class Backend:
    kind: str = "native"  # "native", "triton" or "torch"
    isa: str = "avx512vnni"  # native: one of NATIVE_ISAS; triton: "triton"; torch: "torch"
    threads: int | None = None  # native calls: this many threads; None: torch's count (one for small calls)
    int8: Int8Layouts = Int8Layouts()
    observer: Observer | None = field(default=None, compare=False)
    # Derived anonymous copies of weights (packed forms, stacked projections) allowed; False keeps every weight a
    # view of the file mapping, which the kernel can drop and re-read (engine.memory: models near or over RAM).
    copies: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("native", "triton", "torch") or (self.kind == "native") != (self.isa in NATIVE_ISAS) \
                or (self.kind != "native" and self.isa != self.kind):
            raise ValueError(f"no backend {self.kind}/{self.isa}")

    @property
    def name(self) -> str:
        return self.kind if self.kind != "native" else f"native-{self.isa}"

    @property
    def native(self) -> bool:
        return self.kind == "native"

    @property
    def level(self) -> int:
        """The instruction-set level the native calls ask for."""
        return ISA_LEVEL.get(self.isa, 0)

    @property
    def packs(self) -> bool:
        """Q4_K, Q6_K and Q8_0 weights interleaved 16 rows at a time for the packed products (VNNI, AVX-VNNI and
        AVX2 forms; AVX512 without VNNI runs the AVX-VNNI one where the CPU has it, else the AVX2 one)."""
        return self.isa in PACKED_ISAS and self.copies

    def on(self, device: torch.device | str) -> Backend:
        """The backend for weights and layers on `device`: native kernels run on the CPU only, Triton's on CUDA
        (on the CPU in its interpreter only); torch anywhere."""
        dev = torch.device(device)
        if self.kind == "torch" or (self.kind == "native" and dev.type == "cpu") or (
                self.kind == "triton" and triton_runs(dev.type)):
            return self
        if dev.type == "cpu":  # a Triton backend's layer kept on the CPU without the interpreter
            return default_backend()
        kind = "triton" if triton_runs(dev.type) else "torch"
        return replace(self, kind=kind, isa=kind)

    def n_threads(self, work: int) -> int:
        """Threads for a native call of `work` multiply-adds: the fixed count, else torch's, one for small calls
        (a parallel region costs more than it saves there)."""
        if self.threads is not None:
            return self.threads
        return torch.get_num_threads() if work >= 1 << 16 else 1

    def with_observer(self, observer: Observer | None) -> Backend:
        return replace(self, observer=observer)

    def __repr__(self) -> str:
        return f"Backend({self.name}{'' if self.copies else ', mapped'})"


TORCH = Backend("torch", "torch")
TRITON = Backend("triton", "triton")


@functools.cache
def triton_runs(device_type: str) -> bool:
    """Whether engine.ops.triton_q's kernels run on this kind of device: compiled on CUDA (after a check of every
    kernel against the torch dequantization there), interpreted on the CPU when TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        return False
    interpret = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    if device_type == "cpu":
        return interpret
    if device_type != "cuda" or interpret or not torch.cuda.is_available():
        return False
    from engine.ops import triton_q

    why = triton_q.self_check(torch.device("cuda"))
    if why is not None:
        logging.getLogger(__name__).warning("Triton kernels unusable on this GPU (%s): torch products instead", why)
    return why is None


def available_backends() -> list[Backend]:
    """Every backend this machine runs, the fastest first."""
    out = []
    if native.available():
        if native.cpu_vnni():
            out.append(Backend("native", "avx512vnni"))
        if native.cpu_avx512():
            out.append(Backend("native", "avx512"))
        if native.cpu_avxvnni():
            out.append(Backend("native", "avxvnni"))
        if native.cpu_avx2():
            out.append(Backend("native", "avx2"))
        out.append(Backend("native", "portable"))
    return out + [TORCH]


def default_backend() -> Backend:
    return available_backends()[0]


def backend_named(name: str) -> Backend:
    for b in available_backends():
        if b.name == name:
            return b
    names = ", ".join(b.name for b in available_backends())
    raise ValueError(f"backend {name!r} is not available on this machine (available: {names})")
