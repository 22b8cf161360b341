"""The trainer runs the inference model's own layers: its float forward equals the engine's forward on the
exported GGUF, llama.cpp reads the export, and a few steps of training reduce the loss."""
from __future__ import annotations

import numpy as np
import torch

from engine.storage.modelfile import open_model
from engine.models.build import load_model
from engine.training.model import ModelParams
from engine.training.train import TrainConfig, export, hparams_for, losses, pack, train
from tests.fixtures import fixture_vocab
from tests.oracle_llama import llama_logits

TINY = TrainConfig(n_embd=64, n_layer=4, n_head=4, n_head_kv=2, head_dim=32, ssm_n_group=2, ssm_dt_rank=4,
                   ssm_d_state=16, n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32, seq_len=64, batch=4,
                   lr=3e-3, warmup=5)


def _params(seed: int = 0) -> ModelParams:
    torch.manual_seed(seed)
    p = ModelParams(hparams_for(TINY, 384), seed=seed)
    with torch.no_grad():  # spread the weights so every convention difference would show in the logits
        for name, t in p.p.items():
            if "norm" in name:
                t.add_(torch.randn_like(t) * 0.1)
        p.p["token_embd__weight"].mul_(50)
    return p


def test_training_forward_equals_engine_forward_on_the_export(tmp_path) -> None:
    params = _params()
    path = tmp_path / "t.gguf"
    export(params, fixture_vocab(384), path, "t", {}, qtype="F32")
    toks = np.random.default_rng(0).integers(0, 380, 48).tolist()
    with torch.no_grad():
        m = params.build(n_ctx=64)
        train_logits = m.forward(toks, m.new_cache(64), logit_rows="all", chunked=True).logits
    eng = load_model(open_model(path), n_ctx=64)
    infer = eng.forward(toks, eng.new_cache(64), logit_rows="all").logits
    assert (train_logits - infer).abs().max() / infer.std() < 1e-4
    ref = llama_logits(path, toks)
    assert np.abs(ref - infer.numpy()).max() / ref.std() < 1e-4


def test_losses_are_finite_and_reach_every_parameter() -> None:
    params = _params()
    seq = torch.randint(0, 380, (TINY.seq_len + 1,), generator=torch.Generator().manual_seed(1))
    ce, mtp, bal = losses(params, seq, TINY)
    assert all(torch.isfinite(t) for t in (ce, mtp, bal))
    (ce + mtp + 0.01 * bal).backward()
    missing = [n for n, p in params.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []


def test_chained_mtp_loss_adds_one_term_per_depth() -> None:
    """--mtp-chain trains depth j on the head's own depth-(j-1) output, as chained drafting feeds it."""
    from dataclasses import replace

    params = _params()
    seq = torch.randint(0, 380, (TINY.seq_len + 1,), generator=torch.Generator().manual_seed(1))
    _, d1, _ = losses(params, seq, TINY)
    _, chained, _ = losses(params, seq, replace(TINY, mtp_chain=(0.6, 0.4)))
    _, d2_only, _ = losses(params, seq, replace(TINY, mtp_chain=(1.0,)))
    d1, d2 = d1.detach(), (d2_only - d1).detach()
    assert float(d2) > 0 and float(chained.detach()) > float(d1) + 0.6 * float(d2) - 1e-4  # depth 3 adds a positive term
    chained.backward()
    assert params.tensor("blk.4.nextn.eh_proj.weight").grad.abs().sum() > 0


def test_target_weights_learn_only_assistant_replies() -> None:
    from engine.chat import ChatFormat, Message
    from engine.tokenizer import Tokenizer
    from engine.training.train import target_weights
    from tests.fixtures import TINY_MOE, fixture_path

    tok = Tokenizer.from_metadata(open_model(fixture_path(TINY_MOE)).metadata)
    chat = ChatFormat(None, tok)
    ids = chat.encode([Message("system", "Be brief."), Message("user", "Hi there"), Message("assistant", "Hello!")],
                      add_generation_prompt=False)
    im_start, im_end = (tok.encode(t, special=True)[0] for t in ("<|im_start|>", "<|im_end|>"))
    w = target_weights(ids, tok, im_start, im_end)
    learned = tok.decode([t for t, x in zip(ids, w) if x == 1.0])
    assert learned == "Hello!<|im_end|>"
    plain = tok.encode("just some text", special=False)
    assert target_weights(plain, tok, im_start, im_end) == [1.0] * len(plain)


def test_a_few_steps_learn_a_repeating_pattern() -> None:
    params = _params(seed=2)
    pattern = [5, 17, 42, 99, 7, 230, 3]
    data = pack([pattern * 40], TINY.seq_len, 0)
    hist = train(data, params, TINY, seconds=120, max_steps=40, log=lambda s: None)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"] and hist[-1]["mtp_loss"] < 0.5 * hist[0]["mtp_loss"]


def test_a_batch_of_sequences_in_one_pass_equals_separate_passes() -> None:
    """The trainer runs B sequences as one flattened pass (extra delta-rule heads, batched SDPA): each
    sequence must get exactly the logits of its own pass, and sequences must not see each other."""
    params = _params(seed=3)
    seqs = torch.randint(0, 380, (3, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        m = params.build(n_ctx=120, gdn_chunk=16, n_seq=3)
        batched = m.forward(seqs, m.new_cache(120), logit_rows="all", chunked=True).logits.view(3, 40, -1)
        for b in range(3):
            one = params.build(n_ctx=40, gdn_chunk=16)
            alone = one.forward(seqs[b], one.new_cache(40), logit_rows="all", chunked=True).logits
            assert (batched[b] - alone).abs().max() / alone.std() < 1e-4, b


def test_dense_expert_path_equals_the_grouped_path() -> None:
    """On an accelerator the trainer weights every expert's output by its (mostly zero) routing weight in
    three large products; on any device that equals the grouped per-expert path."""
    from engine.ops.experts import route
    from engine.training.layers import run_experts_dense, run_experts_float

    g = torch.Generator().manual_seed(5)
    E, d, f, n = 8, 32, 16, 20
    ew = (torch.randn(E, f, d, generator=g), torch.randn(E, f, d, generator=g), torch.randn(E, d, f, generator=g))
    x = torch.randn(n, d, generator=g)
    w, idx = route(torch.randn(n, E, generator=g), 3)
    ref = run_experts_float(x, idx, w, *ew)
    assert torch.allclose(run_experts_dense(x, idx, w, *ew), ref, rtol=1e-5, atol=1e-4)
