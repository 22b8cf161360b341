"""The engine's native kernels (engine/native/*.c), loaded with ctypes.

Built with the package (setup.py) into one library with no Python API. Where it is missing (a source
install without a C compiler) `LIB` is None and every caller keeps its torch path, which the tests also run.
What is in it: the K-quant and Q8_0 products (engine.kquant), the grouping of routed-expert pairs
(`group_pairs`), causal attention over the KV cache (`attention`) and the Gated DeltaNet recurrence
(`gdn_recurrent`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int

_SIGNATURES: dict[str, tuple[list, object]] = {
    "kq_quantize_q8k": ([_P, _I, _I, _P, _P, _P, _C], None),
    "kq_matmul": ([_C, _P, _I, _I, _P, _P, _P, _P, _I, _I, _P, _I, _C, _C], None),
    "kq_matmul_pairs": ([_C, _P, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _C, _C], None),
    "kq_q4k_order": ([_P, _I, _I, _P], None),
    "kq_repack": ([_C, _P, _I, _I, _P, _C], None),
    "kq_packed_bytes": ([_C], _I),
    "kq_isa": ([], _C),
    "q8_isa": ([], _C),
    "q8_quantize_q8_0": ([_P, _I, _I, _P, _P], None),
    "kq_group_pairs": ([_P, _I, _I, _I, _P, _P, _P, _P, _P], _I),
    "kq_attention": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _C, _C], _C),
    "kq_gdn_recurrent": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _C, _C], _C),
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
# True: the GDN recurrence runs its portable loop even where the AVX512 register form can (tests compare them).
PORTABLE_GDN = False
# True: attention runs its plain C loops even where the AVX512 ones can (scores four keys at a time, outputs held in
# registers over 16 keys); tests compare the two.
PORTABLE_ATTENTION = False


def available() -> bool:
    return LIB is not None


def threads(work: int) -> int:
    """Threads for a kernel call of `work` multiply-adds: torch's count, one for small calls (a parallel
    region costs more than it saves there)."""
    return torch.get_num_threads() if work >= 1 << 16 else 1


@dataclass(frozen=True)
class Groups:
    """A pass's (token, slot) pairs grouped by expert, as a stable argsort of the flat top-k ids orders them."""

    order: torch.Tensor  # [P] flat pair indices t·k + s, in expert order
    tokens: torch.Tensor  # [P] the pairs' tokens (order // k)
    experts: torch.Tensor  # [G] the experts present, ascending
    counts: torch.Tensor  # [G] their pairs
    starts: torch.Tensor  # [G + 1] their first pairs, then P


def group_pairs(idx: torch.Tensor, n_expert: int) -> Groups:
    """A pass's top-k ids [n, k] (int64 on the CPU) grouped by expert, in one call."""
    idx = idx.contiguous()
    p_n, g_max = idx.numel(), min(idx.numel(), n_expert)
    buf = torch.empty(2 * p_n + 3 * g_max + 1, dtype=torch.long)
    order, tokens, experts, counts, starts = buf.split([p_n, p_n, g_max, g_max, g_max + 1])
    g = LIB.kq_group_pairs(idx.data_ptr(), idx.shape[0], idx.shape[1], n_expert, order.data_ptr(),  # type: ignore[union-attr]
                           tokens.data_ptr(), experts.data_ptr(), counts.data_ptr(), starts.data_ptr())
    if g < 0:
        raise ValueError(f"an expert id is outside [0, {n_expert})")
    return Groups(order, tokens, experts[:g], counts[:g], starts[:g + 1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    """Causal attention of a pass's queries q [n, H, D] (query i at position pos + i) over the cache rows
    k [≥ pos + n, H_kv, D], v [·, H_kv, D_v] (float32, contiguous, on the CPU): out [n, H·D_v]."""
    n, h, dk = q.shape
    h_kv, dv = v.shape[1], v.shape[2]
    q = q.contiguous()
    out = torch.empty(n, h * dv)
    rc = LIB.kq_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, pos, h, h_kv, dk, dv,  # type: ignore[union-attr]
                          scale, threads(n * h * (pos + n) * (dk + dv)), PORTABLE_ATTENTION)
    if rc != 0:
        raise MemoryError("no memory for the attention scores")
    return out


def floats_usable(*ts: torch.Tensor) -> bool:
    """Whether the float kernels (attention, GDN recurrence) can run on these tensors: float32 on the CPU,
    no autograd."""
    return LIB is not None and all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad
                                   for t in ts)


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                  S: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The delta rule over a pass's n tokens, token by token: q, k [n, H_k, d_k] (value head h reads key head
    h mod H_k), v [n, H, d_v], β and e^g [n, H]; from the state S [H, d_k, d_v] to the state after the last
    token, written into `out` (S itself when None: in place; another buffer keeps S as it was).
    Returns o [n, H, d_v]."""
    n, hk, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    if h % hk:
        raise ValueError(f"{h} value heads cannot share {hk} key heads")
    q, k, v, beta, decay = (t.contiguous() for t in (q, k, v, beta, decay))
    out = S if out is None else out
    if not (S.is_contiguous() and out.is_contiguous()):
        raise ValueError("the GDN state must be contiguous")
    o = torch.empty(n, h, dv)
    rc = LIB.kq_gdn_recurrent(q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), decay.data_ptr(),  # type: ignore[union-attr]
                              S.data_ptr(), out.data_ptr(), o.data_ptr(), n, h, hk, dk, dv, threads(n * h * dk * dv),
                              PORTABLE_GDN)
    if rc != 0:
        raise ValueError(f"GDN value heads of {dv} exceed the native kernel's limit")
    return o
