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
from typing import Any, Callable, Iterable, Mapping, Sequence

from engine.errors import InvalidParameterError

MAX_CTX = 1 << 22  # 4M tokens: far past any model we run, and a context whose tables still fit in memory
MAX_THREADS = 1024
MAX_GPU_LAYERS = 1 << 20
MAX_SEED = (1 << 64) - 1  # torch.Generator.manual_seed takes 64-bit seeds
MAX_DRAFT = 8  # the deepest draft chain (GenerationConfig.draft): a verify pass is at most MAX_DRAFT + 1 rows
MAX_TOKENS = 1 << 31  # a reply's length (max_tokens); a server caps it further by the room left in the context
MAX_TOP_K = 1 << 31  # top_k past the vocabulary is the whole vocabulary
MAX_TOP_LOGPROBS = 20  # alternatives reported per token (GenerationConfig.logprobs; OpenAI's top_logprobs limit)
# temperature and repeat_penalty divide logits: below this the quotient may pass float32's range and read as a
# damaged model (a smaller temperature is greedy in all but name: give 0)
MIN_LOGIT_DIVISOR = 1e-6
MAX_STOP_STRINGS = 16  # each stop string is searched for after every token: their count and length bound that work
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096  # a chat request's messages, each rendered through the template before the context is known
MAX_TEXT_FILE_BYTES = 16 << 20  # `tokenize --text-file`: ~4M tokens, the largest context (MAX_CTX)
MAX_QUEUE = 1024  # requests waiting behind a server's running one
MAX_PARALLEL = 64  # requests a server decodes together (serve --parallel)
MAX_PORT = 65535
MAX_API_KEY_CHARS = 256
_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^\s/?#]+")  # what a browser sends as Origin: scheme://host[:port]
_EXPERT_CACHE = re.compile(r"(\d{1,12})(MiB|GiB|M|G)?", flags=re.IGNORECASE)
_MESSAGE_TEXT_FIELDS = ("role", "content", "reasoning_content", "name")


def _fail(what: str) -> None:
    raise InvalidParameterError(what)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy integers too


def _number(name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False, hint: str = "") -> float:
    """A finite real in [lo, hi] (or (lo, hi] with lo_open)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        _fail(f"{name} must be a number, not {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):
        _fail(f"{name} must be a finite number, not {v}")
    if not (lo < v if lo_open else lo <= v) or v > hi:  # compared as given: an int may be past any float
        _fail(f"{name} {shown(v)} is out of range: it must be {'>' if lo_open else '≥'} {lo:g} and ≤ {hi:g}{hint}")
    return float(v)


def integer(name: str, v: Any, lo: int, hi: int, hint: str = "") -> int:
    """An int (not a bool) in [lo, hi]."""
    if not _is_int(v):
        _fail(f"{name} must be a whole number, not {shown(v)}")
    if not lo <= v <= hi:
        _fail(f"{name} {shown(v)} is out of range: it must be {lo}…{hi}{hint}")
    return int(v)


def validate_sampling(cfg: Any) -> None:
    """engine.sampling.SamplingConfig."""
    t = _number("temperature", cfg.temperature, 0.0, 100.0, hint=" (0 = greedy)")
    if 0 < t < MIN_LOGIT_DIVISOR:
        _fail(f"temperature {t:g} is too small: give 0 (greedy) or at least {MIN_LOGIT_DIVISOR:g}")
    integer("top_k", cfg.top_k, 0, MAX_TOP_K, hint=" (0 = off)")
    _number("top_p", cfg.top_p, 0.0, 1.0, lo_open=True, hint=" (1 = off)")
    _number("min_p", cfg.min_p, 0.0, 1.0, hint=" (0 = off)")
    _number("repeat_penalty", cfg.repeat_penalty, MIN_LOGIT_DIVISOR, 100.0, hint=" (1 = off)")
    integer("repeat_last_n", cfg.repeat_last_n, 0, 1 << 31)
    if cfg.seed is not None:
        integer("seed", cfg.seed, 0, MAX_SEED)


def validate_generation(gen: Any) -> None:
    """engine.events.GenerationConfig (its sampling settings included)."""
    integer("max_tokens", gen.max_tokens, 1, MAX_TOKENS, hint=" (at least one token is generated)")
    validate_sampling(gen.sampling)
    stop_strings(gen.stop_strings)
    if gen.enable_thinking is not None and not isinstance(gen.enable_thinking, bool):
        _fail(f"enable_thinking must be true, false or unset, not {gen.enable_thinking!r}")
    _number("stats_interval_s", gen.stats_interval_s, 0.0, 3600.0)
    if isinstance(gen.draft, str):  # a setting's text is read by parse_draft first
        _fail(f"draft depth must be a number or None (auto), not {gen.draft!r}")
    parse_draft(gen.draft)
    _number("p_min", gen.p_min, 0.0, 1.0)
    if gen.logprobs is not None:
        integer("logprobs", gen.logprobs, 0, MAX_TOP_LOGPROBS)
    if gen.constraint is not None:  # engine.constrain.Constraint: its schema compiled, before the prompt is processed
        gen.constraint.check()


def validate_engine_config(cfg: Any) -> None:
    """engine.events.EngineConfig."""
    integer("context length", cfg.n_ctx, 1, MAX_CTX)
    device(cfg.device)
    if cfg.n_threads is not None:
        integer("threads", cfg.n_threads, 1, MAX_THREADS)
    if cfg.gpu_layers is not None:
        integer("GPU layers", cfg.gpu_layers, 0, MAX_GPU_LAYERS, hint=" (or auto)")
        if cfg.gpu_layers and cfg.device == "cpu":
            _fail(f"{cfg.gpu_layers} GPU layers need a GPU device (cuda)")
    if cfg.miss_policy not in ("load", "cpu"):
        _fail(f"expert-cache miss policy must be 'load' or 'cpu', not {cfg.miss_policy!r}")
    if cfg.step_graphs not in ("auto", "on", "off"):
        _fail(f"step graphs must be 'auto', 'on' or 'off', not {cfg.step_graphs!r}")
    if cfg.memory_budget is not None:
        integer("memory budget", cfg.memory_budget, 1, 1 << 62)
    expert_cache(cfg.expert_cache)


def stop_strings(stops: Any) -> tuple[str, ...]:
    """At most MAX_STOP_STRINGS strings of 1…MAX_STOP_CHARS characters (an empty one would stop nothing)."""
    stops = tuple(stops) if isinstance(stops, Iterable) and not isinstance(stops, str) else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        _fail("stop strings must be a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        _fail(f"{len(stops)} stop strings are too many: at most {MAX_STOP_STRINGS}")
    for s in stops:
        text("stop string", s)
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            _fail(f"a stop string must have 1…{MAX_STOP_CHARS} characters, not {len(s)}")
    return stops


def expert_cache(spec: Any) -> tuple[int | None, int | None]:
    """A GPU expert-cache size (EngineConfig.expert_cache) as (experts per layer, bytes in all): "64" is 64
    experts per layer, "512MiB" / "512 MiB" / "2GiB" a byte total, None or "auto" (None, None): what is left."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
        return None, None
    m = _EXPERT_CACHE.fullmatch(spec.replace(" ", "")) if isinstance(spec, str) else None
    if m is None:
        _fail(f"expert cache {shown(spec)}: give a number of experts per layer (64), a size (512MiB) or auto")
    n, unit = int(m.group(1)), (m.group(2) or "").lower()
    if not unit:
        return n, None
    return None, n << (20 if unit in ("mib", "m") else 30)


def parse_draft(value: str | int | None) -> int | None:
    """A draft depth setting in any of its forms (a CLI flag, the API's `mtp` depth, the app's setting) as
    GenerationConfig.draft takes it: "auto" or None is None (auto), a depth 1…MAX_DRAFT or its digits that depth."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()) or len(value) > 20:
            _fail(f"draft depth must be 1…{MAX_DRAFT} or auto, not {shown(value)}")
        value = int(value)
    return integer("draft depth", value, 1, MAX_DRAFT, hint=" (or auto)")


def draft_arg(value: str) -> int | None:
    """`parse_draft` as an argparse type: a bad depth is one argparse error line (exit 2) before anything loads."""
    return _arg(parse_draft, value)


def _arg(parse: Callable[[str], Any], value: str) -> Any:
    try:
        return parse(value)
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _whole(name: str, value: str, lo: int, hi: int) -> int:
    """A flag's whole number, read as every int flag is (int()), in lo…hi."""
    try:
        n = int(value)
    except ValueError:  # not a number, or past int()'s 4300 digits
        _fail(f"{name} must be a whole number {lo}…{hi}, not {shown(value)}")
    return integer(name, n, lo, hi)


def port_arg(value: str) -> int:
    """A TCP port to listen on (0: any free port)."""
    return _arg(lambda v: _whole("port", v, 0, MAX_PORT), value)


def queue_arg(value: str) -> int:
    """How many requests may wait behind a server's running one."""
    return _arg(lambda v: _whole("queue", v, 0, MAX_QUEUE), value)


def parallel_arg(value: str) -> int:
    """How many requests a server decodes together."""
    return _arg(lambda v: _whole("parallel", v, 1, MAX_PARALLEL), value)


def gpu_layers_arg(value: str) -> int | None:
    """`--gpu-layers N|auto` (auto: None, as many as fit)."""
    return _arg(lambda v: None if v == "auto" else _whole("GPU layers", v, 0, MAX_GPU_LAYERS), value)


def api_key(value: str) -> str:
    """An API key: 1…MAX_API_KEY_CHARS visible ASCII characters (it travels in an HTTP header)."""
    if not 1 <= len(value) <= MAX_API_KEY_CHARS or not all("!" <= c <= "~" for c in value):
        _fail(f"an API key must be 1…{MAX_API_KEY_CHARS} visible ASCII characters (no spaces)")
    return value


def api_key_arg(value: str) -> str:
    return _arg(api_key, value)


def origin(value: str) -> str:
    """A browser origin as browsers send it in `Origin`, e.g. http://localhost:3000 (no path, no '*')."""
    if not _ORIGIN.fullmatch(value):
        _fail(f"{shown(value)} is not an origin: give scheme://host[:port] as a browser sends it, "
              "e.g. http://localhost:3000")
    return value


def origin_arg(value: str) -> str:
    return _arg(origin, value)


def expert_cache_arg(value: str) -> str:
    """`--expert-cache`: checked as the flag is read, kept as written (EngineConfig takes the text)."""
    _arg(expert_cache, value)
    return value


def device(name: Any) -> str:
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        _fail(f"device {shown(name)} is not known: use cpu, cuda or cuda:N")
    return name


def shown(v: Any) -> str:
    """A value as a message quotes it: its repr, cut short (a client may send megabytes)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "…"


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
            _fail(f"token ids must be whole numbers, got {shown(i)}")
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
