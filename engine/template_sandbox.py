"""A jinja2 sandbox for the chat templates that come inside model files: bounded in output, value size and time.

jinja2's own sandbox stops attribute tricks but not `'a' * 10**10` (10 GB), `x ~ x` doubled in a loop, `10**10**9`,
`lipsum(n=10**7)` or a loop that never ends; its `range` guard raises a bare OverflowError. Here every value a
template makes (a literal, an operator's, a call's or a filter's result, a block's text, a namespace) is weighed
against a size limit, nested containers counted as often as they are held (a list holding one big list a thousand
times prints and compares as a thousand copies); every operation whose result could outgrow its inputs (repeating,
padding, formatting, joining, wrapping, `lipsum`, `batch`, ...) is refused before it runs when its result would pass
the limit; and every call, operator, attribute access and loop step checks the render's deadline. A hostile template
fails fast and typed (ChatTemplateError): each single operation works on values within the limit, so it is bounded
too.
"""
from __future__ import annotations

import math
import re
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.constants import LOREM_IPSUM_WORDS
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

from engine.errors import ChatTemplateError

MAX_OUTPUT_CHARS = 4_000_000  # plus the conversation's own length (see `limits`)
MAX_RANGE = 100_000
MAX_POW_BITS = 4096  # an integer larger than this is not a chat template's business
MAX_COPY_WORK = 400_000_000  # characters one wordwrap or sum may copy (~0.1 s): both are quadratic at worst
TIME_LIMIT_S = 5.0
_LIPSUM_WORD = max(map(len, LOREM_IPSUM_WORDS.split())) + 2  # a word, its comma and its space


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


def check_length(n: int, what: str) -> None:
    """Refuse, before it is made, a value of n characters or items (`what` made it)."""
    if n > _limits.max_chars:
        raise ChatTemplateError(f"the chat template's {what} would build a value of {n:,} characters or items; "
                                f"the limit is {_limits.max_chars:,}")


def weight(value: Any, limit: int) -> int:
    """Characters of the strings and items of the containers in `value`, a container counted each time it is held
    (about what its text holds: a list holding one list a thousand times prints it a thousand times). Each container
    is weighed once (a list of itself doubled 60 times is 60 containers, not 2^60), and weighing stops past `limit`."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, _CONTAINERS):
        return 0
    done: dict[int, int] = {}
    todo: list[tuple[Any, bool]] = [(value, False)]
    while todo:
        v, children_done = todo.pop()
        key = id(v)
        items = _items(v)
        kinds = set(map(type, items))  # at C speed: most containers hold only numbers or only strings
        if children_done or kinds <= _FLAT:
            if kinds <= _FLAT:
                total = len(items) + (sum(len(c) for c in items if type(c) is str) if str in kinds else 0)
            else:  # a container met again on its own path (a cycle) adds 0
                total = len(items) + sum(len(c) if isinstance(c, (str, bytes)) else done.get(id(c), 0)
                                         for c in items)
            if total > limit:
                return total
            done[key] = total
        elif key not in done:
            if len(items) > limit:
                return len(items)
            done[key] = 0  # in progress
            todo.append((v, True))
            todo.extend((c, False) for c in items if isinstance(c, _CONTAINERS) and id(c) not in done)
    return done[id(value)]


_CONTAINERS = (list, tuple, set, frozenset, dict, Namespace)
_FLAT = {int, float, bool, type(None), str}  # items weighed without looking inside (str subclasses are looked into)


def _items(v: Any) -> Any:
    """What a container holds: a dict its keys and values, a namespace its attributes (in its own dict: its getattr
    reads only them)."""
    if isinstance(v, dict):
        return [*v.keys(), *v.values()]
    if isinstance(v, Namespace):
        return list(object.__getattribute__(v, "__dict__").values())
    return v


def check_size(value: Any) -> Any:
    """`value` unless it weighs more than the limit."""
    n = weight(value, _limits.max_chars)
    if n > _limits.max_chars:
        raise ChatTemplateError(f"the chat template built a value of over {_limits.max_chars:,} characters or "
                                f"items; the limit is {_limits.max_chars:,}")
    return value


def bounded_join(parts: Iterable[str]) -> str:
    """"".join(parts), stopped once past the limit (a block's text, a JSON encoder's chunks)."""
    out: list[str] = []
    n = 0
    for p in parts:
        n += len(p)
        if n > _limits.max_chars:
            raise ChatTemplateError(f"the chat template built a text of over {_limits.max_chars:,} characters")
        check_time()
        out.append(p)
    return "".join(out)


def _param(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, key: str, default: Any = None) -> Any:
    """A call's parameter `key`, at position i among `args` (which leave out the value it acts on)."""
    return args[i] if len(args) > i else kwargs.get(key, default)


def _text_len(v: Any) -> int:
    return len(v) if isinstance(v, (str, bytes)) else 0


def _printed_len(v: Any) -> int:
    """About how long str(v) is (a weight for strings and containers, so not much past the limit)."""
    return weight(v, _limits.max_chars) if isinstance(v, (str, bytes, *_CONTAINERS)) else len(str(v))


class _Range:
    """range() for templates: bounded length, and the deadline checked on every step."""

    def __init__(self, *args: int):
        self.r = range(*args)
        try:
            n = len(self.r)
        except OverflowError:  # longer than a C ssize_t
            n = math.inf
        if n > MAX_RANGE:
            raise ChatTemplateError(f"the chat template asked for a range of {n:,} numbers; the limit is {MAX_RANGE:,}")

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i: Any) -> Any:
        return self.r[i]

    def __iter__(self) -> Iterator[int]:
        for i in self.r:
            check_time()
            yield i


class _Namespace(Namespace):
    """namespace(): its attributes together within the size limit, like any value (its text shows them all)."""

    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, value)
        check_size(self)


def _lipsum(*args: Any, **kwargs: Any) -> str:
    n, most = _param(args, kwargs, 0, "n", 5), _param(args, kwargs, 3, "max", 100)
    if isinstance(n, int) and isinstance(most, int):
        check_length(max(n, 0) * max(most, 0) * _LIPSUM_WORD, "lipsum")
    return generate_lorem_ipsum(*args, **kwargs)


class _LimitedCodeGenerator(CodeGenerator):
    """`a ~ b` goes through the environment's size check (jinja2 compiles it to a bare join); list, tuple and dict
    literals are weighed; every loop steps through `timed_iter`."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.limited_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _checked(self, visit: Callable[[Any, Frame], None], node: nodes.Node, frame: Frame) -> None:
        self.write("environment.checked(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._checked(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._checked(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "load":  # not the names a `for` or `set` assigns to
            self._checked(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        # Names in node.iter were resolved with the enclosing frame already: wrapping it changes no scope.
        node.iter = nodes.Call(nodes.EnvironmentAttribute("timed_iter"), [node.iter], [], None, None,
                               lineno=node.iter.lineno)
        super().visit_For(node, frame)


class LimitedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    concat = staticmethod(bounded_join)  # the text of `{% set x %}...{% endset %}` blocks and macros

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self.globals.update(range=_Range, lipsum=_lipsum, namespace=_Namespace)
        self.add_filters({})

    def add_filters(self, filters: dict[str, Callable[..., Any]]) -> None:
        self.filters.update(filters)
        for name, f in list(self.filters.items()):
            self.filters[name] = _limited_filter(name, f)

    def limited_join(self, parts: tuple[Any, ...]) -> str:
        check_time()
        return check_size("".join(str(p) for p in parts))

    @staticmethod
    def checked(value: Any) -> Any:
        return check_size(value)

    @staticmethod
    def timed_iter(iterable: Iterable[Any]) -> Iterator[Any]:
        for x in iterable:
            check_time()
            yield x

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    check_length(weight(seq, _limits.max_chars) * max(n, 0), "'*'")
            if isinstance(left, int) and isinstance(right, int) and \
                    left.bit_length() + right.bit_length() > MAX_POW_BITS:
                raise ChatTemplateError(f"the chat template tried to compute a product of over {MAX_POW_BITS} bits")
        if operator == "%" and isinstance(left, (str, bytes)):
            _precheck("%", left, right if isinstance(right, tuple) else (right,), {})
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
        if isinstance(target, (str, bytes)):
            if name == "join" and args and not isinstance(args[0], (str, bytes, list, tuple)):
                args = (list(__self.timed_iter(args[0])), *args[1:])  # a generator, measured before it is joined
            _precheck(name, target, args, kwargs)
        elif isinstance(target, int) and name == "to_bytes":
            length = _param(args, kwargs, 0, "length", 1)
            if isinstance(length, int):
                check_length(length, "to_bytes")
        return check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        check_time()
        return super().getitem(obj, argument)


def _precheck(name: str, s: str | bytes, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, before it runs, a str/bytes method or filter (`name`, acting on `s`) whose result would pass the size
    limit (checked after the call, the value would already fill memory), or a wordwrap that would copy too much."""
    text = s.decode("latin-1") if isinstance(s, bytes) else s  # one byte a character: the same counts
    lines = text.count("\n") + 1
    width = _param(args, kwargs, 0, "width")
    size = 0
    if name in ("center", "ljust", "rjust", "zfill"):
        size = width if isinstance(width, int) else 0
    elif name == "expandtabs":
        tab = _param(args, kwargs, 0, "tabsize", 8)
        size = len(s) + text.count("\t") * tab if isinstance(tab, int) else 0
    elif name == "indent":
        width = 4 if width is None else width
        size = len(s) + lines * (len(width) if isinstance(width, str) else width if isinstance(width, int) else 0)
    elif name == "wordwrap":
        width = 79 if not isinstance(width, int) else max(width, 1)
        wrap = _param(args, kwargs, 2, "wrapstring")
        size = len(s) + (len(s) // width + lines) * _text_len(wrap)
        if _param(args, kwargs, 1, "break_long_words", True) and len(s) > width:
            _check_wrap_work(text, width)
    elif name == "replace":
        old, new = _param(args, kwargs, 0, "old"), _param(args, kwargs, 1, "new")
        count = _param(args, kwargs, 2, "count")
        if isinstance(old, (str, bytes)) and isinstance(new, (str, bytes)):
            hits = len(s) + 1 if not old else s.count(old)  # type: ignore[arg-type]
            hits = min(hits, count) if isinstance(count, int) and count >= 0 else hits
            size = len(s) + hits * len(new)
    elif name == "join" and args and isinstance(args[0], (list, tuple, str, bytes)):
        items = args[0]
        size = (len(items) if isinstance(items, (str, bytes)) else sum(map(_printed_len, items))) + len(s) * len(items)
    elif name == "translate" and args and isinstance(args[0], dict):
        size = len(s) * max([_text_len(v) for v in args[0].values()] + [1])
    elif name == "urlize":
        per_link = sum(_text_len(_param(args, kwargs, i, k)) for i, k in ((2, "target"), (3, "rel")))
        size = len(s) + (text.count(" ") + lines) * per_link
    elif name in ("format", "format_map", "%"):
        vals = list(args) + list(kwargs.values())
        nested = re.search(r"%[-#0 +]*\*|\{[^{}]*\{", text) is not None  # a width taken from the arguments
        widths = [int(d) for d in re.findall(r"\d+", text)]
        if nested:
            widths += [v for v in vals if isinstance(v, int)]
            widths += [v for m in vals if isinstance(m, dict) for v in m.values() if isinstance(v, int)]
        # every field can print the largest argument (a field may name one argument many times)
        largest = max([_printed_len(v) for v in vals] + [0])
        size = len(s) + (text.count("{") + text.count("%")) * largest + max(widths + [0])
    check_length(size, f"'{name}'")


def _check_wrap_work(s: str, width: int) -> None:
    """textwrap cuts a word longer than the width one line at a time, copying the rest of it each time: L²/width
    characters for a word of L."""
    work = 0
    for m in re.finditer(r"\S{%d,}" % (width + 1), s):
        work += (m.end() - m.start()) ** 2 // width
        if work > MAX_COPY_WORK:
            raise ChatTemplateError(f"the chat template's 'wordwrap' would cut words of {len(s):,} characters "
                                    f"into lines of {width}: too slow")


def _precheck_items(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, before it runs, a filter on a sequence whose result would pass the size limit."""
    if name == "batch" and _param(args, kwargs, 1, "fill_with") is not None:
        n = _param(args, kwargs, 0, "linecount")
        check_length(n if isinstance(n, int) else 0, "'batch'")  # a last batch filled up to n items
    elif name == "slice":
        n = _param(args, kwargs, 0, "slices")
        check_length(n if isinstance(n, int) else 0, "'slice'")  # n lists, empty or not
    elif name == "sum" and isinstance(_param(args, kwargs, 1, "start"), (list, tuple)):
        if len(value) * weight(value, _limits.max_chars) > MAX_COPY_WORK:  # each + copies what came before
            raise ChatTemplateError(f"the chat template's 'sum' of {len(value):,} sequences would copy too much")
    elif name == "join":
        sep = _param(args, kwargs, 0, "d", "")
        _precheck("join", str(sep), (list(value),), {})


_ITEM_FILTERS = {"batch", "slice", "sum", "join"}


def _limited_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(f, "_limited", False):
        return f
    first = 1 if hasattr(f, "jinja_pass_arg") else 0  # jinja2 passes the context/environment first to these

    def run(*args: Any, **kwargs: Any) -> Any:
        check_time()
        if len(args) > first:
            value, rest = args[first], args[first + 1:]
            if name in _ITEM_FILTERS:
                if not isinstance(value, (str, bytes, list, tuple, _Range)):  # a generator: measured before use
                    value = list(LimitedSandbox.timed_iter(value))
                    args = (*args[:first], value, *rest)
                _precheck_items(name, value, rest, kwargs)
            elif isinstance(value, (str, bytes)):
                _precheck(name, value, rest, kwargs)
        return check_size(f(*args, **kwargs))

    if first:
        run.jinja_pass_arg = f.jinja_pass_arg  # type: ignore[attr-defined]
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
