"""A jinja2 sandbox for the chat templates that come inside model files: bounded in output, value size and time.

jinja2's own sandbox stops attribute tricks but not `'a' * 10**10` (10 GB), `x ~ x` doubled in a loop, `10**10**9`
or a loop that never ends; its `range` guard raises a bare OverflowError. Here every operator that can grow a value
(`*`, `**`, `+`, `%`, `~`), every call, filter and attribute access checks the value it made against a size limit
and the render against a deadline, and raises ChatTemplateError, so a hostile template fails fast and typed.
"""
from __future__ import annotations

import math
import re
import threading
import time
from typing import Any, Callable, Iterator

from jinja2.compiler import CodeGenerator, Frame
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import ChatTemplateError

MAX_OUTPUT_CHARS = 4_000_000  # plus the conversation's own length (see `limits`)
MAX_RANGE = 100_000
MAX_POW_BITS = 4096  # an integer power larger than this is not a chat template's business
TIME_LIMIT_S = 5.0


class _Limits(threading.local):
    deadline: float = math.inf
    max_chars: int = MAX_OUTPUT_CHARS


_limits = _Limits()


class limits:
    """Context manager: the deadline and size limit for one compile or render in this thread."""

    def __init__(self, extra_chars: int = 0, time_s: float = TIME_LIMIT_S):
        self.extra_chars, self.time_s = extra_chars, time_s

    def __enter__(self) -> None:
        self._saved = (_limits.deadline, _limits.max_chars)
        _limits.deadline = time.monotonic() + self.time_s
        _limits.max_chars = MAX_OUTPUT_CHARS + max(self.extra_chars, 0)

    def __exit__(self, *exc: object) -> None:
        _limits.deadline, _limits.max_chars = self._saved


def check_time() -> None:
    if time.monotonic() > _limits.deadline:
        raise ChatTemplateError(f"the chat template ran longer than {TIME_LIMIT_S:g} s and was stopped")


def check_size(value: Any) -> Any:
    """`value` unless it is a str/list/tuple/dict longer than the limit."""
    if isinstance(value, (str, bytes, list, tuple, dict, set)) and len(value) > _limits.max_chars:
        raise ChatTemplateError(f"the chat template built a value of {len(value):,} items; "
                                f"the limit is {_limits.max_chars:,}")
    return value


def _product_size(left: Any, right: Any) -> int:
    """How long `left * right` would be when it repeats a sequence (0 for numbers)."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            return len(seq) * max(n, 0)
    return 0


class _Range:
    """range() for templates: bounded length, and the deadline checked on every step."""

    def __init__(self, *args: int):
        self.r = range(*args)
        if len(self.r) > MAX_RANGE:
            raise ChatTemplateError(f"the chat template asked for a range of {len(self.r):,} numbers; "
                                    f"the limit is {MAX_RANGE:,}")

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i: Any) -> Any:
        return self.r[i]

    def __iter__(self) -> Iterator[int]:
        for i in self.r:
            check_time()
            yield i


class _LimitedCodeGenerator(CodeGenerator):
    """`a ~ b` goes through the environment's size check (jinja2 compiles it to a bare join)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.limited_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.globals["range"] = _Range

    def add_filters(self, filters: dict[str, Callable[..., Any]]) -> None:
        self.filters.update(filters)
        for name, f in list(self.filters.items()):
            self.filters[name] = _limited_filter(f)

    def limited_join(self, parts: tuple[Any, ...]) -> str:
        check_time()
        return check_size("".join(str(p) for p in parts))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_time()
        if operator == "*" and _product_size(left, right) > _limits.max_chars:
            raise ChatTemplateError(f"the chat template tried to build a value of {_product_size(left, right):,} "
                                    f"items; the limit is {_limits.max_chars:,}")
        if operator == "%" and isinstance(left, str):
            _precheck("format", left, right if isinstance(right, tuple) else (right,), {})
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * math.log2(abs(left)) > MAX_POW_BITS:
            raise ChatTemplateError(f"the chat template tried to compute {left} ** {right}, a number too large")
        return check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's shape)
        check_time()
        target = getattr(__obj, "__self__", None)
        if target is None:  # str.format comes wrapped by the sandbox (SandboxedFormatter), its method as __wrapped__
            target = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(target, str):
            _precheck(name, target, args, kwargs)
        return check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        check_time()
        return super().getitem(obj, argument)


_PADDING = {"center", "ljust", "rjust", "zfill", "indent", "wordwrap"}


def _precheck(name: str, s: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, before it runs, a str operation whose result would pass the size limit (the check after the
    call would come too late: the value would already fill memory)."""
    limit = _limits.max_chars
    vals = list(args) + list(kwargs.values())
    size = 0
    if name in _PADDING or name == "expandtabs":
        size = max([v for v in vals if isinstance(v, int)] + [0]) * (s.count("\t") + 1 if name == "expandtabs" else 1)
        if name == "indent":
            size *= s.count("\n") + 1
    elif name == "replace" and len(vals) >= 2 and isinstance(vals[0], str) and isinstance(vals[1], str):
        hits = len(s) + 1 if not vals[0] else s.count(vals[0])
        size = len(s) + hits * len(vals[1])
    elif name == "join" and vals and isinstance(vals[0], (list, tuple, str)):
        size = sum(len(str(v)) for v in vals[0]) + len(s) * len(vals[0])
    elif name in ("format", "format_map", "%"):
        nested = re.search(r"%[-#0 +]*\*|\{[^{}]*\{", s) is not None  # a width taken from the arguments
        widths = [int(d) for d in re.findall(r"\d+", s)]
        if nested:
            widths += [v for v in vals if isinstance(v, int)]
            widths += [v for m in vals if isinstance(m, dict) for v in m.values() if isinstance(v, int)]
        size = max(widths + [0])
    if size > limit:
        raise ChatTemplateError(f"the chat template's '{name}' would build a text of {size:,} characters; "
                                f"the limit is {limit:,}")


def _limited_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(f, "_limited", False):
        return f

    name = getattr(f, "__name__", "").removeprefix("do_")

    def run(*args: Any, **kwargs: Any) -> Any:
        check_time()
        i = next((k for k, a in enumerate(args) if isinstance(a, (str, list, tuple, _Range))), None)
        if i is not None:
            value, rest = args[i], args[i + 1:]
            if name == "join" and not isinstance(value, str):
                sep = rest[0] if rest and isinstance(rest[0], str) else kwargs.get("d", "")
                _precheck("join", str(sep), (list(value),), {})
            elif isinstance(value, str):
                _precheck(name, value, rest, kwargs)
        return check_size(f(*args, **kwargs))

    for attr in ("jinja_pass_arg",):  # jinja2 passes the context/environment to filters marked so
        if hasattr(f, attr):
            setattr(run, attr, getattr(f, attr))
    run._limited = True  # type: ignore[attr-defined]
    run.__name__ = getattr(f, "__name__", "filter")
    return run


def render_limited(template: Any, ctx: dict[str, Any], extra_chars: int) -> str:
    """Render with the limits, streaming so that the output size is checked as it grows."""
    out: list[str] = []
    n = 0
    with limits(extra_chars):
        for piece in template.generate(**ctx):
            n += len(piece)
            if n > _limits.max_chars:
                raise ChatTemplateError(f"the chat template's output passed {_limits.max_chars:,} characters "
                                        "and was stopped")
            check_time()
            out.append(piece)
    return "".join(out)
