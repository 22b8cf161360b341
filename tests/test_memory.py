"""What a loaded model keeps in memory beyond its weights (issue 24: a 9B model's peak RSS over 1.1 × (file + state)):
no conv state holding a whole prompt chunk's window, no page of the model file left mapped once loading has copied
it, and none of the embedding table mapped by lookups."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from engine.events import EngineConfig
from engine.generate import load
from engine.storage.modelfile import open_model
from engine.storage.pages import read_rows
from tests.fixtures import KQUANT_MOE, fixture_path

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")


def _mapped_pages(t: torch.Tensor | np.ndarray) -> int:
    """Pages wholly inside t's bytes mapped into this process now (the present bit of /proc/self/pagemap): a page t
    shares with a neighbouring tensor may be mapped for the neighbour's sake."""
    lo, n = (t.data_ptr(), t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else (t.ctypes.data, t.nbytes)
    first, end = -(-lo // 4096), (lo + n) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((end - first) * 8), dtype=np.uint64)
    return int((entries >> np.uint64(63)).sum())


@pytest.mark.parametrize("hooked", [False, True], ids=["layer-call", "op-by-op"])
def test_a_prompt_pass_leaves_each_conv_state_its_own_rows(hooked: bool) -> None:
    """A pass leaves a GDN layer's conv state as the last K−1 rows of its input window [K−1+n, C]; as a view it kept
    all n rows alive (a 256-token chunk of a 9B model: 8 MiB per layer, through the rest of the prompt)."""
    eng = load(fixture_path(KQUANT_MOE), EngineConfig(n_ctx=256))
    r, cache = eng.runner, eng.cache
    hook = (lambda name, il, t: None) if hooked else None  # a hook runs the layers op by op
    r.forward(list(range(3, 103)), cache, hook=hook)
    assert all((f is not None) == r.sequential_prefill for f in r.fused)  # the layer-call case had them to call
    for il, st in cache.gdn.items():
        held, own = st.conv.untyped_storage().nbytes(), st.conv.nbytes
        assert held == own, (il, held, own)


@linux
def test_loading_leaves_no_page_of_the_file_mapped() -> None:
    """Opening reads the header and samples both ends of every tensor; building copies the vectors into floats. Once
    the model is built none of those pages is read there again: they are dropped (the page cache keeps them)."""
    mf = open_model(fixture_path(KQUANT_MOE))
    assert _mapped_pages(mf.gguf.data) > 0
    load(mf, EngineConfig(n_ctx=128))
    assert _mapped_pages(mf.gguf.data) == 0


@linux
def test_a_prompts_lookups_map_no_page_of_the_embedding_table() -> None:
    """A prompt's rows, the trunk's and the MTP head's catch-up's, are read from the file: read through the mapping,
    each left the folio around it mapped (2 MiB where the page cache holds the file in huge pages). Only lookups here:
    a product reading a neighbouring tensor in place may map the table's last pages along with its own."""
    m = load(fixture_path(KQUANT_MOE), EngineConfig(n_ctx=512)).model
    prompt = torch.arange(3, 300)
    m.embed(prompt)
    m.mtp.normed_embeddings(prompt)
    assert _mapped_pages(m.tok_embd.raw) == 0


@pytest.mark.skipif(not hasattr(os, "preadv"), reason="no preadv here: rows are read through the mapping")
def test_rows_read_from_the_file_are_the_mapped_rows() -> None:
    mf = open_model(fixture_path(KQUANT_MOE))
    table = mf.tensor("token_embd.weight").raw
    rows = [5, 0, 383, 5, 17]
    assert torch.equal(read_rows(table, rows), table[rows])
    assert read_rows(table.clone(), rows) is None  # the process's own memory: nothing to read from a file
    with pytest.raises(IndexError):
        read_rows(table, [384])


def test_packed_weights_are_allocated_in_transparent_huge_pages() -> None:
    """pages.huge_empty: 2 MiB-aligned, and where the kernel takes madvise(MADV_HUGEPAGE) the touched bytes are backed
    by huge pages (what the packed weights use: fewer TLB walks, prefetchers not stopped every 4 KiB)."""
    from engine.storage.pages import HUGE, huge_empty

    small = huge_empty(1000)
    assert small.numel() == 1000
    t = huge_empty(3 * HUGE + 123)
    assert t.numel() == 3 * HUGE + 123 and t.data_ptr() % HUGE == 0
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if os.path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    if "[never]" in mode:
        return  # the system gives no huge pages to anyone: the tensor is still a plain, usable one
    t.fill_(1)
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel()
    huge_kb, start = 0, None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            a, b = (int(x, 16) for x in head.split("-"))
            start = a if a < hi and b > lo else None
        elif start is not None and line.startswith("AnonHugePages:"):
            huge_kb += int(line.split()[1])
    assert huge_kb >= 2 * HUGE // 1024  # at least two of its three whole huge pages (compaction may miss one)
