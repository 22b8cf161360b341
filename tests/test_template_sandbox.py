"""Chat-template limits inside every callable the sandbox exposes (issue 48): a template calling `lipsum(n=10**7)` ran
unbounded. Each hostile template below must end in a one-line ChatTemplateError within the time limit and without
the memory it asks for; ordinary templates render exactly as in jinja2's own sandbox."""
from __future__ import annotations

import time
import tracemalloc

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.chat import ChatFormat, Message
from engine.errors import ChatTemplateError
from engine.generate import text_side
from engine.storage.modelfile import open_model
from engine.template_sandbox import TIME_LIMIT_S, LimitedSandbox, limits
from tests.fixtures import TINY_MOE, fixture_path

NS = "{% set ns = namespace(x=X) %}{% for i in range(80) %}{% set ns.x = STEP %}{% endfor %}{{ ns.x | length }}"


def grows(start: str, step: str) -> str:
    """A value grown in a loop (through a namespace: the only thing a template can reassign across iterations)."""
    return NS.replace("X", start).replace("STEP", step)


HOSTILE = {
    "lipsum n": "{{ lipsum(n=10**7) }}",
    "lipsum positional": "{{ lipsum(10**7, False) }}",
    "lipsum words": "{{ lipsum(1, False, 5, 10**9) }}",
    "range past a C size": "{{ range(2**64) | list }}",
    "range huge": "{{ range(0, 10**30) | length }}",
    "batch fill": "{{ [1] | batch(10**9, 0) | list }}",
    "slice count": "{{ [1] | slice(10**9) | list }}",
    "wordwrap long word": "{{ ('a' * 1000000) | wordwrap(1) }}",
    "wordwrap wrapstring": "{{ ('a ' * 100000) | wordwrap(2, wrapstring='x' * 1000) }}",
    "indent string": "{{ ('a\\n' * 100000) | indent('x' * 1000) }}",
    "urlize target": "{{ ('http://a.io ' * 10000) | urlize(target='x' * 100000) }}",
    "format repeated field": "{{ ('{0}' * 1000).format('x' * 1000000) }}",
    "format filter repeated": "{{ ('%s' * 1000) | format(*(['x' * 100000] * 1000)) }}",
    "translate": "{{ ('a' * 1000000).translate({97: 'b' * 1000000}) }}",
    "to_bytes": "{{ (1).to_bytes(10**9, 'big') }}",
    "bytes padding": "{{ 'a'.encode().center(10**10) }}",
    "bytes format": "{{ '%10000000000d'.encode() % 1 }}",
    "str join of a generator": "{{ ('x' * 1000000).join(range(100000) | map('string')) }}",
    "join filter of a string": "{{ ('x' * 1000000) | join('y' * 1000000) }}",
    "join filter of a generator": "{{ range(100000) | map('string') | join('x' * 1000000) }}",
    "map to a padding filter": "{{ ['a'] | map('center', 10**9) | list }}",
    "sum of lists": "{{ ([[1] * 1000] * 1000) | sum(start=[]) | length }}",
    "tojson indent": "{{ [1, [2]] | tojson(indent=10**9) }}",
    "strftime": "{{ strftime_now('%c' * 2000000) }}",
    "dict call": "{{ dict(a='x' * 3000000, b='y' * 3000000) | length }}",
    "repeat a nested list": "{% set a = ['x' * 1000] * 1000 %}{{ ([a] * 1000) | length }}",
    "integer squaring": grows("3", "ns.x * ns.x"),
    "nested literal doubling": grows("[1]", "[ns.x, ns.x]"),
    "nested dict doubling": grows("{}", "{'a': ns.x, 'b': ns.x}"),
    "nested tuple doubling": grows("(1,)", "(ns.x, ns.x)"),
    "block text doubling": NS.replace("X", "'ab'").replace("{% set ns.x = STEP %}",
                                                          "{% set ns.x %}{{ ns.x }}{{ ns.x }}{% endset %}"),
    "macro doubling": "{% macro d(x) %}{{ x }}{{ x }}{% endmacro %}" + grows("'ab'", "d(ns.x)"),
    "list concatenation doubling": grows("[1]", "ns.x + ns.x"),
    "namespace holding copies": "{% set b = 'x' * 3000000 %}{% set ns = namespace() %}{% set ns.a = b %}"
                                "{% set ns.b = b %}{{ ns }}",
    "deep comparison": "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(80) %}{% set ns.a = [ns.a, ns.a] %}"
                       "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
    "silent nested loops over lists": "{% set x = range(100000) | list %}{% for a in x %}{% for b in x %}"
                                      "{% endfor %}{% endfor %}",
    "silent loop with a test": "{% set x = range(100000) | list %}{% for a in x %}{% for b in x if b is odd %}"
                               "{% endfor %}{% endfor %}",
}


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return text_side(open_model(fixture_path(TINY_MOE)))[0]


@pytest.mark.parametrize("src", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_templates_hit_a_limit(tok, src: str) -> None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(ChatTemplateError) as e:
            ChatFormat(src, tok).render([Message("user", "hi")])
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert str(e.value) and "\n" not in str(e.value)
    assert time.perf_counter() - t0 < TIME_LIMIT_S + 5
    assert peak < 200 * 2 ** 20  # never the gigabytes the template asked for


ORDINARY = [
    "{{ lipsum(2, False, 5, 10) | length > 0 }}",
    "{{ [1, 2, 3, 4, 5] | batch(2, 0) | list }} {{ [1, 2, 3] | slice(2) | list }}",
    "{{ 'the quick brown fox jumps' | wordwrap(10) }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\nb' | indent('> ') }}",
    "{{ {'a': [1, {'b': 'c'}]} | tojson }} {{ {'a': [1, 2]} | tojson(indent=2) }}",
    "{% set ns = namespace(n=0, xs=[]) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% set ns.xs = ns.xs + [m.role] %}{% endfor %}{{ ns.n }} {{ ns.xs }}",
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% if loop.last %}!{% endif %} {% endfor %}",
    "{% for x in [1, [2, [3]]] recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}{{ x }}{% endif %}"
    "{% endfor %}",
    "{% macro m(x) %}<{{ x }}>{% endmacro %}{% set b %}{{ m('a') }}{{ m('b') }}{% endset %}{{ b }}",
    "{{ 'see http://a.io now' | urlize(target='_blank') }}",
    "{{ [1, 2, 3] | map('string') | join(',') }} {{ ', '.join(['a', 'b']) }} {{ [[1], [2]] | sum(start=[]) }}",
    "{{ '%s-%s' | format('a', 'b') }} {{ '{0}-{0}-{1}'.format('a', 'b') }} {{ '%05d' % 42 }}",
    "{{ 'abc'.translate({97: 'xy'}) }} {{ (258).to_bytes(2, 'big') | list }} {{ 12 * 34 }} {{ 'ab' * 3 }}",
    "{% for k, v in {'a': 1, 'b': 2} | dictsort %}{{ k }}={{ v }};{% endfor %}{% set a, b = 1, 2 %}{{ a + b }}",
    "{{ (messages | map(attribute='content') | list)[::-1] }} {{ range(3) | list }} {{ dict(a=1) }}",
    "{{ 'x' | center(9) }}|{{ 'é' * 3 }}|{{ 'a\\tb'.expandtabs(4) }}|{{ 'aaa'.replace('a', 'bb', 2) }}",
    "{{ 'a\\tb'.encode().expandtabs(4) }} {{ '%d'.encode() % 7 }} {{ 'ab'.encode().replace('a'.encode(), 'x'.encode()) }}",
]


@pytest.mark.parametrize("src", ORDINARY)
def test_ordinary_templates_render_as_jinja2_does(src: str) -> None:
    ctx = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(src).render(**ctx)
    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
    with limits():
        ours = "".join(env.from_string(src).generate(**ctx))
    assert ours == plain


def test_tojson_writes_what_json_dumps_writes(tok) -> None:  # type: ignore[no-untyped-def]
    import json

    msgs = [{"role": "assistant", "content": "é", "tool_calls": [{"name": "f", "arguments": {"q": [1.5, None, True],
                                                                                          "n": {}}}]}]
    src = "{{ messages | tojson }}|{{ messages | tojson(indent=2) }}|{{ messages | tojson(indent='\\t') }}"
    want = [json.dumps(msgs, ensure_ascii=False, indent=i) for i in (None, 2, "\t")]
    assert ChatFormat(src, tok).render(msgs, add_generation_prompt=False) == "|".join(want)
