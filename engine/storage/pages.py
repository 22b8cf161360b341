"""Memory tricks for model files: malloc tuning for dequantization tiles, dropping the resident pages of file bytes
the engine reads from another copy (a packed or stacked weight) or read only while loading, and reading scattered rows
from the file instead of through its mapping."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
from dataclasses import dataclass

import numpy as np
import torch


def tune_malloc() -> None:
    """Keep freed temporaries in the heap instead of handing them back to the kernel.

    glibc unmaps/trims freed multi-MB blocks eagerly, so every dequant tile page-faults its
    temporaries in again; on the 2-core VM this made unpacking 2-8x slower. Serving blocks
    < 32 MiB from the heap and keeping up to 256 MiB of free heap removes that cost for a
    bounded amount of retained memory. No-op off glibc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 256 << 20)


@dataclass(frozen=True)
class _Mapping:
    """A read-only GGUF file mapping: its address range, counted only while the array holding the mapping lives (a
    later mapping may reuse the addresses), and a descriptor of the same file, opened with it."""

    ref: weakref.ref
    start: int
    end: int
    fd: int


_FILE_MAPPINGS: list[_Mapping] = []
_MADV_DONTNEED = 4


def register_file_mapping(arr: np.memmap) -> None:
    """Record `arr` (a read-only memory map of a model file) as bytes that `release_pages` may drop and `read_rows`
    may read from the file."""
    start = arr.ctypes.data
    fd = os.open(arr.filename, os.O_RDONLY)  # now, as the mapping: a file replaced later is not the one mapped
    weakref.finalize(arr, os.close, fd)
    _FILE_MAPPINGS[:] = [m for m in _FILE_MAPPINGS if m.ref() is not None] + \
        [_Mapping(weakref.ref(arr), start, start + arr.nbytes, fd)]


def _mapping_of(lo: int, hi: int) -> _Mapping | None:
    return next((m for m in _FILE_MAPPINGS if m.ref() is not None and m.start <= lo and hi <= m.end), None)


def release_pages(t: torch.Tensor) -> bool:
    """Drop the resident pages of t's bytes when t views a registered file mapping: they are clean copies of the
    file and come back from it if read again. For weights that the engine reads from another copy (kquant's packed
    Q4_K) so they stop counting twice in the process's memory. Anything else (t's own memory) is left alone."""
    if t.device.type != "cpu":
        return False
    lo = t.data_ptr()
    return _drop(lo, lo + t.numel() * t.element_size())


def release_mapping(arr: np.ndarray) -> bool:
    """Drop every resident page of a registered file mapping: what loading read of it (the header, the scales of
    every block, the small tensors copied into floats) and no longer reads there. The mapping stays valid: a
    later read brings a page back from the page cache."""
    lo = arr.ctypes.data
    return _drop(lo, lo + arr.nbytes)


def _drop(lo: int, hi: int) -> bool:
    """madvise(DONTNEED) over the pages of [lo, hi) when they lie in a registered file mapping: the pages it shares
    with neighbouring bytes too (clean copies of the file as well: a reader there faults them back)."""
    if not sys.platform.startswith("linux") or _mapping_of(lo, hi) is None:
        return False
    page = 4096
    a, b = lo // page * page, -(-hi // page) * page
    if b <= a:
        return False
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise(a, b - a, _MADV_DONTNEED) == 0


def read_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """Rows `rows` of t (a 2-D view of a registered file mapping, each row's bytes contiguous) read from the file into
    new memory, not through the mapping: a read there maps the folio around each row into this process and leaves it
    there (64 KiB, or 2 MiB where the page cache holds the file in huge pages). For scattered lookups in a big table
    (token embeddings). None where t views no such mapping or the system has no preadv."""
    if t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1 or not hasattr(os, "preadv"):
        return None
    size = t.element_size()
    lo = t.data_ptr()
    m = _mapping_of(lo, lo + (t.shape[0] * t.stride(0)) * size)
    if m is None:
        return None
    if rows and not 0 <= min(rows) <= max(rows) < t.shape[0]:
        raise IndexError(f"row {min(rows) if min(rows) < 0 else max(rows)} of a table of {t.shape[0]}")
    width, stride, at = t.shape[1] * size, t.stride(0) * size, lo - m.start
    out = np.empty((len(rows), width), dtype=np.uint8)
    for i, r in enumerate(rows):
        if os.preadv(m.fd, [out[i]], at + r * stride) != width:
            raise OSError(f"the model file ends inside row {r} of a table (was it truncated?)")
    return torch.from_numpy(out).view(t.dtype)


HUGE = 2 << 20


def huge_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes in a fresh anonymous mapping whose whole 2 MiB pages are asked to be
    transparent huge pages (madvise(MADV_HUGEPAGE) before anything touches them; memory from the heap may already
    be faulted in 4 KiB pages): for the packed weights a decode step streams through. In 4 KiB pages each page of
    a streamed matrix costs a TLB walk and stops the hardware prefetchers. Below a huge page, or where the system
    has no such advice, a plain tensor."""
    if nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # Private (a shared anonymous mapping is shmem, under another THP switch); the slack before the aligned start and
    # past its end is never touched, so never resident.
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
    lo = t.data_ptr()
    skip = -(-lo // HUGE) * HUGE - lo
    try:
        m.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // HUGE * HUGE)
    except OSError:
        pass
    return t[skip:skip + nbytes]
