"""auto's draft depth against every fixed depth, on a simulated engine: known pass costs and acceptance by position,
so the comparison is exact and quick (the engine's own figures are bench/mtp_speedup.py's). The simulator drives
DepthController as SpeculativeDecoder does: choose a depth; at 0 a plain step (with a shadow probe when asked),
else K drafts, a verify of K+1 rows and the chain's accepted prefix (or, for a cost-only re-measurement, a verify of
a stand-in draft). A head that drafts first catches up on the steps since it last ran, as the engine's does."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from engine.speculative import AutoMemory, DepthController, PassCosts, SpecStats, load_memory, save_memory

STEP_S = 0.01
TOKENS = 128  # per reply
REPLIES = 8  # with one engine's memory, as a chat goes
SEEDS = range(4)
NOISE = 0.2  # every timing ×U(0.8, 1.2): a shared host's steps vary that much


@dataclass(frozen=True)
class Engine:
    verify: Callable[[int], float]  # a pass of n rows, in decode steps
    draft: float  # a draft pass, in decode steps
    alphas: tuple[float, ...]  # acceptance at each position, given the drafts before it were accepted
    prior: PassCosts  # what the controller is told before timing anything
    # the head's pass over a row of its backlog, batched, in decode steps (the mid-size MoE 0.013, the embedded
    # model 0.06: its MTP block is one of 9 layers, the mid's one of 25)
    catch_up: float = 0.013


def decode(depth: int | None, e: Engine, seed: int,
           carry: Callable[[AutoMemory], AutoMemory] = lambda m: m) -> float:
    """Tokens per second over REPLIES replies of TOKENS tokens, at `depth` (None: auto); `carry` hands the memory from
    one reply to the next."""
    rng = random.Random(seed)
    memory, tokens, seconds = AutoMemory(), 0, 0.0

    def timed(steps: float) -> float:
        return steps * STEP_S * (1.0 + NOISE * (2.0 * rng.random() - 1.0))

    behind = 0  # steps the head has not seen (its catch-up is timed apart from the drafts, as the engine's)

    def catch_up() -> float:
        nonlocal behind
        # at most CATCH_UP_STEPS: a longer backlog is cut to its latest rows (MTPDrafter.draft's budget)
        dt, behind = timed(min(behind * e.catch_up, DepthController.CATCH_UP_STEPS)), 0
        return dt

    for _ in range(REPLIES):
        stats = SpecStats()
        c = DepthController(depth, stats, memory=memory, costs=e.prior)
        out = 0
        while out < TOKENS:
            k = c.choose(TOKENS - out)
            if k == 0:
                if c.probe_now(TOKENS - out):
                    seconds += catch_up()
                    dt = timed(e.draft)
                    seconds += dt
                    c.observe_probe(float(rng.random() < e.alphas[0]), dt)
                dt = timed(1.0)
                seconds += dt
                c.observe_decode(dt)
                stats.plain_steps += 1
                behind += 1
                out += 1
                continue
            if c.cost_only:  # a stand-in draft, never right: the verify's cost alone
                t_verify = timed(e.verify(2))
                seconds += t_verify
                c.observe_verify(2, t_verify, 0, 0.0)
                behind += 1
                out += 1
                continue
            seconds += catch_up()
            accepted = 0
            while accepted < k and rng.random() < e.alphas[accepted]:
                accepted += 1
            t_draft, t_verify = timed(k * e.draft), timed(e.verify(k + 1))
            seconds += t_draft + t_verify
            stats.record(k, accepted)
            c.observe_verify(k + 1, t_verify, k, t_draft)
            out += accepted + 1
        c.remember()
        memory = carry(memory)
        tokens += out
    return tokens / seconds


MID = PassCosts(routed_share=0.37, n_expert=64, n_used=8, draft=0.14)  # the mid-size MoE's bytes


def flat(p: float) -> tuple[float, ...]:
    return (p,) * 8


ENGINES = {
    # the mid-size MoE, its verify costed as its prior says, at the agreements bench/mtp_speedup.py runs
    **{f"moe-p{p:g}": Engine(MID.verify, 0.15, flat(p), MID) for p in (0.0, 0.6, 0.8, 0.9, 0.99)},
    # a dense model whose verify rows cost a third of the prior's ROW_COMPUTE (wide cores): auto must find K 4-5
    "dense-cheap-rows": Engine(lambda n: 1.0 + 0.03 * (n - 1), 0.17, (0.92, 0.91, 0.77, 0.83) + flat(0.8)[4:],
                               PassCosts(draft=0.17)),
    # and one whose rows cost 4x the prior (a slow core): auto must not go deep
    "dense-costly-rows": Engine(lambda n: 1.0 + 0.4 * (n - 1), 0.17, flat(0.85), PassCosts(draft=0.17)),
    # a model too small to gain (the embedded one: a verify costs 1.6 steps and more): plain decoding wins
    "small": Engine(lambda n: 1.6 + 0.4 * (n - 1), 0.45, flat(0.8), PassCosts(0.34, 16, 4, 0.34), 0.06),
    # the embedded model as measured (bench/results/mtp.json: a 2-row verify with its acceptance and commit ~2.2
    # decode steps, each row more ~0.3, a draft ~0.5), its prior underrating the verify by half
    "embedded": Engine(lambda n: 2.2 + 0.3 * (n - 2), 0.5, (0.95, 0.88, 0.83) + flat(0.8)[3:],
                       PassCosts(0.34, 16, 4, 0.34), 0.06),
}


@pytest.mark.parametrize("name", list(ENGINES))
def test_auto_is_within_five_percent_of_the_best_fixed_depth(name: str) -> None:
    e = ENGINES[name]
    rate = {k: sum(decode(k, e, s) for s in SEEDS) / len(SEEDS) for k in [None, 1, 2, 3, 4, 5, 6, 8]}
    plain = 1.0 / STEP_S
    best = max(plain, *(v for k, v in rate.items() if k is not None))
    assert rate[None] >= 0.95 * best, {k: round(v / plain, 3) for k, v in rate.items()}
    if best == plain:  # where drafting cannot pay, auto costs at most 3 % of plain decoding
        assert rate[None] >= 0.97 * plain


def test_a_memory_kept_in_a_file_between_replies_decodes_as_one_kept_in_the_process(tmp_path: Path) -> None:
    """Every reply's memory written to its file and read back (as a new process of the same model would) leaves
    auto's choices, and so its speed, exactly those of the memory kept in the process."""
    path = tmp_path / "memory.json"

    def through_file(m: AutoMemory) -> AutoMemory:
        save_memory(path, m)
        back = load_memory(path)
        assert back == m
        return back

    for name in ("moe-p0.9", "small"):
        for seed in SEEDS:
            assert decode(None, ENGINES[name], seed, through_file) == decode(None, ENGINES[name], seed), (name, seed)


def test_the_prior_reads_the_model_bytes() -> None:
    """A verify's prior cost grows with the distinct routed experts its rows pick, a dense model's by the rows'
    arithmetic alone; a draft costs the MTP block and the head it reads, over a step's bytes."""
    moe = PassCosts(routed_share=0.4, n_expert=64, n_used=8)
    assert moe.verify(1) == pytest.approx(1.0)
    assert moe.verify(2) == pytest.approx(1.0 + 0.4 * (64 * (1 - (56 / 64) ** 2) / 8 - 1) + 0.1)
    assert PassCosts().verify(5) == pytest.approx(1.4)
    from engine.storage.modelfile import ModelFile, default_model_path

    mf = ModelFile(default_model_path())
    costs = PassCosts.of_model(mf.hparams, {n: t.n_bytes for n, t in mf.tensors.items()})
    assert 0.0 < costs.routed_share < 1.0 and 0.0 < costs.draft < 1.0
    assert (costs.n_expert, costs.n_used) == (mf.hparams.n_expert, mf.hparams.n_expert_used)
