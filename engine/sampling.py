"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded RNG.

`probs()` turns one logit row into the distribution actually sampled from; speculative decoding uses
the same function for the draft and the target so acceptance preserves exactly that distribution. A `Mask` (a
constraint's matcher, engine.constrain) forbids tokens: their logits are -inf before anything else is chosen.
"""
from __future__ import annotations

import math
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
    """What may come next under a constraint (engine.constrain.Matcher)."""

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


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The sampling distribution over the vocabulary for one (already penalised) logit row."""
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.numel():
        kth = torch.topk(x, cfg.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if not torch.isfinite(p[0]):  # softmax spreads a NaN or an infinity over the whole row
        raise NonFiniteLogitsError(NON_FINITE)
    if cfg.min_p > 0:
        p = p.masked_fill(p < cfg.min_p * p.max(), 0.0)
    if cfg.top_p < 1.0:
        sp, si = torch.sort(p, descending=True)
        before = torch.cumsum(sp, 0) - sp  # mass strictly before each token: keep while < top_p
        drop = si[before >= cfg.top_p]
        p = p.index_fill(0, drop, 0.0)
    return p / p.sum()


class Sampler:
    """Stateful sampler for one generation: owns its RNG so a seed reproduces a run exactly."""

    def __init__(self, cfg: SamplingConfig):
        cfg.validate()
        self.cfg = cfg
        self.gen = torch.Generator()
        self.gen.manual_seed(cfg.seed if cfg.seed is not None else torch.seed() & 0x7FFFFFFF)

    def penalized(self, logits: torch.Tensor, history: Sequence[int], mask: Mask | None = None) -> torch.Tensor:
        x = apply_repetition_penalty(logits, history, self.cfg)
        return x if mask is None else ops.mask_logits(x, mask.bits())

    def distribution(self, logits: torch.Tensor, history: Sequence[int], mask: Mask | None = None) -> torch.Tensor:
        return probs(self.penalized(logits, history, mask), self.cfg)

    def sample(self, logits: torch.Tensor, history: Sequence[int], mask: Mask | None = None) -> int:
        if self.cfg.greedy:
            return self.pick(logits, history, mask)
        return self.draw(self.distribution(logits, history, mask))

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
        return int(torch.multinomial(p.cpu(), 1, generator=self.gen))

    def uniform(self) -> float:
        return float(torch.rand(1, generator=self.gen))
