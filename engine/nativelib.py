"""The engine's native kernels (engine/native/*.c), loaded with ctypes.

Built with the package (setup.py) into one library with no Python API. Where it is missing (a source
install without a C compiler) `LIB` is None and every caller keeps its torch path, which the tests also run.
What is in it: the K-quant and Q8_0 products (engine.kquant), the grouping of routed-expert pairs
(`group_pairs`) and the Gated DeltaNet recurrence (`gdn_recurrent`).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int

_SIGNATURES: dict[str, tuple[list, object]] = {
    "kq_quantize_q8k": ([_P, _I, _I, _P, _P, _P], None),
    "kq_matmul": ([_C, _P, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _C, _C], None),
    "kq_matmul_pairs": ([_C, _P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _C, _C], None),
    "kq_q4k_order": ([_P, _I, _I, _P], None),
    "kq_isa": ([], _C),
    "q8_isa": ([], _C),
    "q8_quantize_q8_0": ([_P, _I, _I, _P, _P], None),
    "kq_group_pairs": ([_P, _I, _I, _I, _P, _P, _P], _I),
    "kq_gdn_recurrent": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _C], _C),
}


def _load() -> ctypes.CDLL | None:
    here = Path(__file__).resolve().parent / "native"
    for path in sorted(here.glob("_native*.so")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        return lib
    return None


LIB = _load()


def available() -> bool:
    return LIB is not None


def threads(work: int) -> int:
    """Threads for a kernel call of `work` multiply-adds: torch's count, one for small calls (a parallel
    region costs more than it saves there)."""
    return torch.get_num_threads() if work >= 1 << 16 else 1


def group_pairs(idx: torch.Tensor, n_expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pass's top-k ids [n, k] (int64 on the CPU) grouped by expert, as a stable argsort does: the flat pair
    indices in expert order, the experts present (ascending) and their pair counts."""
    idx = idx.contiguous()
    order = torch.empty(idx.numel(), dtype=torch.long)
    experts = torch.empty(min(idx.numel(), n_expert), dtype=torch.long)
    counts = torch.empty_like(experts)
    g = LIB.kq_group_pairs(idx.data_ptr(), idx.shape[0], idx.shape[1], n_expert, order.data_ptr(),  # type: ignore[union-attr]
                           experts.data_ptr(), counts.data_ptr())
    if g < 0:
        raise ValueError(f"an expert id is outside [0, {n_expert})")
    return order, experts[:g], counts[:g]


def gdn_usable(*ts: torch.Tensor) -> bool:
    """Whether the recurrence can run natively on these tensors: float32 on the CPU, no autograd."""
    return LIB is not None and all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad
                                   for t in ts)


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                  S: torch.Tensor, capture: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule over a pass's n tokens, token by token: q, k [n, H, d_k], v [n, H, d_v], β and e^g
    [n, H]; S [H, d_k, d_v] is advanced in place. Returns o [n, H, d_v] and, with `capture`, the state after
    every token but the last [n − 1, H, d_k, d_v] (after the last one it is S)."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, beta, decay = (t.contiguous() for t in (q, k, v, beta, decay))
    if not S.is_contiguous():
        raise ValueError("the GDN state must be contiguous")
    o = torch.empty(n, h, dv)
    states = torch.empty(n - 1, h, dk, dv) if capture else None
    rc = LIB.kq_gdn_recurrent(q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), decay.data_ptr(),  # type: ignore[union-attr]
                              S.data_ptr(), o.data_ptr(), states.data_ptr() if states is not None and n > 1 else None,
                              n, h, dk, dv, threads(n * h * dk * dv))
    if rc != 0:
        raise ValueError(f"GDN value heads of {dv} exceed the native kernel's limit")
    return o, states
