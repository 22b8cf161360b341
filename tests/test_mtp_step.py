"""The MTP head's pass in one native call (layer.c mtp_layers, HeadRunner.step): its input rows made from the
tokens' embeddings and the hidden rows, its layer and the shared head norm give the bits of the head's op-by-op pass
(MTPHead.forward), for a verify's kept rows and for chained one-row drafts, and leave the head's cache as it does."""
from __future__ import annotations

import torch

from engine.generate import load


def test_the_head_s_pass_in_one_call_gives_the_op_by_op_bits() -> None:
    eng = load(None)
    hr = eng.runner.mtp
    assert hr is not None and hr.step is not None, "the embedded model's MTP head should run in one call"
    head = hr.head
    ids = eng.encode_prompt("And God said, Let there be light")
    cache = eng.runner.new_cache(128)
    hidden = eng.runner.forward(ids, cache, logit_rows="all").hidden
    one, ops_ = hr.new_cache(128), hr.new_cache(128)
    n = len(ids) - 1
    for rows in (slice(0, 1), slice(1, 4), slice(4, n)):  # a row, a verify's few, the rest of the prompt
        got = hr.forward(ids[rows.start + 1:rows.stop + 1], hidden[rows], one, logit_rows="all")
        want = head.forward(ids[rows.start + 1:rows.stop + 1], hidden[rows], ops_, logit_rows="all")
        assert torch.equal(got.hidden, want.hidden) and torch.equal(got.logits, want.logits), rows
        assert one.pos == ops_.pos == rows.stop
    h_got, h_want, tok = got.hidden[-1:], want.hidden[-1:], int(got.logits[-1].argmax())
    for _ in range(4):  # chained drafts: each row from the head's own output
        got = hr.forward([tok], h_got, one, logit_rows="draft")
        want = head.forward([tok], h_want, ops_, logit_rows="draft")
        assert torch.equal(got.hidden, want.hidden) and torch.equal(got.logits, want.logits)
        h_got, h_want, tok = got.hidden[-1:], want.hidden[-1:], int(got.logits[-1].argmax())


def test_rows_no_one_reads_leave_only_their_keys_and_values() -> None:
    """A catch-up's rows ("none") and the rows before a draft's ("last", "draft") are computed only as far as the
    cache needs them: the head's cache holds the keys and values the whole pass writes, and the rows asked for carry
    the whole pass's bits (its last hidden row and logits)."""
    eng = load(None)
    hr = eng.runner.mtp
    assert hr is not None and hr.step is not None
    ids = eng.encode_prompt("And God said, Let there be light: and there was light")
    cache = eng.runner.new_cache(128)
    hidden = eng.runner.forward(ids, cache, logit_rows="all").hidden
    n = len(ids) - 1
    whole, part = hr.new_cache(128), hr.new_cache(128)
    for rows, asked in ((slice(0, 5), "none"), (slice(5, 9), "draft"), (slice(9, 12), "last"), (slice(12, n), "none")):
        want = hr.forward(ids[rows.start + 1:rows.stop + 1], hidden[rows], whole, logit_rows="all")
        got = hr.forward(ids[rows.start + 1:rows.stop + 1], hidden[rows], part, logit_rows=asked)
        if asked == "none":
            assert got.hidden.shape[0] == 0 and got.logits is None
        else:
            assert torch.equal(got.hidden, want.hidden[-1:])
            assert torch.equal(got.logits, want.logits[-1:])  # a head this small has no sketch: its whole product
        assert part.pos == whole.pos == rows.stop
        for il, kv in whole.kv.items():
            assert torch.equal(part.kv[il].k[:rows.stop], kv.k[:rows.stop])
            assert torch.equal(part.kv[il].v[:rows.stop], kv.v[:rows.stop])
