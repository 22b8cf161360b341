"""Training data and held-out evaluation prompts of the embedded default model (engine.training.data)."""
from __future__ import annotations

import random
import re
from functools import lru_cache

import pytest

from engine.chat import Message
from engine.training import data as D

SMALL = dict(n_dialogues=3000, max_bible_chars=150_000, max_doc_chars=150_000)


@lru_cache(maxsize=None)
def small_corpus(seed: int = 0) -> tuple[str, ...]:
    return tuple(D.build_corpus(seed, **SMALL))


@lru_cache(maxsize=None)
def evals() -> tuple[D.EvalItem, ...]:
    return tuple(D.eval_prompts())


# -- ChatML ------------------------------------------------------------------------------------------
def test_chatml_rendering_exact() -> None:
    msgs = [Message("system", "S y"), Message("user", "Q?"), Message("assistant", "A.")]
    assert D.render_chatml(msgs) == (
        "<|im_start|>system\nS y<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\nA.<|im_end|>\n")
    assert D.render_chatml([("user", "hi"), {"role": "assistant", "content": "yo"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n")


_TURN = r"<\|im_start\|>{role}\n(?:(?!<\|im_start\|>|<\|im_end\|>).)+<\|im_end\|>\n"
_DIALOGUE = re.compile(
    "(?:" + _TURN.format(role="system") + ")?"
    "(?:" + _TURN.format(role="user") + _TURN.format(role="assistant") + "){1,3}", re.S)


def test_dialogues_are_chatml_with_one_to_three_turns() -> None:
    docs = list(D.dialogue_documents(5, 400))
    assert all(_DIALOGUE.fullmatch(d) for d in docs)
    turns = {d.count("<|im_start|>user\n") for d in docs}
    assert turns == {1, 2, 3}
    assert any(d.startswith("<|im_start|>system\n") for d in docs)
    assert any(not d.startswith("<|im_start|>system\n") for d in docs)
    assert {s for d in docs for s in D.SYSTEM_PROMPTS if f"system\n{s}<|im_end|>" in d} == set(D.SYSTEM_PROMPTS)
    assert not _DIALOGUE.fullmatch("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>")  # no final \n


# -- determinism -------------------------------------------------------------------------------------
def test_corpus_and_eval_deterministic_for_a_seed() -> None:
    a = D.build_corpus(7, n_dialogues=500, max_bible_chars=20_000, max_doc_chars=20_000)
    b = D.build_corpus(7, n_dialogues=500, max_bible_chars=20_000, max_doc_chars=20_000)
    c = D.build_corpus(8, n_dialogues=500, max_bible_chars=20_000, max_doc_chars=20_000)
    assert a == b
    assert a != c
    assert [(i.kind, i.messages) for i in D.eval_prompts(60, seed=3)] == \
        [(i.kind, i.messages) for i in D.eval_prompts(60, seed=3)]
    assert D.heldout_corpus(seed=1) == D.heldout_corpus(seed=1)


def test_split_is_a_fixed_hash() -> None:
    # Pinned values: a change of salt or hash would silently move questions between the splits.
    assert D.split_value("add:3:4") == pytest.approx(0.4029903885468056, abs=1e-12)
    assert D.split_value("doc:json.dumps") == pytest.approx(0.7609298901038996, abs=1e-12)
    assert D.is_heldout("bible:Genesis 1") and not D.is_heldout("add:3:4")
    assert 0.0 <= D.split_value("x") < 1.0
    share = sum(D.is_heldout(f"k{i}") for i in range(4000)) / 4000
    assert abs(share - D.HELDOUT_FRACTION) < 0.02


# -- checkers ----------------------------------------------------------------------------------------
def _wrong_answers(p: D.Problem) -> list[str]:
    """Plausible but wrong replies to `p`."""
    task = D.TASKS[p.kind]
    exp = task.expected(p.question) if p.kind != "greeting" else None
    if p.kind == "greeting":
        return ["", "   ", "Hello! How can I help you?"]
    if p.kind == "docstring":
        other = next(n for n in sorted(D.doc_pool()) if D.doc_pool()[n][1] != D.doc_pool()[task.parse(p.question)[1]["f"]][1])
        return ["", D.doc_pool()[other][0], "I do not know."]
    if isinstance(exp, list):  # counting sequences
        return ["", ", ".join(map(str, exp[:-1])) + ".", ", ".join(map(str, exp + [exp[-1] + exp[-1] - exp[-2]])),
                ", ".join(str(x + 1) for x in exp)]
    if isinstance(exp, str) and exp in D.WEEKDAYS:
        nxt = D.WEEKDAYS[(D.WEEKDAYS.index(exp) + 1) % 7]
        return ["", f"It is a {nxt}.", f"It is a {exp} or a {nxt}."]
    if isinstance(exp, str) and exp in D.MONTHS:
        nxt = D.MONTHS[(D.MONTHS.index(exp) + 1) % 12]
        return ["", f"It is {nxt}.", f"{exp} or {nxt}."]
    assert isinstance(exp, int), (p, exp)
    return ["", f"The answer is {exp + 1}.", f"{exp - 1}", f"It is {exp}, no, {exp + 10}."]


def _right_variants(p: D.Problem) -> list[str]:
    task = D.TASKS[p.kind]
    out = [p.answer, p.answer.upper(), p.answer.lower(), p.answer.rstrip(".!"), "  " + p.answer + "  \n"]
    if p.kind not in ("greeting", "docstring"):
        exp = task.expected(p.question)
        shown = ", ".join(map(str, exp)) if isinstance(exp, list) else str(exp)
        out += [shown, shown + "!", f"Sure. {shown}."]
    return out


@pytest.mark.parametrize("kind", D.KINDS)
def test_checker_accepts_answers_and_rejects_wrong_ones(kind: str) -> None:
    task = D.TASKS[kind]
    rng = random.Random(kind)
    subs = set()
    for split in ("train", "eval"):
        for _ in range(60):
            p = task.sample(rng, split)
            subs.add(p.sub)
            q, a = task.generate(random.Random(len(subs)), split)
            assert task.check(q, a) and D.is_heldout(D.split_key_of(q)) == (split == "eval")
            for ok in _right_variants(p):
                assert task.check(p.question, ok), (p.question, ok)
            for bad in _wrong_answers(p):
                assert not task.check(p.question, bad), (p.question, bad)
    if kind != "greeting":
        assert subs == {f.sub for f in task.forms}
    assert not task.check("Tell me a joke about cheese.", "Foretell 42 Monday March 1, 2, 3")


def test_number_extraction() -> None:
    assert D.numbers_in("5,000 metres, -40 °C, 12-5 and 42.") == [5000, -40, 12, 5, 42]
    assert D.numbers_in("3, 4, 5") == [3, 4, 5]
    assert D.numbers_in("no digits") == []
    arith = D.TASKS["arithmetic"]
    assert arith.check("What is 12 plus 30?", "12 + 30 = 42")
    assert arith.check("What is 12 plus 30?", "The answer is 42!")
    assert not arith.check("What is 12 plus 30?", "The answer is 43.")
    assert not arith.check("What is 12 plus 30?", "42 + 1 = 43")
    assert D.TASKS["units"].check("Convert 5 km to metres.", "That is 5,000 metres.")
    assert D.TASKS["units"].check("What is -40 °C in Fahrenheit?", "-40 °F")
    assert not D.TASKS["units"].check("What is -40 °C in Fahrenheit?", "40 °F")


def test_month_checker_is_not_fooled_by_may_as_a_word() -> None:
    dates = D.TASKS["dates"]
    assert dates.check("What month comes after March?", "April, you may say.")
    assert not dates.check("What month comes after March?", "April or May.")
    assert dates.check("What month comes after April?", "may")
    assert not dates.check("What month comes after May?", "It may be July.")
    assert dates.check("What month comes after May?", "The month after May is June.")
    assert dates.check("What month comes after April?", "May.")


# -- held-out evaluation set -------------------------------------------------------------------------
def test_eval_set_size_and_coverage() -> None:
    items = evals()
    assert len(items) >= 200
    assert {i.kind for i in items} == set(D.KINDS)
    counts = {k: sum(i.kind == k for i in items) for k in D.KINDS}
    assert min(counts.values()) >= 30, counts
    assert {i.kind for i in items[:len(D.KINDS)]} == set(D.KINDS)  # interleaved: any prefix covers the kinds
    assert len({D.render_chatml(i.messages) for i in items}) == len(items)
    assert any(i.messages[0].role == "system" for i in items)
    assert any(sum(m.role == "user" for m in i.messages) == 2 for i in items)
    for i in items:
        assert i.messages[-1].role == "user" and i.messages[-1].content == i.question
        assert D.is_heldout(i.checker_args["key"])
        assert i.check(i.checker_args["reference"]), i
        assert not i.check("")


def test_eval_questions_never_in_training_corpus() -> None:
    items = evals()
    corpus = small_corpus()
    D.assert_disjoint(corpus, items)
    # Keys: over many training dialogues (this covers the small key spaces completely), none is held out.
    rng = random.Random(0)
    train_keys = set()
    for _ in range(20_000):
        _, problems = D.make_dialogue(rng, "train")
        train_keys.update(p.key for p in problems)
    eval_keys = {D.split_key_of(m.content) for i in items for m in i.messages if m.role == "user"}
    assert not train_keys & eval_keys
    assert {k.split(":")[0].split("-")[0] for k in train_keys} >= {"add", "sub", "mul", "letters", "letter", "range", "day",
                                                     "between", "month", "conv", "doc", "greet"}


def test_disjointness_check_can_fail() -> None:
    items = evals()
    corpus = list(small_corpus())
    q = items[0].question
    with pytest.raises(AssertionError):
        D.assert_disjoint(corpus + [D.render_chatml([Message("user", q), Message("assistant", "x")])], items)
    long_q = next(i.question for i in items if len(i.question) >= 12)
    with pytest.raises(AssertionError):
        D.assert_disjoint(corpus + [f"some text {long_q} more text"], items)


def test_heldout_corpus_not_in_training() -> None:
    held = D.heldout_corpus()
    assert {s for s, _ in held} == {"dialogue", "bible", "stdlib"}
    blob = "\x00".join(small_corpus())
    for src, text in held:
        if src == "bible":
            assert text.split("\n", 1)[1][:200] not in blob
    train_bible = {d.split("\n", 1)[0].split(":")[0] for d in D.bible_documents("train")}
    eval_bible = {d.split("\n", 1)[0].split(":")[0] for d in D.bible_documents("eval")}
    assert eval_bible and not train_bible & eval_bible


# -- sources ---------------------------------------------------------------------------------------
def test_bible_source() -> None:
    verses = D.kjv_verses()
    assert len(verses) == 31103
    docs = list(D.bible_documents("train")) + list(D.bible_documents("eval"))
    assert sum(len(d) for d in docs) > 4_000_000
    assert all(0 < len(d) <= 1500 + 200 for d in docs)
    gen1 = next(d for d in docs if d.startswith("Genesis 1:1-"))
    assert "In the beginning God created the heaven and the earth." in gen1


def test_stdlib_source() -> None:
    docs = list(D.stdlib_documents("train"))
    assert len(docs) == len(D.STDLIB_MODULES)
    json_doc = next(d for d in docs if d.startswith("Module json\n"))
    assert "json.dumps(" in json_doc and "Serialize obj to a JSON formatted str" in json_doc.replace("``", "")
    assert " at 0x" not in "".join(docs)
    assert docs == list(D.stdlib_documents("train"))
    pool = D.doc_pool()
    assert len(pool) >= 150
    assert pool["json.dumps"][1] == "serialize obj to a json formatted"
    # every docstring question's function has its docstring in the training docs
    blob = "\n".join(docs)
    for name in pool:
        mod, _, member = name.rpartition(".")
        assert f"{name}(" in blob or f"class {name}" in blob, name


def test_corpus_mix_follows_the_amounts() -> None:
    stats = D.corpus_stats(small_corpus())
    assert set(stats["sources"]) == {"dialogue", "bible", "stdlib"}
    assert stats["sources"]["dialogue"]["docs"] == SMALL["n_dialogues"]
    assert stats["sources"]["bible"]["chars"] <= SMALL["max_bible_chars"]
    assert stats["sources"]["stdlib"]["chars"] <= SMALL["max_doc_chars"]
    only = D.build_corpus(0, n_dialogues=50, max_bible_chars=0, max_doc_chars=0)
    assert len(only) == 50 and all(d.startswith("<|im_start|>") for d in only)


def test_commonest_greetings_are_trained_on() -> None:
    train = set(D._greetings_by_split("train"))
    assert {"Hi", "Hi!", "Hello!", "Hey!", "Who are you?", "What can you do?", "Hello, who are you?"} <= train
    assert not train & set(D._greetings_by_split("eval"))
    # a held-out opener or follow-up never occurs in any training greeting
    eval_parts = {p for q in D._greetings_by_split("eval") for p in D.greeting_pool()[q][1].split("&")
                  if D.is_heldout(p)}
    assert eval_parts
    assert not any(set(D.greeting_pool()[q][1].split("&")) & eval_parts for q in train)


def test_phrasing_split_trains_every_fact_and_keeps_one_phrasing_for_evaluation() -> None:
    """Memorised facts are held out by phrasing: each fact is trained in all but one of its templates, and
    the evaluation asks it in exactly that one."""
    for kind in ("arithmetic", "counting", "dates", "units", "docstring"):
        task = D.TASKS[kind]
        rng = random.Random(f"phrasing:{kind}")
        seen: dict[str, dict[str, set[int]]] = {}
        for split in ("train", "eval"):
            for _ in range(400):
                p = task.sample(rng, split)
                if "@q" not in p.key:
                    continue
                fact, _, tpl = p.key.rpartition("@q")
                i, n = (int(v) for v in tpl.split("/"))
                assert n >= 2 and (i == D.reserved_template(fact, n)) == (split == "eval")
                seen.setdefault(split, {}).setdefault(fact, set()).add(i)
        assert seen.get("eval"), kind  # every kind has phrasing-split sub-kinds
        for fact, tpls in seen["eval"].items():
            assert len(tpls) == 1
    # operand-split problems never put a held-out operand pair into training, whatever the phrasing
    arith = D.TASKS["arithmetic"]
    assert D.is_heldout(arith.key_of("What is 17 minus 3?")) == D.is_heldout(arith.key_of("Calculate 17 - 3."))
