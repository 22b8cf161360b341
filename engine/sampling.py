"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded RNG.

`candidates()` turns one logit row into the tokens it can be sampled as and their probabilities (only those are sorted
and drawn from: a 248k vocabulary made the whole row's sort and draw ~20 ms a token); `probs()` spreads them over the
vocabulary, the distribution speculative decoding uses for the draft and the target so acceptance preserves exactly
that distribution. A `Mask` (a
constraint's matcher, engine.constrain) forbids tokens: their logits are -inf before anything else is chosen.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine import ops
from engine.errors import EngineError, NonFiniteLogitsError

NON_FINITE = "the model's logits are not finite (NaN or infinite)"


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # 1 = off
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        """InvalidParameterError (a ValueError) naming the first setting out of range."""
        from engine.validate import validate_sampling

        validate_sampling(self)


class Mask(Protocol):
    """What may come next under a constraint (engine.constrain.Matcher, LazyMatcher)."""

    free: bool  # every token allowed now (a lazy constraint over free text): no mask to apply

    def allows(self, token: int) -> bool: ...

    def bits(self) -> torch.Tensor: ...  # a bit per vocabulary id, 32 an int32 word (engine.ops.token_mask)


def apply_repetition_penalty(logits: torch.Tensor, history: Sequence[int], cfg: SamplingConfig) -> torch.Tensor:
    """llama.cpp's rule: over the last `repeat_last_n` ids, divide positive logits, multiply negative ones."""
    if cfg.repeat_penalty == 1.0 or not history:
        return logits
    recent = torch.tensor(sorted(set(history[-cfg.repeat_last_n:])), dtype=torch.long, device=logits.device)
    out = logits.clone()
    vals = out[recent]
    out[recent] = torch.where(vals > 0, vals / cfg.repeat_penalty, vals * cfg.repeat_penalty)
    return out


# top-p without top-k: the nucleus is looked for among this many of the most likely tokens first (then 8 times as many,
# and so on): sorting a whole 248k-token row took ~17 ms, drawing from it with multinomial ~4 ms
NUCLEUS_FIRST = 256
SPARSE_DRAW = 4096  # a distribution with at most this many nonzero entries is drawn from those alone


def candidates(logits: torch.Tensor, cfg: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens one (already penalised) logit row can be sampled as, and their probabilities (summing to 1): softmax
    at the temperature over the k most likely (exactly k, as llama.cpp keeps), less the tokens below min-p × the
    most likely's probability, then the smallest prefix whose mass before each token is below top-p. Most likely
    first wherever something is cut (every token, in id order, where nothing is). Only the candidates are sorted and
    drawn from, never the whole vocabulary."""
    x = logits.float() / cfg.temperature
    n = x.numel()
    if cfg.top_k and cfg.top_k < n:
        vals, ids = torch.topk(x, cfg.top_k)  # k tokens exactly, as llama.cpp's top-k keeps (a tie at the k-th cut)
        p = torch.softmax(vals, dim=-1)
    else:
        p = full = torch.softmax(x, dim=-1)
        if torch.isfinite(full[0]) and cfg.top_p < 1.0:
            p, ids = torch.topk(full, min(NUCLEUS_FIRST, n))
            while p.numel() < n and float(p.sum()) < cfg.top_p + 1e-5:  # the nucleus may reach past these
                p, ids = torch.topk(full, min(8 * p.numel(), n))
        elif torch.isfinite(full[0]) and cfg.min_p > 0:
            sel = torch.nonzero(full >= cfg.min_p * full.max()).reshape(-1)
            p, order = torch.sort(full[sel], descending=True)
            ids = sel[order]
        else:  # nothing is cut: every token, in id order
            ids = torch.arange(n, device=x.device)
    if not torch.isfinite(p[0]):  # softmax spreads a NaN or an infinity over the whole row
        raise NonFiniteLogitsError(NON_FINITE)
    keep = p.numel()
    if cfg.min_p > 0:
        keep = int((p >= cfg.min_p * p[0]).sum())  # p is sorted: the kept ones are a prefix
    if cfg.top_p < 1.0:
        before = torch.cumsum(p[:keep], 0) - p[:keep]  # mass strictly before each token: keep while < top_p
        keep = int((before < cfg.top_p).sum())
    p, ids = p[:max(keep, 1)], ids[:max(keep, 1)]
    return ids, p / p.sum()


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution over the vocabulary for one (already penalised) logit row (`candidates`, spread
    over the whole row)."""
    ids, p = candidates(logits, cfg)
    if p.numel() == logits.numel() and not (cfg.top_k or cfg.top_p < 1.0 or cfg.min_p > 0):
        return p  # nothing was cut: already the whole row, in id order
    return torch.zeros(logits.numel(), dtype=p.dtype, device=p.device).index_put_((ids,), p)


class Sampler:
    """Stateful sampler for one generation: owns its RNG so a seed reproduces a run exactly."""

    def __init__(self, cfg: SamplingConfig):
        cfg.validate()
        self.cfg = cfg
        self.gen = torch.Generator()
        # no seed: one from the OS (torch.seed() would reseed torch's global generators, and record a stack for each
        # lazily initialised device: ~0.3 ms a reply)
        self.gen.manual_seed(cfg.seed if cfg.seed is not None else secrets.randbits(31))

    def penalized(self, logits: torch.Tensor, history: Sequence[int], mask: Mask | None = None) -> torch.Tensor:
        x = apply_repetition_penalty(logits, history, self.cfg)
        return x if mask is None or mask.free else ops.mask_logits(x, mask.bits())

    def distribution(self, logits: torch.Tensor, history: Sequence[int], mask: Mask | None = None) -> torch.Tensor:
        return probs(self.penalized(logits, history, mask), self.cfg)

    def sample(self, logits: torch.Tensor, history: Sequence[int], mask: Mask | None = None) -> int:
        if self.cfg.greedy:
            return self.pick(logits, history, mask)
        ids, p = candidates(self.penalized(logits, history, mask), self.cfg)
        return int(ids[self._index(p)])

    def pick(self, logits: torch.Tensor, history: Sequence[int], mask: Mask | None = None) -> int:
        """The greedy token. Under a mask the row's own argmax where the mask allows it (then it is the masked row's
        argmax too, first maximum included), so the whole mask is computed only when the model's choice is
        forbidden."""
        x = self.penalized(logits, history)
        t = self.argmax(x)
        if mask is None or mask.allows(t):
            return t
        i = ops.masked_argmax(x, mask.bits())
        if i < 0:
            raise EngineError("the constraint allows no token")
        if not math.isfinite(float(x[i])):
            raise NonFiniteLogitsError(NON_FINITE)
        return i

    @staticmethod
    def argmax(x: torch.Tensor) -> int:
        """The greedy token of a (penalised) logit row: its first maximum. A NaN is a maximum to both numpy and torch,
        so a row holding one, or an infinity, ends here (NonFiniteLogitsError) instead of naming a token."""
        if x.is_cpu and x.dtype == torch.float32 and x.dim() == 1 and not x.requires_grad:
            # numpy on a CPU row: as torch's argmax, through far less dispatch (a decode step's sampling runs with the
            # interpreter's caches cold after the step's weights)
            a = x.numpy()
            i = int(a.argmax())
            top = float(a[i])
        else:
            i = int(torch.argmax(x))
            top = float(x[i].detach())
        if not math.isfinite(top):
            raise NonFiniteLogitsError(NON_FINITE)
        return i

    def draw(self, p: torch.Tensor) -> int:
        """A token drawn from a distribution over the vocabulary: from its nonzero entries where they are few (a cut
        distribution's candidates), else from the whole row."""
        p = p.detach().cpu()
        if p.numel() > SPARSE_DRAW:
            ids = torch.nonzero(p).reshape(-1)
            if ids.numel() <= SPARSE_DRAW:
                return int(ids[self._index(p[ids])])
        return self._index(p)

    def _index(self, p: torch.Tensor) -> int:
        """An index drawn with probability p[i] (p ≥ 0, not all 0): one uniform against p's running sum in float64,
        where a zero-probability entry takes none of it (multinomial took ~4 ms over a 248k-token row, ~0.13 over
        8k)."""
        cdf = torch.cumsum(p.detach().cpu().double(), 0)
        u = float(torch.rand(1, generator=self.gen, dtype=torch.float64)) * float(cdf[-1])
        return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)), p.numel() - 1)

    def uniform(self) -> float:
        return float(torch.rand(1, generator=self.gen))
