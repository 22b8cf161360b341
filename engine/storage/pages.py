"""Memory tricks for model files: malloc tuning for dequantization tiles, and dropping the resident pages of file
bytes the engine reads from another copy (a packed or stacked weight)."""
from __future__ import annotations

import ctypes
import sys
import weakref

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


# Address ranges of read-only GGUF file mappings, each with a weak reference to the array that holds the mapping:
# a range counts only while its mapping lives (a later mapping may reuse the addresses).
_FILE_MAPPINGS: list[tuple[weakref.ref, int, int]] = []
_MADV_DONTNEED = 4


def register_file_mapping(arr: np.ndarray) -> None:
    """Record `arr` (a read-only memory map of a model file) as bytes that `release_pages` may drop."""
    start = arr.ctypes.data
    _FILE_MAPPINGS[:] = [m for m in _FILE_MAPPINGS if m[0]() is not None] + [(weakref.ref(arr), start, start + arr.nbytes)]


def release_pages(t: torch.Tensor) -> bool:
    """Drop the resident pages of t's bytes when t views a registered file mapping: they are clean copies of the
    file and come back from it if read again. For weights that the engine reads from another copy (kquant's packed
    Q4_K) so they stop counting twice in the process's memory. Anything else (t's own memory) is left alone."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    if not any(ref() is not None and start <= lo and hi <= end for ref, start, end in _FILE_MAPPINGS):
        return False
    page = 4096
    a, b = -(-lo // page) * page, hi // page * page
    if b <= a:
        return False
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise(a, b - a, _MADV_DONTNEED) == 0
