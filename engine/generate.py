"""Engine and generation loop: load a model, prefill, decode, and stream events.

`Engine.generate` is a generator of `Token` / `Stats` / `Done` events (the mlx-lm shape); the CLI and
the app's worker thread are thin layers on it. The sequence already in the cache is reused when a new
prompt extends it (the next turn of a chat), so only the new tokens are prefilled.

One generation at a time per engine: a generator holds the engine's lock from its first step until it ends,
is closed or is collected; a second caller waits up to `wait_s` (default 0) and then gets EngineBusyError
(a second generator on the thread holding the lock gets it at once: waiting there could never end). A
generator abandoned mid-reply leaves the engine consistent: the speculative step commits what was emitted
in a `finally`, and `generate`'s own `finally` rolls the cache back to empty if anything else was cut short.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Mapping, Sequence

import torch

from engine import ops
from engine.chat import ChatFormat, Message
from engine.errors import EngineBusyError, EngineError, LoadCancelled, NonFiniteLogitsError, TokenizerError
from engine.storage.modelfile import ModelFile, default_model_path, open_model
from engine.storage.pages import release_mapping
from engine.models.build import load_model
from engine.memory import available_bytes, plan_memory
from engine.placement import ModelSizes, free_device_bytes, plan_placement
from engine.sampling import Sampler
from engine.events import Done, EngineConfig, Event, GenerationConfig, Progress, Stats
from engine.speculative import (AutoMemory, DepthController, MTPDrafter, PassCosts, SpecStats, SpeculativeDecoder,
                               load_memory, memory_path, save_memory)
from engine.decoding import Decoder, PlainDecoder, Reply
from engine.tokenizer import Tokenizer
from engine import validate
from engine.ops.coverage import product_coverage
from engine.validate import validate_engine_config, validate_generation

ProgressFn = Callable[[float, str], None]
PREFILL_CHUNK = 256
DIAGNOSE_TOKENS = 2048  # at most this many processed tokens are run again to find where a pass went non-finite


def text_side(mf: ModelFile) -> tuple[Tokenizer, ChatFormat]:
    """The model's tokenizer and chat template, checked: what `load` needs beyond the weights, and what `inspect`
    also runs so that a file it accepts is one `load` accepts."""
    try:
        tok = Tokenizer.from_metadata(mf.metadata)
        return tok, ChatFormat(mf.get("tokenizer.chat_template"), tok)
    except EngineError as e:
        raise type(e)(f"{mf.path.name}: {e}") from None
    except Exception as e:  # the tokenizers library on input it did not expect: still one plain line
        raise TokenizerError(f"{mf.path.name}: the tokenizer in this file cannot be built "
                             f"({type(e).__name__})") from None


class Engine:
    """A loaded model with its tokenizer, chat template and one sequence cache."""

    def __init__(self, mf: ModelFile, config: EngineConfig = EngineConfig(), *, progress: ProgressFn | None = None,
                 cancel: threading.Event | None = None):
        """`progress(fraction, message)` is told how far preparing the layers is (0 … 1); setting `cancel` stops it
        with LoadCancelled between layers."""
        validate_engine_config(config)
        report = progress or (lambda f, m: None)

        def on_layer(done: int, total: int) -> None:
            if cancel is not None and cancel.is_set():
                raise LoadCancelled(f"loading {mf.path.name} was cancelled")
            report(done / total, f"preparing layer {done} of {total}")

        self.mf = mf
        self.config = config
        if config.n_threads:
            torch.set_num_threads(config.n_threads)
        self.hp = mf.hparams
        report(0.0, "reading the tokenizer")
        self.tokenizer, self.chat = text_side(mf)
        on_layer(0, mf.hparams.n_layer + int(mf.hparams.has_mtp))
        n_ctx = min(config.n_ctx, mf.hparams.n_ctx_train)
        sizes = ModelSizes.from_model(mf, n_ctx)
        self.plan = config.plan or plan_placement(sizes, config.placement(), free_device_bytes(config.device))
        pc = mf.param_counts
        backend = config.backend or ops.default_backend()
        head = mf.tensors.get("output.weight") or mf.tensors["token_embd.weight"]
        sketch = ops.sketch_bytes(*head.shape, head.n_bytes) if mf.hparams.has_mtp else 0  # made for drafts
        self.memory = plan_memory(mf.path.name, mf.file_size, sum(sizes.kv) + sum(sizes.state),
                                  config.memory_budget or available_bytes(),
                                  mf.file_size * pc.active // max(pc.total, 1), backend.packs, sketch)
        if not self.memory.copies:
            backend = replace(backend, copies=False)
        self.runner = load_model(mf, n_ctx=config.n_ctx, plan=self.plan, backend=backend, on_layer=on_layer,
                                 step_graphs=config.step_graphs)
        self.model = self.runner.model
        # What loading read of the file (header, sampled tensor ends, vectors copied into floats) is copied now: its
        # pages would otherwise stay resident in this process for nothing.
        release_mapping(mf.gguf.data)
        self.n_ctx = min(config.n_ctx, self.model.n_ctx_max)
        self.cache = self.runner.new_cache(self.n_ctx)
        self.drafter = MTPDrafter(self.runner.mtp, self.n_ctx) if self.runner.mtp is not None else None
        # Things the user should know about this model (shown by the CLI and the app).
        self.no_mtp_notice = None if self.drafter is not None else \
            f"{mf.path.name} has no MTP block: speculative decoding is off, tokens are decoded one at a time"
        self.notices: list[str] = [self.no_mtp_notice] if self.no_mtp_notice else []
        if self.memory.notice is not None:
            self.notices.append(self.memory.notice)
        # Weights whose type has no native product on this backend (engine.ops.coverage): slower, and said so.
        self.coverage = product_coverage(self.model, backend.name)
        fallback = self.coverage.notice()
        if fallback is not None:
            self.notices.append(fallback)
        self._seq: list[int] = []  # tokens whose effect is in `cache`
        # draft-depth costs and acceptance, carried across replies (and processes, where a directory is given)
        self._auto_memory_file = None if config.auto_memory_dir is None or self.drafter is None else \
            memory_path(config.auto_memory_dir, mf.path, backend.name, torch.get_num_threads())
        self.auto_memory = AutoMemory() if self._auto_memory_file is None else load_memory(self._auto_memory_file)
        self._pass_costs = PassCosts.of_model(
            self.hp, {n: t.n_bytes for n, t in mf.tensors.items()},
            ops.draft_read_bytes(self.runner.mtp.head.head) if self.runner.mtp is not None else None)
        self._last_logits: torch.Tensor | None = None
        self._lock = threading.Lock()  # held by the running generation (see the module docstring)
        self._owner: int | None = None  # thread ident of the lock's holder

    # -- prompt handling ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: Sequence[Message | Mapping[str, Any]] | Sequence[int] | str,
                      enable_thinking: bool | None = None) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(validate.text("the prompt", prompt), special=False)
        items = list(prompt)
        if items and not isinstance(items[0], (Message, Mapping)):
            return validate.token_ids(items, self.hp.n_vocab)
        validate.messages(items)
        return self.chat.encode(items, add_generation_prompt=True, enable_thinking=enable_thinking)

    def reset(self) -> None:
        """Forget the cached sequence (the next prompt is prefilled from scratch)."""
        with self._hold(0.0):
            self._reset()

    def _reset(self) -> None:
        self.cache.reset()
        if self.drafter is not None:
            self.drafter.reset()
        self._seq = []
        self._last_logits = None

    def _prefill(self, ids: list[int], stop: threading.Event | None
                 ) -> Generator[Progress, None, tuple[torch.Tensor | None, int]]:
        """Bring the cache to `ids`, yielding Progress between chunks when there is more than one; returns the
        last logits and how many tokens were computed."""
        common = 0
        if self._seq and len(self._seq) <= len(ids) and ids[:len(self._seq)] == self._seq:
            common = len(self._seq)
        if common == len(ids) and self._last_logits is not None:
            return self._last_logits, 0
        if common == 0 or common == len(ids):
            self._reset()
            common = 0
        todo = ids[common:]
        logits = None
        if len(todo) > PREFILL_CHUNK:
            yield Progress(0, len(todo))
        for s in range(0, len(todo), PREFILL_CHUNK):
            if stop is not None and stop.is_set():
                self._reset()
                return None, s
            chunk = todo[s:s + PREFILL_CHUNK]
            res = self.runner.forward(chunk, self.cache, logit_rows="last",
                                      chunked=len(chunk) > 1 and not self.runner.sequential_prefill)
            if self.drafter is not None:
                self.drafter.push(chunk, res.hidden)
            logits = res.logits[-1]
            self._seq.extend(chunk)
            if len(todo) > PREFILL_CHUNK:
                yield Progress(s + len(chunk), len(todo))
        self._last_logits = logits
        return logits, len(todo)

    # -- generation --------------------------------------------------------------------------------
    @contextmanager
    def _hold(self, wait_s: float | None) -> Iterator[None]:
        """The engine's lock for one generation (or a reset); EngineBusyError if it stays taken."""
        me = threading.get_ident()
        if self._owner == me:
            raise EngineBusyError("this engine is already generating in this thread: finish or close the "
                                  "other reply's generator first")
        if not self._lock.acquire(timeout=-1 if wait_s is None else max(wait_s, 0.0)):
            raise EngineBusyError("the engine is busy with another reply; try again when it has finished")
        self._owner = me
        try:
            yield
        finally:
            self._owner = None
            self._lock.release()

    @property
    def sequence(self) -> list[int]:
        """The tokens whose effect is in the cache (a copy)."""
        return list(self._seq)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def consistent(self) -> bool:
        """The cache, the MTP head's rows and the engine's record of the sequence agree."""
        if self.cache.pos != len(self._seq):
            return False
        d = self.drafter
        return d is None or d.cache.pos + len(d.pending_tokens) == len(self._seq)

    def generate(self, prompt: Sequence[Message | Mapping[str, Any]] | Sequence[int] | str,
                 gen: GenerationConfig = GenerationConfig(),
                 stop: threading.Event | None = None, *, wait_s: float | None = 0.0) -> Iterator[Event]:
        """Stream the reply to `prompt`. `wait_s`: how long to wait for another caller's generation to end
        before EngineBusyError (None: as long as it takes). The lock is taken at the first `next()`."""
        validate_generation(gen)
        with self._hold(wait_s):
            try:
                yield from self._generate(prompt, gen, stop)
            except NonFiniteLogitsError:
                raise self._damaged() from None
            finally:  # abandoned (close/break/collected) or failed: never leave a half-recorded sequence
                if not self.consistent():
                    self._reset()

    def _damaged(self) -> NonFiniteLogitsError:
        """The error for a pass that gave non-finite logits: the file named as damaged, and the first intermediate
        that went non-finite, found by running the tokens it had processed op by op with a hook (the check mode: it
        costs a pass over them, and runs only once something has gone wrong)."""
        ids = self._seq[:DIAGNOSE_TOKENS]
        where = ""
        if ids:
            first: list[tuple[str, int]] = []

            def hook(name: str, il: int, t: torch.Tensor) -> None:
                if not first and not bool(torch.isfinite(t).all()):
                    first.append((name, il))

            self.runner.forward(ids, self.runner.new_cache(len(ids)), logit_rows="last", hook=hook)
            if first:
                name, il = first[0]
                where = f" (first non-finite: {name}" + (f" of layer {il})" if il >= 0 else ")")
        return NonFiniteLogitsError(f"{self.mf.path.name} is damaged: the model's logits are not finite (NaN or "
                                    f"infinite){where}; re-download or re-convert the file")

    def _generate(self, prompt: Sequence[Message | Mapping[str, Any]] | Sequence[int] | str,
                  gen: GenerationConfig, stop: threading.Event | None) -> Iterator[Event]:
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
        use_mtp = gen.mtp and self.drafter is not None
        spec = SpecStats()
        reproducible = not gen.sampling.greedy and gen.sampling.seed is not None
        depth = DepthController(gen.draft, spec, p_min=gen.p_min, reproducible=reproducible,
                                memory=self.auto_memory, costs=self._pass_costs) if use_mtp else None
        logits, n_prefilled = yield from self._prefill(ids, stop)
        if logits is None:
            yield Done("stopped")
            return
        if use_mtp and depth.head_at_prefill():  # type: ignore[union-attr]
            # the MTP head's cache over the prompt is prompt processing too: done before the first token
            self.drafter.catch_up()  # type: ignore[union-attr]
        t_prefill = time.perf_counter()
        run = Reply(ids, gen, self.tokenizer)
        t_stats = t_prefill

        def stats(final: bool = False) -> Stats:
            now = time.perf_counter()
            t_first = run.t_first or now
            decode_n = max(len(run.out_ids) - 1, 0)
            return Stats(
                prompt_tokens=len(ids), prefill_tokens=n_prefilled, generated_tokens=len(run.out_ids),
                ttft_s=t_first - t0, prefill_tok_s=n_prefilled / max(t_prefill - t0, 1e-9),
                decode_tok_s=decode_n / max(now - t_first, 1e-9) if decode_n else 0.0,
                elapsed_s=now - t0, cache_bytes=self.cache.nbytes, state_bytes=self.cache.state_nbytes,
                final=final, mtp=use_mtp, speculative=spec.snapshot() if use_mtp else None,
                expert_usage={il: c.tolist() for il, c in self.model.routing.counts.items()} or None,
                expert_cache={il: {**c.stats.as_dict(), "capacity": c.capacity, "occupancy": len(c.lru)}
                              for il, c in self.model.expert_caches.items()} or None,
            )

        x = sampler.sample(logits, run.history, run.matcher)
        yield from run.emit([(x, False)], logits)
        plain = PlainDecoder(self.runner, self.cache, self._advance, sampler,
                             self.drafter.push if self.drafter is not None else None)
        decoder: Decoder = SpeculativeDecoder(plain, self.drafter, depth, spec) \
            if depth is not None and self.drafter is not None else plain
        while run.reason is None:
            if stop is not None and stop.is_set():
                run.reason = "stopped"
                break
            room = self.n_ctx - self.cache.pos - 1
            if room < 0:
                run.reason = "context_full"
                break
            x = yield from decoder.step(x, run, room)
            if time.perf_counter() - t_stats >= gen.stats_interval_s:
                t_stats = time.perf_counter()
                yield stats()
        yield from run.tail()
        if depth is not None:
            depth.remember()
            if self._auto_memory_file is not None:
                save_memory(self._auto_memory_file, self.auto_memory)
        yield stats(final=True)
        msg = f"the context of {self.n_ctx} tokens is full" if run.reason == "context_full" else ""
        yield Done(run.reason or "max_tokens", msg)

    def _advance(self, tokens: list[int], logits: torch.Tensor) -> None:
        """The trunk processed `tokens` (now in the cache); `logits` are those after the last."""
        self._seq.extend(tokens)
        self._last_logits = logits


def load(path: str | os.PathLike[str] | ModelFile | None = None, config: EngineConfig = EngineConfig(),
         progress: ProgressFn | None = None, cancel: threading.Event | None = None) -> Engine:
    """Open, validate and prepare a model (None = the embedded default model; a ModelFile: one already opened).
    `progress(fraction, message)` follows the work (opening and checking the file, the tokenizer, each layer);
    setting `cancel` stops it with LoadCancelled."""
    validate_engine_config(config)  # before anything is opened or allocated
    report = progress or (lambda f, m: None)
    p = path.path if isinstance(path, ModelFile) else Path(path) if path is not None else default_model_path()
    report(0.0, f"opening {p.name}")
    mf = path if isinstance(path, ModelFile) else open_model(p)
    if cancel is not None and cancel.is_set():
        raise LoadCancelled(f"loading {p.name} was cancelled")
    report(0.1, "checking the model")
    try:
        eng = Engine(mf, config, progress=lambda f, m: report(0.1 + 0.9 * f, m), cancel=cancel)
    except RuntimeError as e:
        raise EngineError(f"cannot prepare {p.name}: {e}") from None
    report(1.0, "ready")
    return eng
