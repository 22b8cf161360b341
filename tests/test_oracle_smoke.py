"""Smoke tests of the llama.cpp oracle harness (tests/oracle_llama.py) on our own fixtures.

llama.cpp must load TINY_MOE (F32) and KQUANT_MOE (Q4_K + Q6_K head) as written by engine/writer.py and
give finite logits of the right shape that are causal, its tokenizer must round-trip ASCII text through
the GGUF vocabulary, and the MTP head must be reachable. Each check has a negative control where a
broken input must be rejected, so none of them can pass vacuously.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from tests.fixtures import KQUANT_MOE, TINY_MOE, fixture_path
from tests.oracle_llama import (
    LlamaOracleError, llama_detokenize, llama_greedy, llama_logits, llama_mtp, llama_mtp_rows, llama_tokenize,
)

N = 48
SPECS = {"tiny_moe_f32": TINY_MOE, "kquant_moe": KQUANT_MOE}
# Prefix run vs full run: F32 differs only by float32 rounding (≤ 1e-5 measured). With quantized
# weights llama.cpp's results depend on the batch length at the 1e-6 level, and on KQUANT_MOE that can
# flip a near-tied top-k routing, which moves later logits by up to ≈ 0.25 (logit std ≈ 4). A future-token
# leak moves them by O(std).
PREFIX_ATOL = {"tiny_moe_f32": 1e-4, "kquant_moe": 1.0}
# Same length, later tokens changed: F32 rows before the change come out bit for bit the same; with
# quantized experts the per-expert row grouping changes with the routing of the new tokens (1e-6 level,
# same near-tie caveat as above).
SUFFIX_ATOL = {"tiny_moe_f32": 0.0, "kquant_moe": 1.0}


@pytest.fixture(scope="module", params=list(SPECS))
def model(request):
    path = fixture_path(SPECS[request.param])
    tokens = np.random.default_rng(7).integers(0, 380, N).tolist()
    return request.param, path, tokens, llama_logits(path, tokens)


def _n_vocab(path) -> int:
    return len(GGUFReader(path).fields["tokenizer.ggml.tokens"].contents())


def test_shape_and_finite(model):
    _, path, tokens, logits = model
    assert logits.dtype == np.float32
    assert logits.shape == (len(tokens), _n_vocab(path))
    assert np.isfinite(logits).all()
    assert logits.std() > 1.0  # real, separated logits (fixture logit scale ≈ 4), not zeros
    assert not np.allclose(logits[0], logits[1])  # every row is its own position


def test_deterministic(model):
    _, path, tokens, logits = model
    assert np.array_equal(llama_logits(path, tokens), logits)


def test_changed_suffix_leaves_earlier_rows_unchanged(model):
    """Same batch length, tokens from k on replaced: rows < k unchanged, rows ≥ k changed."""
    name, path, tokens, logits = model
    for k in (1, 17, N - 1):
        alt = tokens[:k] + [(t + 1) % 380 for t in tokens[k:]]
        other = llama_logits(path, alt)
        d = float(np.abs(other[:k] - logits[:k]).max())
        assert d <= SUFFIX_ATOL[name], f"rows before {k} depend on later tokens (max |Δ| {d})"
        assert np.abs(other[k] - logits[k]).max() > 1.0, f"row {k} ignores its own token"


def _max_prefix_diff(full: np.ndarray, prefix: np.ndarray) -> float:
    return float(np.abs(prefix - full[: len(prefix)]).max())


def test_prefix_run_matches_full_run(model):
    name, path, tokens, logits = model
    for n in (1, 5, 20, 33):
        d = _max_prefix_diff(logits, llama_logits(path, tokens[:n]))
        assert d <= PREFIX_ATOL[name], f"prefix of {n}: max |Δ| {d}"
    # negative control: a run whose rows are shifted by one position (a one-token look-ahead) fails
    leaky = np.concatenate([logits[1:], logits[-1:]])
    assert _max_prefix_diff(leaky, llama_logits(path, tokens[:20])) > PREFIX_ATOL[name]


def test_greedy_is_argmax_of_batch_logits(model):
    _, path, tokens, _ = model
    prompt = tokens[:8]
    out, rows = llama_greedy(path, prompt, 6)
    assert len(out) == 6 and rows.shape == (6, _n_vocab(path))
    assert out == [int(np.argmax(r)) for r in rows]
    full = llama_logits(path, prompt + out)
    assert (full[len(prompt) - 1: -1].argmax(axis=1) == np.array(out)).all()


def _bytes_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decode_via_vocab(path, ids: list[int]) -> bytes:
    vocab = GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    dec = _bytes_decoder()
    return bytes(dec[ch] for i in ids for ch in vocab[i])


TEXTS = ["Hello! How are you? I'm fine, thanks. 12 + 30 = 42. The year is 2026.",
         "def f(x):\n    return x  # tabs\tand  spaces, UPPER lower 0123456789 ~!@#$%^&*()"]


@pytest.mark.parametrize("spec", list(SPECS))
def test_tokenize_ascii_round_trips_through_vocab(spec):
    path = fixture_path(SPECS[spec])
    n_vocab = _n_vocab(path)
    for text in TEXTS:
        ids = llama_tokenize(path, text, special=False)
        assert ids and all(0 <= i < n_vocab for i in ids)
        assert len(ids) < len(text)  # merges were applied
        assert _decode_via_vocab(path, ids) == text.encode()
        assert llama_detokenize(path, ids) == text.encode()
    # specials: parsed as one token only when asked to
    vocab = GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    im_start = vocab.index("<|im_start|>")
    assert llama_tokenize(path, "<|im_start|>user", special=True)[0] == im_start
    assert im_start not in llama_tokenize(path, "<|im_start|>user", special=False)
    # negative control: decoding a different id sequence must not give the text back
    ids = llama_tokenize(path, TEXTS[0], special=False)
    assert _decode_via_vocab(path, ids[1:] + ids[:1]) != TEXTS[0].encode()


def test_bad_token_raises():
    path = fixture_path(TINY_MOE)
    with pytest.raises(LlamaOracleError):
        llama_logits(path, [1, 2, 10_000])


def test_mtp_head_reachable():
    """The MTP head (LLAMA_CONTEXT_TYPE_MTP context) gives finite, causal logits that use both inputs."""
    path = fixture_path(TINY_MOE)
    tokens = np.random.default_rng(3).integers(0, 380, 12).tolist()
    run = llama_mtp(path, tokens)
    V = _n_vocab(path)
    assert run.logits.shape == run.mtp_logits.shape == (12, V)
    assert run.hidden.shape == run.mtp_hidden.shape == (12, 64)
    assert np.isfinite(run.mtp_logits).all() and np.isfinite(run.hidden).all()
    assert np.array_equal(run.logits, llama_logits(path, tokens))  # nextn output does not disturb the trunk
    h_in = np.concatenate([np.zeros_like(run.hidden[:1]), run.hidden[:-1]])
    # causal over the MTP's own cache: a prefix of rows gives the same rows
    first, _ = llama_mtp_rows(path, tokens[:5], h_in[:5])
    assert np.abs(first - run.mtp_logits[:5]).max() < 1e-4
    # a single (hidden, token) pair: depends on the hidden state and on the token
    a, _ = llama_mtp_rows(path, [tokens[4]], run.hidden[3:4], pos0=4)
    b, _ = llama_mtp_rows(path, [tokens[4]], run.hidden[6:7], pos0=4)
    c, _ = llama_mtp_rows(path, [tokens[5]], run.hidden[3:4], pos0=4)
    assert np.abs(a - b).max() > 1.0 and np.abs(a - c).max() > 1.0
