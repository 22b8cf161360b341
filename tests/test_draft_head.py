"""Draft logits from the head's 2-bit sketch (engine/ops/draft_head.py, engine/native/sketch.c): every form of the
sketch's product gives the portable form's bits, the logits decide a draft as the real head does (its argmax, and
its exact values on the candidates), small heads and memory-tight backends keep the head's own product, and greedy
output with MTP drafting through a sketch is the output without MTP."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from bench.mtp_agreement import random_prompts
from bench.synthetic import TINY_MTP, noise_for, write_synthetic
from engine import ops
from engine.events import EngineConfig
from engine.generate import load
from engine.ops import draft_head, native
from engine.sampling import SamplingConfig
from engine.storage.qtensor import QTensor
from engine.storage.quantize import random_blocks
from tests.conftest import backend_params
from tests.generation import plain_then_mtp

NATIVE = backend_params(native_only=True)
WIDE = (32768, 1024)  # a 32k-row Q6_K head: 27.5 MB, over SKETCH_MIN_BYTES


@pytest.fixture(autouse=True)
def _built() -> None:
    assert native.available(), "the native library was not built (pip install -e . builds it)"


@pytest.fixture(scope="module")
def wide_head() -> QTensor:
    """Random valid Q6_K blocks: rows of random values, whose logits crowd at the top as a trained head's do not."""
    raw = random_blocks(WIDE, T.Q6_K, np.random.default_rng(3), 1 / np.sqrt(WIDE[1]))
    return QTensor(torch.from_numpy(raw), T.Q6_K, WIDE)


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, WIDE[1], generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", NATIVE)
def test_every_form_of_the_sketch_product_gives_the_portable_bits(wide_head: QTensor, backend: ops.Backend) -> None:
    sketch = draft_head.sketch_of(ops.bind(wide_head, backend))
    assert sketch is not None
    for x in _rows(3, 1):
        x[:128] = 0.0  # a block of zeros beside ordinary ones
        portable = native.sketch_scores(sketch.codes, sketch.scales, x, 1, ops.backend_named("native-portable").level)
        assert torch.equal(native.sketch_scores(sketch.codes, sketch.scales, x, 2, backend.level), portable)


@pytest.mark.parametrize("k", [1024, 384], ids=["even-blocks", "odd-blocks"])
def test_the_sketch_product_is_the_sketch_values_times_the_quantized_row(k: int) -> None:
    """The portable form against float64 arithmetic on the sketch's values ((2c − 3)·s, code pair s of byte j being
    value 32s + j of its block) and the row as the product quantizes it (int8, one scale); every form gives its bits.
    An odd number of blocks too (the 512-bit form takes two blocks at a time)."""
    n, block = 300, native.SKETCH_BLOCK
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7))
    codes, scales = torch.empty(n, k // 4, dtype=torch.uint8), torch.empty(n, k // block)
    native.sketch_make(w, 0, k, codes, scales, 2)
    c = codes.reshape(n, k // block, 1, block // 4).long()
    c = torch.cat([(c >> (2 * s)) & 3 for s in range(4)], dim=2).reshape(n, k // block, block)
    values = ((2 * c - 3) * scales.unsqueeze(-1)).reshape(n, k).double()
    for x in _rows(3, 9)[:, :k]:
        amax = float(x.abs().max())
        xq = torch.round(x * (127.0 / amax)).double() * (amax / 127.0)
        portable = native.sketch_scores(codes, scales, x.contiguous(), 1, ops.backend_named("native-portable").level)
        assert torch.allclose(portable.double(), values @ xq, rtol=1e-5, atol=1e-4 * float((values @ xq).abs().max()))
        for b in NATIVE:
            assert torch.equal(native.sketch_scores(codes, scales, x.contiguous(), 2, b.values[0].level), portable)


@pytest.mark.parametrize("rows", [WIDE[0], WIDE[0] - 5], ids=["whole-groups", "partial-group"])
@pytest.mark.parametrize("backend", NATIVE)
def test_draft_logits_decide_a_draft_as_the_head_does(wide_head: QTensor, backend: ops.Backend, rows: int) -> None:
    """The real head's argmax, and its bits on the candidates' rows; estimates elsewhere that track the logits. A head
    whose rows are not whole groups of 16 (packed: its last group padded with zero rows) too."""
    w = wide_head if rows == WIDE[0] else QTensor(wide_head.raw[:rows].clone(), T.Q6_K, (rows, WIDE[1]))
    head = ops.bind(w, backend)
    for x in _rows(24, 2):
        full = ops.linear(x.unsqueeze(0), head)[0]
        draft = ops.draft_logits(x.unsqueeze(0), head)[0]
        best = int(full.argmax())
        assert int(draft.argmax()) == best
        assert torch.equal(draft[best], full[best])
        assert torch.corrcoef(torch.stack([draft, full]))[0, 1] > 0.9  # the tail a draft's confidence sums
    assert ops.draft_read_bytes(head) < 0.45 * head.nbytes


@pytest.mark.parametrize("rows", [WIDE[0], WIDE[0] - 5], ids=["whole-groups", "partial-group"])
def test_draft_logits_are_the_sketch_scores_with_the_best_groups_exact(wide_head: QTensor, rows: int) -> None:
    """sketch.c's one call: the sketch's score on every row, the head's own product's bits on every row of a group
    holding one of the `candidates` best scores (torch.topk's over the scores; ties at the cut by lower row), and
    nothing else exact. Also a row of zeros (every score tied) and a row holding a NaN."""
    native_backend = next(b for b in ops.available_backends() if b.native)
    w = wide_head if rows == WIDE[0] else QTensor(wide_head.raw[:rows].clone(), T.Q6_K, (rows, WIDE[1]))
    head = ops.bind(w, native_backend)
    sketch = draft_head.sketch_of(head)
    assert sketch is not None
    unit, m = sketch.groups.n_rows, draft_head.candidates(rows)
    xs = _rows(6, 5)
    xs[1] = 0.0
    for i, x in enumerate(xs):
        draft = ops.draft_logits(x.unsqueeze(0), head)[0]
        full = ops.linear(x.unsqueeze(0), head)[0]
        scores = native.sketch_scores(sketch.codes, sketch.scales, x, 1, native_backend.level)
        best = torch.arange(m) if i == 1 else torch.topk(scores, m).indices
        exact = torch.zeros(rows, dtype=torch.bool)
        for g in torch.unique(best // unit).tolist():
            exact[g * unit:(g + 1) * unit] = True
        assert torch.equal(draft[exact], full[exact])
        assert torch.equal(draft[~exact], scores[~exact])
    x = xs[0].clone()
    x[7] = float("nan")
    assert ops.draft_logits(x.unsqueeze(0), head).shape == (1, rows)


def test_small_heads_multi_row_passes_and_no_copies_use_the_heads_own_product(wide_head: QTensor) -> None:
    native_backend = next(b for b in ops.available_backends() if b.native)
    small = QTensor(wide_head.raw[:1024], T.Q6_K, (1024, WIDE[1]))
    x = _rows(2, 4)
    for head, rows in ((ops.bind(small, native_backend), x[:1]),  # below SKETCH_MIN_BYTES
                       (ops.bind(wide_head, native_backend), x),  # two rows: a verify's, not a draft's
                       (ops.bind(wide_head, replace(native_backend, copies=False)), x[:1])):  # no derived copies
        assert torch.equal(ops.draft_logits(rows, head), ops.linear(rows, head))
    assert ops.draft_read_bytes(ops.bind(small, native_backend)) == small.nbytes


def test_greedy_output_with_drafts_from_a_sketch_is_plain_greedy_output(tmp_path: Path) -> None:
    shape = replace(TINY_MTP, n_vocab=32768)  # a head over SKETCH_MIN_BYTES
    path = write_synthetic(tmp_path / "wide.gguf", shape, agreement=noise_for("tiny-mtp", 0.95))
    eng = load(path, EngineConfig(n_ctx=160, n_threads=2))
    head = eng.runner.mtp.head.head
    assert ops.draft_read_bytes(head) < head.nbytes / 2, "the drafts here do not read a sketch"
    sketch = draft_head.sketch_of(head)  # what engine.memory counted for it
    assert sketch is not None and sketch.codes.nbytes + sketch.scales.nbytes == \
        ops.sketch_bytes(head.n_rows, head.weight.n_cols, head.nbytes)
    eng.tokenizer.eog_ids = frozenset()
    kw = dict(max_tokens=48, sampling=SamplingConfig(temperature=0.0, top_k=1))
    for prompt in random_prompts(2):
        plain, toks, _, final = plain_then_mtp(eng, prompt, 3, **kw)
        assert toks == plain
        assert final.speculative.acceptance > 0.5, final.speculative  # the drafts are the head's, mostly right
