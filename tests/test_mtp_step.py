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
