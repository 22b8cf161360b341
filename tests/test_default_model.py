"""The embedded default model (resources/models/): it loads from the default path, llama.cpp reads it the
same way we do (tokenizer, trunk logits, MTP head), and greedy MTP on it is token-identical to plain
decoding — on real text, where drafts are mostly accepted, not only on random fixtures.

The model's quality and speed figures come from bench/default_model_eval.py and bench/mtp.py (committed
JSON under bench/results/), not from here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.chat import Message
from engine.events import Done, EngineConfig, GenerationConfig, Stats, Token
from engine.generate import load
from engine.storage.modelfile import default_model_path, open_model
from engine.training.data import eval_prompts, heldout_corpus
from tests.oracle_llama import llama_greedy, llama_logits, llama_mtp, llama_tokenize
from tests.test_parity import NEAR_TIE, kl_ref_ours


@pytest.fixture(scope="module")
def eng():
    return load(None, EngineConfig(n_ctx=2048))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    docs = heldout_corpus(n_dialogues=4, max_bible_chars=3000, max_doc_chars=3000)
    return [next(t for s, t in docs if s == src) for src in ("dialogue", "bible", "stdlib")]


def test_embedded_model_is_the_default(eng) -> None:
    path = default_model_path()
    assert path.parent.name == "models" and path.stat().st_size <= 40 * 2**20
    mf = open_model(path)
    assert mf.arch == "qwen35moe" and mf.hparams.has_mtp and mf.get("tokenizer.ggml.pre") == "qwen35"
    assert eng.mf.path == path and eng.drafter is not None
    types = {t.qtype.name for t in mf.tensors.values()}
    assert types <= {"Q8_0", "F16", "F32"}


def test_tokenizer_matches_llama_cpp(eng, texts) -> None:
    for text in texts:
        assert eng.tokenizer.encode(text, special=True, add_bos=False) == llama_tokenize(default_model_path(), text, True)


def test_logits_match_llama_cpp(eng, texts) -> None:
    refs, ours = [], []
    for text in texts:
        toks = eng.tokenizer.encode(text, special=True, add_bos=False)[:384]
        ref = llama_logits(default_model_path(), toks)
        m = eng.runner
        got = m.forward(toks, m.new_cache(512), logit_rows="all", chunked=True).logits.numpy()
        kl = kl_ref_ours(ref, got)
        near = ref[np.arange(len(ref)), got.argmax(-1)] >= ref.max(-1) - NEAR_TIE * ref.std()
        assert kl < 0.01 and near.mean() >= 0.99, (kl, float(near.mean()))
        refs.append(ref.argmax(-1))
        ours.append(got.argmax(-1))
    # Raw argmax agreement over all positions (203): the integer Q8_0 path flips one llama.cpp near-tie
    # (top-2 gap 0.011 σ) in the 97-position text, so per text the spec §8 near-tie rule applies above.
    agree = float((np.concatenate(refs) == np.concatenate(ours)).mean())
    assert agree >= 0.99, agree


def test_mtp_head_matches_llama_cpp(eng, texts) -> None:
    refs, ours = [], []
    m = eng.runner
    for text in texts:
        toks = eng.tokenizer.encode(text, special=True, add_bos=False)[:200]
        refs.append(llama_mtp(default_model_path(), toks).mtp_logits)
        hidden = m.forward(toks, m.new_cache(512), logit_rows="none").hidden
        h_in = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
        ours.append(m.mtp.forward(toks, h_in, m.mtp.new_cache(512), logit_rows="all").logits.numpy())
    ref, got = np.concatenate(refs), np.concatenate(ours)
    kl = kl_ref_ours(ref, got)
    agree = float((ref.argmax(-1) == got.argmax(-1)).mean())
    # The head reads the trunk's hidden state, which carries llama.cpp's 8-bit activation rounding; its
    # rare disagreements are llama.cpp near-ties (measured: top-2 gaps of 0.002 = 0.001 σ), so the spec §8
    # near-tie rule applies on top of the raw floor.
    near = ref[np.arange(len(ref)), got.argmax(-1)] >= ref.max(-1) - NEAR_TIE * ref.std()
    assert kl < 0.01 and near.mean() >= 0.99 and agree >= 0.98, (kl, float(near.mean()), agree)


def test_greedy_reply_matches_llama_cpp(eng) -> None:
    item = eval_prompts(240)[0]
    prompt = eng.encode_prompt([Message(m.role, m.content) for m in item.messages])
    ref, rows = llama_greedy(default_model_path(), prompt, 24)
    eng.reset()
    ours = [i for ev in eng.generate(prompt, GenerationConfig(max_tokens=24, mtp=False)) if isinstance(ev, Token)
            for i in ev.ids]
    eos = eng.tokenizer.eog_ids
    ref = ref[:next((j for j, t in enumerate(ref) if t in eos), len(ref))]
    for j, (a, b) in enumerate(zip(ref, ours)):
        if a != b:  # allowed only at a llama.cpp near-tie (1e-3 in logits)
            top2 = np.sort(rows[j])[-2:]
            assert top2[1] - top2[0] < 1e-3, j
            return
    assert ours == ref


def _run(eng, prompt, **kw):  # type: ignore[no-untyped-def]
    toks, final, done = [], None, None
    for ev in eng.generate(prompt, GenerationConfig(**kw)):
        if isinstance(ev, Token):
            toks += ev.ids
        elif isinstance(ev, Stats) and ev.final:
            final = ev
        elif isinstance(ev, Done):
            done = ev
    return toks, final, done


@pytest.mark.parametrize("draft", [1, 2, 3, 4, None], ids=["k1", "k2", "k3", "k4", "auto"])
def test_greedy_mtp_is_token_identical_on_512_tokens(eng, texts, draft: int | None) -> None:
    prompt = eng.tokenizer.encode(texts[1][:400], add_bos=False)
    saved = eng.tokenizer.eog_ids
    eng.tokenizer.eog_ids = frozenset()  # a 512-token continuation, whatever the model would stop at
    try:
        eng.reset()
        plain, _, _ = _run(eng, prompt, max_tokens=512, mtp=False)
        eng.reset()
        spec, final, done = _run(eng, prompt, max_tokens=512, mtp=True, draft=draft)
    finally:
        eng.tokenizer.eog_ids = saved
    assert spec == plain and len(spec) == 512 and done.reason == "max_tokens"
    assert final.speculative.accepted > 0  # drafts really were accepted on this model


@pytest.mark.parametrize("draft", [1, 3, None], ids=["k1", "k3", "auto"])
def test_multi_turn_chat_with_mtp_equals_plain(draft: int | None) -> None:
    a, b = load(None, EngineConfig(n_ctx=2048)), load(None, EngineConfig(n_ctx=2048))
    conv = [Message("system", "You are a helpful assistant."), Message("user", "Hi!")]
    follow = ["What is 12 plus 30?", "Count from 3 to 9.", "What does `json.dumps` do?", "How many days are in 2 weeks?"]
    for q in follow:
        ta, fa, _ = _run(a, conv, max_tokens=64, mtp=True, draft=draft)
        tb, _, _ = _run(b, conv, max_tokens=64, mtp=False)
        assert ta == tb, conv[-1].content
        assert fa.prefill_tokens < fa.prompt_tokens or len(conv) == 2  # later turns reuse the cache
        conv = conv + [Message("assistant", a.tokenizer.decode(ta, skip_special=True)), Message("user", q)]
