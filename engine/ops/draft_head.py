"""A draft pass's logits: every row of the output head estimated from a 2-bit sketch, the best candidates exact.

A draft only proposes; the verify decides what is kept. So a draft's logits need to be right only where they decide
the draft: its top tokens. The head's product was half of a draft's cost on the mid MoE fixture and most of it with
Qwen3.5/3.6's 248k vocabulary (a 0.8 GB Q6_K head on the 9B). The sketch (engine/native/sketch.c: ~2.25 bits a
value, a third of a Q6_K head's bytes) scores every row; the rows of the `candidates` best scores (with their packed
groups of 16) are multiplied by the real head and replace their estimates. A greedy draft is therefore the real
head's argmax whenever that row is among the candidates (on random Gaussian heads, where logits crowd the most, the
true best row ranked at most 54th of 32k rows and 167th of 248k in the sketch's order, over 60 rows each), and a
sampled draft draws from the q it reports, which the verify corrects by p/q as for any draft. Estimates elsewhere
keep a softmax's tail (a draft's confidence) close to the full head's.

Only for native products on the CPU over heads of SKETCH_MIN_BYTES or more, one row at a time, where the backend
allows derived copies of weights (the sketch is one: 0.3 GB for a 248k × 4096 head); anything else is the head's own
product. The sketch is made when the model loads (or on first use) from the stored rows, a chunk at a time (their
file pages dropped again, as packing does), and kept with the head's Linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops import native
from engine.ops.linear import Linear, NativeLinear, linear
from engine.storage.pages import release_pages

# Heads smaller than this run whole: the sketch and the candidates' product cost a few calls, which a small head's
# whole product does not exceed.
SKETCH_MIN_BYTES = 8 << 20
SKETCH_CHUNK_ROWS = 4096  # head rows dequantized and sketched at a time while the sketch is made


def candidates(n_rows: int) -> int:
    """How many of the sketch's best rows the real head rescores: 96 of 32k rows, 306 of 248k."""
    return min(n_rows, 64 + n_rows // 1024)


@dataclass(frozen=True)
class HeadSketch:
    codes: torch.Tensor  # uint8 [rows, k/4]
    scales: torch.Tensor  # float32 [rows, k/SKETCH_BLOCK]
    groups: native.ExpertStack  # the head's rows as the candidates' products read them: groups of GROUP packed rows
    # (a last group padded with zero rows), or single rows where the head is not packed
    held: torch.Tensor  # the bytes `groups` points at, kept alive with it


def sketch_bytes(n_rows: int, n_cols: int, head_bytes: int) -> int:
    """The memory the sketch of a head of n_rows × n_cols (head_bytes stored) takes; 0 for a head that runs whole
    (small, or rows the sketch's blocks do not divide). engine.memory counts it with the weights."""
    if head_bytes < SKETCH_MIN_BYTES or n_cols % native.SKETCH_BLOCK:
        return 0
    return n_rows * (n_cols // 4 + n_cols // native.SKETCH_BLOCK * 4)


def sketch_of(head: Linear) -> HeadSketch | None:
    """The head's sketch (made on first use and kept with it), or None where drafts use the head's own product."""
    if "sketch" in head.forms or not isinstance(head, NativeLinear):
        return head.forms.get("sketch")  # type: ignore[return-value]
    w = head.weight
    if not head.backend.copies or len(w.shape) != 2 or w.device.type != "cpu" \
            or not sketch_bytes(w.n_rows, w.n_cols, head.nbytes):
        return None
    head.kernel_bytes()  # packed now if it ever is: then the stored rows' pages are dropped again once read here
    n, k = w.n_rows, w.n_cols
    codes = torch.empty(n, k // 4, dtype=torch.uint8)
    scales = torch.empty(n, k // native.SKETCH_BLOCK)
    threads = head.backend.n_threads(n * k)
    raw = w.raw.reshape(n, -1)
    for r0 in range(0, n, SKETCH_CHUNK_ROWS):  # a chunk at a time: the stored rows' pages dropped again once read
        r1 = min(n, r0 + SKETCH_CHUNK_ROWS)
        if int(w.qtype) in native.DEQUANT_ROW_TYPES:
            native.sketch_make(raw[r0:r1].contiguous(), int(w.qtype), k, codes[r0:r1], scales[r0:r1], threads)
        else:
            rows = w.dequantize(slice(r0, r1), device=torch.device("cpu")).float().contiguous()
            native.sketch_make(rows, 0, k, codes[r0:r1], scales[r0:r1], threads)
        if head.packed is not None:
            release_pages(raw[r0:r1])
    held, code = head.kernel_bytes()
    unit = native.GROUP if head.packed is not None else 1  # packed rows are multiplied 16 at a time
    if head.packed_full is not None:  # a last group padded with zero rows: the products read it whole
        held = head.packed_full
    groups = native.expert_stack(code, held, -(-n // unit), unit, k, head.backend.n_threads(candidates(n) * unit * k))
    sketch = HeadSketch(codes, scales, groups, held)
    head.forms["sketch"] = sketch  # type: ignore[assignment]
    return sketch


def draft_read_bytes(head: Linear) -> int:
    """The head's bytes a draft reads: its sketch and the candidates' rows where it has a sketch, else all of it."""
    sketch = sketch_of(head)
    if sketch is None:
        return head.nbytes
    rescored = candidates(head.n_rows) * sketch.groups.n_rows
    return sketch.codes.nbytes + sketch.scales.nbytes + head.nbytes * rescored // head.n_rows


def prepare_draft_logits(head: Linear) -> None:
    """Make the head's sketch now, where it has one, rather than on the first draft."""
    sketch_of(head)


def draft_logits(x: torch.Tensor, head: Linear) -> torch.Tensor:
    """Logits of the one row x [1, k] for drafting: exact on the sketch's best candidates, estimated elsewhere (the
    head's own product where it has no sketch)."""
    sketch = sketch_of(head) if x.shape[0] == 1 else None
    if sketch is None:
        return linear(x, head)
    b = head.backend
    scores = native.sketch_logits(sketch.codes, sketch.scales, x.reshape(-1).float().contiguous(), sketch.groups,
                                  candidates(head.n_rows), b.n_threads(head.n_rows * head.n_cols // 8), b.level)
    return scores[:head.n_rows].unsqueeze(0)
