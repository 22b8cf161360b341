"""Our trunk against the two reference implementations (issue: trunk forward matched to llama.cpp).

llama.cpp: F32 / F16 / Q8_0 / Q4_K fixtures, 512-token sequences; argmax agreement ≥ 99 %, mean
KL(llama.cpp ‖ ours) < 0.01 (< 0.02 for Q4_K), greedy continuations of 32 tokens identical except at a
llama.cpp near-tie. Our engine rounds activations as ggml's CPU matmuls do (engine.rowwise), so these
pass with a wide margin (measured KL ≤ 1.3e-3); the negative control shows the same metric flags a
real bug. HF transformers: F32 tiny models converted by our test code, max |Δlogit| < 1e-3.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.storage.modelfile import open_model
from engine import ops
from engine.models.build import load_model
from engine.models.qwen35 import MoE
from tests.fixtures import KQUANT_DENSE, KQUANT_MOE, TINY_DENSE, TINY_MOE, FixtureSpec, fixture_path
from tests.oracle_llama import llama_greedy, llama_logits

CASES = [
    (TINY_MOE, 0.01), (TINY_DENSE, 0.01), (FixtureSpec(qtype="F16"), 0.01), (FixtureSpec(qtype="Q8_0"), 0.01),
    (FixtureSpec(arch="qwen35", qtype="Q8_0"), 0.01), (KQUANT_MOE, 0.02), (KQUANT_DENSE, 0.02),
]
IDS = [f"{s.arch}-{s.qtype}" for s, _ in CASES]
NEAR_TIE = 0.05  # fraction of the logit std


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    m = a.max(-1, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))


def kl_ref_ours(ref: np.ndarray, ours: np.ndarray) -> float:
    lr, lo = _log_softmax(ref), _log_softmax(ours)
    return float((np.exp(lr) * (lr - lo)).sum(-1).mean())


def near_tie_agreement(ref: np.ndarray, ours: np.ndarray) -> float:
    """Teacher-forced top-1 by spec §8(b): the share of positions where our choice is within NEAR_TIE σ of the
    reference's best logit."""
    near = ref[np.arange(len(ref)), ours.argmax(-1)] >= ref.max(-1) - NEAR_TIE * ref.std()
    return float(near.mean())


def our_logits(spec: FixtureSpec | Path, toks: list[int], chunked: bool = True) -> np.ndarray:
    """Our logits at every position of `toks`, for a fixture spec or a GGUF file."""
    m = load_model(open_model(spec if isinstance(spec, Path) else fixture_path(spec)), n_ctx=1024)
    return m.forward(toks, m.new_cache(1024), logit_rows="all", chunked=chunked).logits.numpy()


@pytest.mark.parametrize("spec,kl_max", CASES, ids=IDS)
def test_logits_match_llama_cpp(spec: FixtureSpec, kl_max: float) -> None:
    toks = np.random.default_rng(7).integers(0, spec.n_vocab - 3, 512).tolist()
    ref = llama_logits(fixture_path(spec), toks)
    ours = our_logits(spec, toks)
    agree = float((ref.argmax(-1) == ours.argmax(-1)).mean())
    kl = kl_ref_ours(ref, ours)
    assert kl < kl_max, kl
    if spec.qtype.endswith("_K"):
        # Spec §8(b): on random K-quant fixtures even a correct engine's raw argmax agreement is
        # ~0.96-0.98 (measured here: every mismatch is a llama.cpp top-2 gap of ≤ 0.022 σ). A position
        # agrees when our choice is within 0.05 σ of llama.cpp's best; raw agreement keeps a floor.
        near = near_tie_agreement(ref, ours)
        assert near >= 0.99 and agree >= 0.95, (near, agree)
    else:
        assert agree >= 0.99, agree
    if spec.qtype == "F32":  # no activation rounding on either side: a tight check
        assert np.abs(ref - ours).max() / ref.std() < 1e-4


class _NoRenorm(MoE):
    """A planted bug: the routed experts weighted by their softmax probabilities without the top-k renormalisation."""

    def experts(self, x, idx, weights, shared_gate):  # type: ignore[no-untyped-def]
        raw = torch.gather(torch.softmax(ops.linear(x, self.w.router).float(), -1), 1, idx)
        return super().experts(x, idx, raw, shared_gate)


def test_kl_flags_a_planted_bug() -> None:
    # Negative control (spec §8): skipping the top-k renormalisation is a real bug; KL must see it. (The bug is
    # planted in the model's math, not a kernel choice: the F32 fixture's layers run op by op, MoE.math.)
    toks = np.random.default_rng(7).integers(0, TINY_MOE.n_vocab - 3, 256).tolist()
    ref = llama_logits(fixture_path(TINY_MOE), toks)
    m = load_model(open_model(fixture_path(TINY_MOE)), n_ctx=1024)
    for layer in m.model.layers:
        layer.ffn.__class__ = _NoRenorm
    ours = m.forward(toks, m.new_cache(1024), logit_rows="all", chunked=True).logits.numpy()
    assert kl_ref_ours(ref, ours) > 0.02


def _our_greedy(spec: FixtureSpec, prompt: list[int], n: int) -> list[int]:
    m = load_model(open_model(fixture_path(spec)), n_ctx=1024)
    cache = m.new_cache(1024)
    logits = m.forward(prompt, cache, logit_rows="last", chunked=True).logits[-1]
    out = []
    for _ in range(n):
        t = int(torch.argmax(logits))
        out.append(t)
        logits = m.forward([t], cache, logit_rows="last").logits[-1]
    return out


@pytest.mark.parametrize("spec", [TINY_MOE, TINY_DENSE, FixtureSpec(qtype="Q8_0"), KQUANT_MOE],
                         ids=["moe-F32", "dense-F32", "moe-Q8_0", "moe-Q4_K"])
def test_greedy_continuation_matches_llama_cpp(spec: FixtureSpec) -> None:
    prompt = np.random.default_rng(11).integers(0, spec.n_vocab - 3, 64).tolist()
    ref, rows = llama_greedy(fixture_path(spec), prompt, 32)
    ours = _our_greedy(spec, prompt, 32)
    # A tie is 1e-3 in logits, as the issue states; on K-quant fixtures llama.cpp's own rounding moves
    # logits by up to ~0.05 σ (see test_logits_match_llama_cpp), so there the spec §8 near-tie rule applies.
    tie = NEAR_TIE * float(rows.std()) if spec.qtype.endswith("_K") else 1e-3
    for j, (a, b) in enumerate(zip(ref, ours)):
        if a != b:
            top2 = np.sort(rows[j])[-2:]
            assert top2[1] - top2[0] < tie, f"diverged at {j} where llama.cpp's top-2 differ by {top2[1] - top2[0]}"
            break


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35"])
def test_logits_match_hf_transformers(arch: str, tmp_path) -> None:
    from tests.oracle_hf import build_hf_model, hf_logits, hf_to_gguf, tiny_hf_config

    model = build_hf_model(tiny_hf_config(arch), seed=5)
    path = hf_to_gguf(model, tmp_path / f"hf-{arch}.gguf")
    toks = np.random.default_rng(2).integers(0, 381, 100).tolist()
    ref = hf_logits(model, toks)
    m = load_model(open_model(path), n_ctx=256)
    for chunked in (False, True):
        ours = m.forward(toks, m.new_cache(256), logit_rows="all", chunked=chunked).logits.numpy()
        assert np.abs(ours - ref).max() < 1e-3
