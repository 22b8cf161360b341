"""Engine and generation loop: load a model, prefill, decode, and stream events.

`Engine.generate` is a generator of `Token` / `Stats` / `Done` events (the mlx-lm shape); the CLI and
the app's worker thread are thin layers on it. The sequence already in the cache is reused when a new
prompt extends it (the next turn of a chat), so only the new tokens are prefilled.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from engine.chat import ChatFormat, Message
from engine.errors import EngineError
from engine.modelfile import ModelFile, open_model
from engine.models.qwen35 import Qwen35Model
from engine.sampling import Sampler, SamplingConfig
from engine.tokenizer import Tokenizer

ProgressFn = Callable[[float, str], None]
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int = 4096
    device: str = "cpu"
    n_threads: int | None = None  # None: torch's default (all cores)


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 512
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    enable_thinking: bool | None = None
    stats_interval_s: float = 0.25


@dataclass(frozen=True)
class Token:
    ids: list[int]
    text: str
    accepted_draft: bool = False


@dataclass(frozen=True)
class Stats:
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens actually computed (the rest was reused from the cache)
    generated_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    elapsed_s: float
    cache_bytes: int
    state_bytes: int
    final: bool = False


@dataclass(frozen=True)
class Done:
    reason: str  # "eos" | "max_tokens" | "stop_string" | "stopped" | "context_full" | "context_overflow"
    message: str = ""


Event = Token | Stats | Done


class Engine:
    """A loaded model with its tokenizer, chat template and one sequence cache."""

    def __init__(self, mf: ModelFile, config: EngineConfig = EngineConfig()):
        self.mf = mf
        self.config = config
        if config.n_threads:
            torch.set_num_threads(config.n_threads)
        self.hp = mf.hparams
        self.tokenizer = Tokenizer.from_metadata(mf.metadata)
        self.chat = ChatFormat(mf.get("tokenizer.chat_template"), self.tokenizer)
        self.model = Qwen35Model(mf, config.device, n_ctx=config.n_ctx)
        self.n_ctx = min(config.n_ctx, self.model.n_ctx_max)
        self.cache = self.model.new_cache(self.n_ctx)
        self._seq: list[int] = []  # tokens whose effect is in `cache`
        self._last_logits: torch.Tensor | None = None

    # -- prompt handling ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: Sequence[Message | Mapping[str, Any]] | Sequence[int] | str,
                      enable_thinking: bool | None = None) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, special=False)
        items = list(prompt)
        if items and isinstance(items[0], int):
            return [int(i) for i in items]
        return self.chat.encode(items, add_generation_prompt=True, enable_thinking=enable_thinking)

    def reset(self) -> None:
        self.cache.reset()
        self._seq = []
        self._last_logits = None

    def _prefill(self, ids: list[int], stop: threading.Event | None) -> tuple[torch.Tensor | None, int]:
        """Bring the cache to `ids`; returns the last logits and how many tokens were computed."""
        common = 0
        if self._seq and len(self._seq) <= len(ids) and ids[:len(self._seq)] == self._seq:
            common = len(self._seq)
        if common == len(ids) and self._last_logits is not None:
            return self._last_logits, 0
        if common == 0 or common == len(ids):
            self.reset()
            common = 0
        todo = ids[common:]
        logits = None
        for s in range(0, len(todo), PREFILL_CHUNK):
            if stop is not None and stop.is_set():
                self.reset()
                return None, s
            chunk = todo[s:s + PREFILL_CHUNK]
            res = self.model.forward(chunk, self.cache, logit_rows="last", chunked=len(chunk) > 1)
            logits = res.logits[-1]
            self._seq.extend(chunk)
        self._last_logits = logits
        return logits, len(todo)

    # -- generation --------------------------------------------------------------------------------
    def generate(self, prompt: Sequence[Message | Mapping[str, Any]] | Sequence[int] | str,
                 gen: GenerationConfig = GenerationConfig(),
                 stop: threading.Event | None = None) -> Iterator[Event]:
        t0 = time.perf_counter()
        ids = self.encode_prompt(prompt, gen.enable_thinking)
        if not ids:
            yield Done("context_overflow", "the prompt is empty")
            return
        if len(ids) >= self.n_ctx:
            yield Done("context_overflow",
                       f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                       "shorten the conversation or raise the context length")
            return
        sampler = Sampler(gen.sampling)
        logits, n_prefilled = self._prefill(ids, stop)
        if logits is None:
            yield Done("stopped")
            return
        t_prefill = time.perf_counter()
        history = list(ids)
        out_ids: list[int] = []
        detok = self.tokenizer.detokenizer()
        stopper = _StopStrings(gen.stop_strings)
        t_first: float | None = None
        t_stats = t_prefill
        reason = "max_tokens"

        def stats(final: bool = False) -> Stats:
            now = time.perf_counter()
            decode_n = max(len(out_ids) - 1, 0)
            return Stats(
                prompt_tokens=len(ids), prefill_tokens=n_prefilled, generated_tokens=len(out_ids),
                ttft_s=((t_first or now) - t0), prefill_tok_s=n_prefilled / max(t_prefill - t0, 1e-9),
                decode_tok_s=decode_n / max(now - (t_first or now), 1e-9) if decode_n else 0.0,
                elapsed_s=now - t0, cache_bytes=self.cache.nbytes, state_bytes=self.cache.state_nbytes, final=final,
            )

        while True:
            if stop is not None and stop.is_set():
                reason = "stopped"
                break
            tok = sampler.sample(logits, history)
            out_ids.append(tok)
            history.append(tok)
            if t_first is None:
                t_first = time.perf_counter()
            if tok in self.tokenizer.eog_ids:
                reason = "eos"
                break
            text, hit = stopper.push(detok.push([tok]))
            if text:
                yield Token([tok], text)
            elif not hit:
                yield Token([tok], "")
            if hit:
                reason = "stop_string"
                break
            if len(out_ids) >= gen.max_tokens:
                break
            if self.cache.pos >= self.n_ctx:
                reason = "context_full"
                break
            logits = self.model.forward([tok], self.cache, logit_rows="last").logits[-1]
            self._seq.append(tok)
            self._last_logits = logits
            if time.perf_counter() - t_stats >= gen.stats_interval_s:
                t_stats = time.perf_counter()
                yield stats()
        if reason not in ("stop_string", "eos"):
            tail = stopper.flush(detok.flush())
            if tail:
                yield Token([], tail)
        yield stats(final=True)
        msg = f"the context of {self.n_ctx} tokens is full" if reason == "context_full" else ""
        yield Done(reason, msg)


class _StopStrings:
    """Holds back text that could be the start of a stop string; reports when one completes."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        for s in self.stops:
            i = self.buf.find(s)
            if i >= 0:
                out, self.buf = self.buf[:i], ""
                return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out, False

    def flush(self, text: str = "") -> str:
        out, self.buf = self.buf + text, ""
        return out


def load(path: str | os.PathLike[str] | None = None, config: EngineConfig = EngineConfig(),
         progress: ProgressFn | None = None) -> Engine:
    """Open, validate and prepare a model (None = the embedded default model)."""
    from engine.cli import default_model_path

    report = progress or (lambda f, m: None)
    p = Path(path) if path is not None else default_model_path()
    report(0.0, f"opening {p.name}")
    mf = open_model(p)
    report(0.5, "preparing weights")
    try:
        eng = Engine(mf, config)
    except RuntimeError as e:
        raise EngineError(f"cannot prepare {p.name}: {e}") from None
    report(1.0, "ready")
    return eng
