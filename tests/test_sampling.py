from __future__ import annotations

import pytest
import torch

from bench.sampling import whole_row_probs
from engine.errors import NonFiniteLogitsError
from engine.sampling import NUCLEUS_FIRST, Sampler, SamplingConfig, apply_repetition_penalty, candidates, probs


def test_greedy_and_temperature() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert Sampler(SamplingConfig()).sample(logits, []) == 1
    p = probs(logits, SamplingConfig(temperature=0.5))
    assert torch.allclose(p, torch.softmax(logits / 0.5, 0))


def test_greedy_picks_torch_argmax_on_every_kind_of_row() -> None:
    """Greedy sampling of a CPU float32 row takes numpy's argmax (less dispatch on a cold decode step): the index
    torch.argmax gives, the first maximum on a tie; other rows (a view of a wider tensor, half precision, a row that
    needs grad) give the same. A row whose maximum is not finite (a NaN, which both argmaxes take as the maximum,
    or nothing but -inf) names no token on either path: NonFiniteLogitsError (issue 48: a damaged file answered
    token 0)."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(32768, generator=g) for _ in range(20)]
    tie = torch.zeros(10)
    tie[[3, 7]] = 5.0
    rows += [tie, torch.randn(4, 100, generator=g)[2], torch.randn(100, generator=g).half(),
             torch.randn(100, generator=g, requires_grad=True)]
    greedy = Sampler(SamplingConfig())
    for r in rows:
        assert greedy.sample(r, []) == int(torch.argmax(r))
    assert greedy.sample(tie, []) == 3
    nan = torch.arange(10, dtype=torch.float32)
    nan[[4, 6]] = float("nan")
    for bad in (nan, nan.half(), torch.full((5,), float("-inf")), nan.clone().requires_grad_()):
        with pytest.raises(NonFiniteLogitsError):
            greedy.sample(bad, [])


def test_top_k_top_p_min_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    # top-p 0.8: smallest prefix with mass ≥ 0.8 is {0.5, 0.2, 0.15}
    p = probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    # min-p 0.3: keep p ≥ 0.3 · 0.5 = 0.15
    p = probs(logits, SamplingConfig(temperature=1.0, min_p=0.3))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)


@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05), SamplingConfig(temperature=0.7, top_p=0.8),
    SamplingConfig(temperature=1.3, top_p=0.99), SamplingConfig(temperature=0.6, min_p=0.1),
    SamplingConfig(temperature=0.9), SamplingConfig(temperature=1.0, top_k=20, top_p=0.5),
], ids=lambda c: f"t{c.temperature}-k{c.top_k}-p{c.top_p}-m{c.min_p}")
def test_candidates_are_the_whole_row_distribution(cfg: SamplingConfig) -> None:
    """Only the candidates are sorted and drawn from (a 248k row's sort took ~17 ms): over a 248k-token row, peaked and
    flat (the flat one's nucleus far past the first NUCLEUS_FIRST tokens looked at), they carry the distribution of
    the whole row's definition: the same tokens, the same probabilities to float rounding, most likely first."""
    g = torch.Generator().manual_seed(5)
    for scale in (4.0, 0.05):
        logits = torch.randn(248320, generator=g) * scale
        want = whole_row_probs(logits, cfg)
        ids, p = candidates(logits, cfg)
        assert set(ids.tolist()) == set(torch.nonzero(want).reshape(-1).tolist()), scale
        assert torch.allclose(p, want[ids], rtol=1e-4, atol=1e-9) and float(p.sum()) == pytest.approx(1.0, abs=1e-5)
        if cfg.top_k or cfg.top_p < 1.0 or cfg.min_p > 0:
            assert bool((p[:-1] >= p[1:]).all())
        assert torch.allclose(probs(logits, cfg), want, rtol=1e-4, atol=1e-9)
        if scale < 1 and cfg.top_p < 0.9 and not cfg.top_k:
            assert ids.numel() > NUCLEUS_FIRST  # the search went past its first look
    ties = torch.zeros(100)
    ties[:3] = 2.0  # top-2 over three tied leaders keeps two of them, as llama.cpp's top-k does
    ids, p = candidates(ties, SamplingConfig(temperature=1.0, top_k=2))
    assert set(ids.tolist()) < {0, 1, 2} and ids.numel() == 2 and torch.equal(p, torch.tensor([0.5, 0.5]))


def test_a_sampled_token_follows_the_candidates_distribution() -> None:
    """Sampler.sample draws among the candidates (and Sampler.draw among a distribution's nonzero entries): over a
    large vocabulary, each token's frequency is its probability."""
    logits = torch.full((200000,), -30.0)
    logits[[7, 90000, 199999]] = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    s = Sampler(SamplingConfig(temperature=1.0, top_k=50, seed=11))
    got = torch.tensor([s.sample(logits, []) for _ in range(4000)])
    assert set(got.tolist()) <= {7, 90000, 199999}
    freq = torch.tensor([(got == t).float().mean() for t in (7, 90000, 199999)])
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)
    p = probs(logits, SamplingConfig(temperature=1.0, top_k=3))
    drawn = torch.tensor([s.draw(p) for _ in range(4000)])
    assert torch.allclose(torch.tensor([(drawn == t).float().mean() for t in (7, 90000, 199999)]),
                          torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


def test_repetition_penalty() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, [0, 1, 1], SamplingConfig(repeat_penalty=2.0))
    assert torch.equal(out, torch.tensor([1.0, -4.0, 1.0]))
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 1.0]))  # not modified in place


def test_seeded_sampling_is_reproducible_and_matches_distribution() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))
    cfg = SamplingConfig(temperature=1.0, seed=123)
    a = [Sampler(cfg).sample(logits, []) for _ in range(3)]
    s1, s2 = Sampler(cfg), Sampler(cfg)
    seq1 = [s1.sample(logits, []) for _ in range(50)]
    seq2 = [s2.sample(logits, []) for _ in range(50)]
    assert seq1 == seq2 and len(set(a)) == 1
    s = Sampler(SamplingConfig(temperature=1.0, seed=7))
    counts = torch.bincount(torch.tensor([s.sample(logits, []) for _ in range(6000)]), minlength=3).float() / 6000
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1]), atol=0.025)


def test_invalid_settings() -> None:
    for bad in (SamplingConfig(temperature=-1), SamplingConfig(top_p=0), SamplingConfig(min_p=2),
                SamplingConfig(repeat_penalty=0)):
        with pytest.raises(ValueError):
            Sampler(bad)
