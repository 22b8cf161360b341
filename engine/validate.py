"""Range checks of every parameter a caller hands the engine (CLI flags, API fields, app settings).

Each check raises InvalidParameterError with one plain line naming the parameter, the value and what is allowed,
before anything is loaded or allocated. The engine runs them itself (`load`, `Engine.generate`), so the CLI, the
app and a server get the same answer without repeating the rules.
"""
from __future__ import annotations

import argparse
import math
import numbers
import re
from typing import Any, Iterable, Mapping, Sequence

from engine.errors import InvalidParameterError

MAX_CTX = 1 << 22  # 4M tokens: far past any model we run, and a context whose tables still fit in memory
MAX_THREADS = 1024
MAX_SEED = (1 << 64) - 1  # torch.Generator.manual_seed takes 64-bit seeds
MAX_DRAFT = 8  # the deepest draft chain (GenerationConfig.draft): a verify pass is at most MAX_DRAFT + 1 rows
_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")
_MESSAGE_TEXT_FIELDS = ("role", "content", "reasoning_content", "name")


def _fail(what: str) -> None:
    raise InvalidParameterError(what)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy integers too


def _number(name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False, hint: str = "") -> float:
    """A finite real in [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        _fail(f"{name} must be a number, not {type(v).__name__}")
    x = float(v)
    if not math.isfinite(x):
        _fail(f"{name} must be a finite number, not {v}")
    if x < lo or (lo_open and x == lo) or x > hi:
        _fail(f"{name} {v:g} is out of range: it must be {'>' if lo_open else '≥'} {lo:g} and ≤ {hi:g}{hint}")
    return x


def integer(name: str, v: Any, lo: int, hi: int, hint: str = "") -> int:
    """An int (not a bool) in [lo, hi]."""
    if not _is_int(v):
        _fail(f"{name} must be a whole number, not {v!r}")
    if not lo <= v <= hi:
        _fail(f"{name} {v} is out of range: it must be {lo}…{hi}{hint}")
    return int(v)


def validate_sampling(cfg: Any) -> None:
    """engine.sampling.SamplingConfig."""
    _number("temperature", cfg.temperature, 0.0, 100.0, hint=" (0 = greedy)")
    integer("top_k", cfg.top_k, 0, 1 << 31, hint=" (0 = off)")
    _number("top_p", cfg.top_p, 0.0, 1.0, lo_open=True, hint=" (1 = off)")
    _number("min_p", cfg.min_p, 0.0, 1.0, hint=" (0 = off)")
    _number("repeat_penalty", cfg.repeat_penalty, 0.0, 100.0, lo_open=True, hint=" (1 = off)")
    integer("repeat_last_n", cfg.repeat_last_n, 0, 1 << 31)
    if cfg.seed is not None:
        integer("seed", cfg.seed, 0, MAX_SEED)


def validate_generation(gen: Any) -> None:
    """engine.events.GenerationConfig (its sampling settings included)."""
    integer("max_tokens", gen.max_tokens, 1, 1 << 31, hint=" (at least one token is generated)")
    validate_sampling(gen.sampling)
    stops = gen.stop_strings
    if isinstance(stops, str) or not all(isinstance(s, str) for s in stops):
        _fail("stop strings must be a list of strings")
    for s in stops:
        text("stop string", s)
    if gen.enable_thinking is not None and not isinstance(gen.enable_thinking, bool):
        _fail(f"enable_thinking must be true, false or unset, not {gen.enable_thinking!r}")
    _number("stats_interval_s", gen.stats_interval_s, 0.0, 3600.0)
    if isinstance(gen.draft, str):  # a setting's text is read by parse_draft first
        _fail(f"draft depth must be a number or None (auto), not {gen.draft!r}")
    parse_draft(gen.draft)
    _number("p_min", gen.p_min, 0.0, 1.0)


def validate_engine_config(cfg: Any) -> None:
    """engine.events.EngineConfig."""
    integer("context length", cfg.n_ctx, 1, MAX_CTX)
    device(cfg.device)
    if cfg.n_threads is not None:
        integer("threads", cfg.n_threads, 1, MAX_THREADS)
    if cfg.gpu_layers is not None:
        integer("GPU layers", cfg.gpu_layers, 0, 1 << 20, hint=" (or auto)")
    if cfg.miss_policy not in ("load", "cpu"):
        _fail(f"expert-cache miss policy must be 'load' or 'cpu', not {cfg.miss_policy!r}")
    if cfg.step_graphs not in ("auto", "on", "off"):
        _fail(f"step graphs must be 'auto', 'on' or 'off', not {cfg.step_graphs!r}")
    if cfg.memory_budget is not None:
        integer("memory budget", cfg.memory_budget, 1, 1 << 62)


def parse_draft(value: str | int | None) -> int | None:
    """A draft depth setting in any of its forms (a CLI flag, the API's `mtp` depth, the app's setting) as
    GenerationConfig.draft takes it: "auto" or None is None (auto), a depth 1…MAX_DRAFT or its digits that depth."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()):
            _fail(f"draft depth must be 1…{MAX_DRAFT} or auto, not {value!r}")
        value = int(value)
    return integer("draft depth", value, 1, MAX_DRAFT, hint=" (or auto)")


def draft_arg(value: str) -> int | None:
    """`parse_draft` as an argparse type: a bad depth is one argparse error line (exit 2) before anything loads."""
    try:
        return parse_draft(value)
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(name: Any) -> str:
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        _fail(f"device {name!r} is not known: use cpu, cuda or cuda:N")
    return name


def text(name: str, s: Any) -> str:
    """A str that is valid Unicode (argv bytes that are not UTF-8 arrive as lone surrogates)."""
    if not isinstance(s, str):
        _fail(f"{name} must be text, not {type(s).__name__}")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        _fail(f"{name} is not valid UTF-8 text")
    return s


def token_ids(ids: Iterable[Any], n_vocab: int) -> list[int]:
    """Prompt token ids: whole numbers inside the vocabulary (a negative id is not 'from the end')."""
    out = []
    for i in ids:
        if not _is_int(i):
            _fail(f"token ids must be whole numbers, got {i!r}")
        if not 0 <= i < n_vocab:
            _fail(f"token id {i} is outside the vocabulary (0…{n_vocab - 1})")
        out.append(int(i))
    return out


def messages(items: Sequence[Any]) -> None:
    """Chat messages: each a Message or a mapping whose text fields are valid text."""
    for n, m in enumerate(items):
        get = m.get if isinstance(m, Mapping) else (lambda k, m=m: getattr(m, k, None))
        if get("role") is None:
            _fail(f"message {n + 1} has no role")
        for f in _MESSAGE_TEXT_FIELDS:
            v = get(f)
            if v is not None:
                text(f"message {n + 1} field '{f}'", v)
