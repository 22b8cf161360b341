"""engine/ops/thread_choice.py: a fused pass's thread count follows the passes' measured times, and a pass gives
the same bits on whichever count it runs."""
from __future__ import annotations

import torch

from engine.events import EngineConfig
from engine.generate import load
from engine.ops import thread_choice as tc
from engine.ops.thread_choice import ThreadChoice, ladder
from engine.storage.modelfile import default_model_path


def drive(choice: ThreadChoice, passes: int, cost, n: int = 1, threads: int = 2) -> list[int]:  # type: ignore[no-untyped-def]
    """`passes` passes of size n, each taking cost(count, i) ns on the count the choice picks; the counts used."""
    used = []
    for i in range(passes):
        t = choice.pick(n, threads)
        choice.observe(n, t, cost(t, i))
        used.append(t)
    return used


def test_the_ladder_halves_down_to_one() -> None:
    assert ladder(1) == [1] and ladder(2) == [1, 2] and ladder(6) == [1, 3, 6] and ladder(8) == [1, 2, 4, 8]


def test_it_moves_to_the_faster_count_and_back_when_the_costs_flip() -> None:
    c = ThreadChoice()
    used = drive(c, 400, lambda t, i: 300_000 if t == 2 else 240_000)  # two threads slower (cores apart)
    assert c.current(1) == 1 and c.switches == 1
    assert used.index(1) == tc.EVERY  # measured from the first probe on
    assert used[-100:].count(1) >= 96  # from then on mostly one thread (probes of two excepted)
    used = drive(c, 600, lambda t, i: 190_000 if t == 2 else 235_000)  # the host moves the cores together
    assert c.current(1) == 2 and c.switches == 2
    assert used[-100:].count(2) >= 96


def test_a_bad_count_is_left_after_two_passes_and_probed_ever_more_rarely() -> None:
    c = ThreadChoice()
    used = drive(c, 4000, lambda t, i: 7_000_000 if t == 2 else 11_000_000)  # a large model: two threads pay
    assert c.current(1) == 2 and c.switches == 0
    runs = [i for i in range(1, len(used)) if used[i] == 1 and used[i - 1] == 2]  # each probe's start
    assert all(used[i:i + 3] == [1, 1, 2] for i in runs)  # the dropped pass, one counted pass, back to two
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert gaps == sorted(gaps) and gaps[-1] <= tc.MAX_EVERY + 2 and gaps[0] < gaps[-1]
    assert used.count(1) <= 2 * (len(runs) + 1) and len(runs) <= 8


def test_noise_within_the_margin_keeps_the_count() -> None:
    c = ThreadChoice()
    drive(c, 3000, lambda t, i: (200_000 if t == 2 else 196_000) + (i * 7919) % 5000)  # 2 % apart at most: noise
    assert c.current(1) == 2 and c.switches == 0


def test_each_pass_size_has_its_own_choice_and_a_new_thread_count_starts_over() -> None:
    c = ThreadChoice()
    drive(c, 400, lambda t, i: 300_000 if t == 2 else 240_000, n=1)
    drive(c, 400, lambda t, i: 400_000 if t == 2 else 600_000, n=2)
    assert c.current(1) == 1 and c.current(2) == 2
    assert c.pick(1, 4) == 4 and c.current(1) == 4  # the backend's count changed: all of them first
    assert c.pick(1, 1) == 1


def test_the_step_runs_on_the_chosen_count_with_the_same_bits() -> None:
    eng = load(str(default_model_path()), EngineConfig(n_ctx=64, n_threads=2))
    ids = eng.tokenizer.encode("Hello there")

    def logits() -> torch.Tensor:
        eng.reset()
        eng.runner.forward(ids, eng.cache, logit_rows="last")
        return eng.runner.forward([ids[-1]], eng.cache, logit_rows="last").logits

    logits()  # warm-up
    two = logits()
    step = eng.runner.step
    assert step and step.threads.current(1) == 2
    drive(step.threads, tc.EVERY + tc.PROBE, lambda t, i: 300_000 if t == 2 else 200_000)  # one thread faster
    assert step.threads.current(1) == 1
    one = logits()
    assert step.pass_threads(1) == [1] * len(step.layers)
    assert torch.equal(one, two)
