"""Speculation statistics, and the draft depth of each step: fixed, or `auto` from acceptance and measured costs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from engine.events import MAX_DRAFT, SpeculativeStats, SpeculativeTimes
from engine.storage.modelfile import HParams

ROW_COMPUTE = 0.1  # each verify row past the first, in decode steps, beside its weight bytes: the products' arithmetic
# (bench/results/mtp_speedup.json, mid-size MoE, 2 cores AVX512-VNNI: verifies of 2, 3, 4 rows cost 1.3-1.4, 1.6-1.7,
# 1.8-1.9 steps, the bytes alone 1.3, 1.6, 1.9). Only a prior: auto replaces it with the times it measures.


@dataclass(frozen=True)
class PassCosts:
    """A model's verify and draft passes in decode steps, before any is timed: from the weight bytes each reads (a
    verify of n rows reads the distinct routed experts its rows pick, expected E·(1 − (1 − k/E)^n) of E with k per
    row, and the rest once) plus ROW_COMPUTE per extra row; a draft, the MTP block and the output head it reads.
    auto starts from these and scales them by what it measures (DepthController._extrapolate)."""

    routed_share: float = 0.0  # a decode step's bytes in routed experts (0: dense)
    n_expert: int = 0
    n_used: int = 0
    draft: float = 0.15

    # verify(n) for n = 1 … MAX_DRAFT + 1: auto weighs every depth at each new piece of evidence
    _table: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_table", tuple(self._verify(n) for n in range(MAX_DRAFT + 2)))

    def verify(self, n: int) -> float:
        return self._table[n] if n < len(self._table) else self._verify(n)

    def _verify(self, n: int) -> float:
        if not self.n_expert:
            return 1.0 + ROW_COMPUTE * (n - 1)
        distinct = self.n_expert * (1.0 - (1.0 - self.n_used / self.n_expert) ** n) / self.n_used
        return 1.0 + self.routed_share * (distinct - 1.0) + ROW_COMPUTE * (n - 1)

    @classmethod
    def of_model(cls, hp: HParams, tensor_bytes: Mapping[str, int], draft_head: int | None = None) -> "PassCosts":
        """From a file's tensor sizes: the bytes a decode step reads (the trunk's layers, a routed expert stack at
        k/E, the output head) and a draft pass (the MTP block likewise, and the head's bytes a draft reads:
        `draft_head`, ops.draft_read_bytes, where known, else the whole head it uses)."""
        used = hp.n_expert_used / hp.n_expert if hp.n_expert else 1.0
        head = tensor_bytes.get("output.weight") or tensor_bytes.get("token_embd.weight", 0)  # tied: the embeddings
        own_head = head
        step = routed = draft = 0.0
        for name, n in tensor_bytes.items():
            if not name.startswith("blk.") or "nextn.embed_tokens" in name:  # a lookup reads one row
                continue
            if "nextn.shared_head_head" in name:  # the block's own head, where it has one
                own_head = n
                continue
            read = n * used if "_exps." in name else n
            if int(name.split(".")[1]) < hp.n_layer:
                step += read
                routed += read if "_exps." in name else 0.0
            else:
                draft += read
        step += head
        if step <= 0:
            return cls()
        return cls(routed / step, hp.n_expert, hp.n_expert_used,
                   (draft + (own_head if draft_head is None else draft_head)) / step)


@dataclass
class SpecStats:
    """Counters for Stats events: how much speculation is helping."""

    steps: int = 0  # verify passes
    plain_steps: int = 0  # steps decoded without drafting (auto chose depth 0)
    drafted: int = 0
    accepted: int = 0
    tried_at: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)
    accept_hist: list[int] = field(default_factory=lambda: [0] * (MAX_DRAFT + 1))
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    decode_s: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for i in range(min(drafted, accepted + 1)):
            self.tried_at[i] += 1
            self.accepted_at[i] += int(i < accepted)
        self.accept_hist[accepted] += 1

    def acceptance_by_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_at, self.tried_at)]

    def mean_accepted(self) -> float:
        """Tokens emitted per verify pass (accepted drafts + the trunk's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def snapshot(self) -> SpeculativeStats:
        return SpeculativeStats(
            drafted=self.drafted, accepted=self.accepted,
            acceptance=self.accepted / self.drafted if self.drafted else 0.0,
            acceptance_by_depth=self.acceptance_by_depth(), tried_by_depth=list(self.tried_at),
            accepted_by_depth=list(self.accepted_at), mean_accepted_length=self.mean_accepted(),
            accepted_length_histogram=list(self.accept_hist), verify_steps=self.steps, plain_steps=self.plain_steps,
            plain_tok_s=self.plain_steps / self.decode_s if self.decode_s > 0 else 0.0,
            time_s=SpeculativeTimes(self.draft_s, self.verify_s, self.commit_s, self.decode_s))


@dataclass
class AutoMemory:
    """What `auto` learned on earlier replies of the same engine: step costs and acceptance by depth
    (halved at every reply that drafted, so it follows a change of topic). Chat replies are short; without it
    every reply would spend its first steps measuring again."""

    t_decode: float | None = None
    t_verify: dict[int, float] = field(default_factory=dict)
    verify_timings: dict[int, float] = field(default_factory=dict)  # the timings behind each t_verify
    t_draft: float | None = None
    accepted_at: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT)
    tried_at: list[float] = field(default_factory=lambda: [0.0] * MAX_DRAFT)
    since_probe: int = 0  # plain steps since the last probe, counted across replies (most are short)
    quiet: int = 0  # plain steps still to take without weighing, likewise (DepthController._quiet)
    probe_misses: int = 0  # shadow probes in a row whose draft missed (they space the next ones out)
    remeasures_plain: int = 0  # re-measured depth-1 steps in a row that left plain decoding faster (likewise)
    beyond_reach: bool = False  # the last of them found every depth clearly slower (DepthController.DORMANT_MARGIN)
    compared: int = 0  # drafts at depth 1 ever compared with the trunk's token (not halved: ends the early probes)
    yardsticks_kept: int = 0  # plain steps in a row, taken while drafting, that found the decode cost unchanged
    below_cut: tuple[float, float] = (0.0, 0.0)  # drafts under the break-even cut in uncut chains: tried, accepted


class DepthController:
    """Chooses the draft depth each step: fixed, or `auto` from running acceptance and measured costs.

    auto maximises expected tokens per second, E(K) / C(K) with E(K) = 1 + Σ_{i≤K} Π_{j≤i} α_j (α_j the
    acceptance at depth j, smoothed towards α_{j−1}) and C(K) = verify(K+1) + K·draft (verify: the pass of K+1 rows,
    acceptance and commit, as a plain step's time holds its sampling and bookkeeping), against plain decoding
    (K = 0, E = 1). A verify size not yet timed is costed from the model's bytes (PassCosts), scaled by the sizes
    that were (_extrapolate). The first EARLY_PROBES plain steps after decoding is measured each draft one token as
    a shadow probe (compared with the trunk's own token, no verify pass). While depth 0 wins, every `probe_every`
    plain steps (counted across replies; doubled up to 8× while probes keep missing) either probe again, so
    acceptance can recover at the cost of one head pass, or — when drafts do match and only the costs say no — take
    one real step at depth 1 whose verify time replaces the old one (doubled up to 8× likewise while those steps
    keep confirming plain decoding). While drafting wins, every `probe_every`-th step runs plain, so the decode cost
    it is weighed against stays current (doubled up to 8× while those steps find it unchanged). Where evidence is
    thin it explores: shadow probes every THIN_GAP plain steps until THIN_EVIDENCE drafts were compared, one draft
    deeper than the best now and then while that depth has few tries, and drafting wins a near tie (TIE_SLACK) —
    each only where a draft always right could pay.
    """

    FIRST_DECODES = 2  # plain steps measured before the first draft (the first one alone runs cold)
    # Probes that keep missing double the interval up to this many times (32 → 256 plain steps): a model whose
    # drafts never match pays ~1/8 of the probes, and one hit brings the interval straight back.
    MAX_PROBE_BACKOFF = 3
    # Shadow probes on every plain step until this many drafts at depth 1 were compared: one early miss (or hit) must
    # not decide a reply (a first miss kept auto plain for ~100 steps of a head that agrees 9 times in 10).
    EARLY_PROBES = 4
    TIE_SLACK = 0.05  # choose() drafts at a rate within 5 % below plain decoding's while depth 2 is little tried
    # (and a deeper chain could beat plain decoding)
    DEEPER_EVERY, DEEPER_EVIDENCE = 4, 8  # every 4th drafting step one deeper, while that depth has < 8 tries
    # a verify or draft pass timed above 1.5x its expected cost (another tenant took the core, a page fault) counts as 1.5x
    SPIKE = 1.5
    THIN_EVIDENCE, THIN_GAP = 16, 4  # below 16 compared drafts, a shadow probe every 4th plain step (_probe_gap)
    CUT_EXPLORE = 4  # every 4th speculative step of auto drafts its whole chain (chain_p_min)
    CUT_EVIDENCE = 4  # drafts below the cut seen before their acceptance decides whether to cut
    YARDSTICK_TOLERANCE = 0.1  # a plain step taken while drafting within this share of the decode cost: unchanged
    PRIOR_WEIGHT = 1.0  # the prior's verify cost counts as this many timings (_verify_cost)
    # Where the last re-measurement found every depth at least DORMANT_MARGIN slower than plain decoding at the
    # acceptance seen (the embedded model: a 2-row verify costs ~2.2 decode steps, the best depth ~x0.8), they
    # measure the verify alone (cost_only) and quadruple the interval, up to 2,048 plain steps: one with the head
    # costs its catch-up over the steps since the last (~6 % of them on the embedded model), a draft and a verify.
    DORMANT_BACKOFF = 6
    DORMANT_MARGIN = 0.1
    # The head's catch-up on the plain steps since it last ran costs at most this many decode steps: a longer backlog
    # is cut to its latest rows (MTPDrafter.draft's budget), so a probe or re-measurement after a long plain stretch
    # costs what one after a short stretch does.
    CATCH_UP_STEPS = 4.0
    # Plain steps in a row that choose() takes without weighing anything, where no probe or re-measurement can fall
    # due among them: between probes nothing but the decode cost's average moves, and weighing it every step cost
    # ~6 us of the embedded model's ~0.2 ms step (auto at x0.94 of MTP off there).
    QUIET_STEPS = 16

    def __init__(self, depth: int | None, stats: SpecStats, p_min: float = 0.75, probe_every: int = 32,
                 reproducible: bool = False, memory: AutoMemory | None = None, costs: PassCosts = PassCosts()):
        if depth is not None and not 1 <= depth <= MAX_DRAFT:
            raise ValueError(f"draft depth must be 1..{MAX_DRAFT} or auto")
        self.fixed = depth
        self.stats = stats
        self.p_min = 0.0 if depth is not None else p_min
        self.probe_every = probe_every
        self.reproducible = reproducible  # timings vary run to run; seeded sampling must not depend on them
        self.costs = costs  # the prior: what each pass should cost, in decode steps
        self.t_decode: float | None = 1.0 if reproducible else None
        self.t_verify: dict[int, float] = {}
        self.t_draft: float | None = costs.draft if reproducible else None
        if reproducible:  # the prior alone decides
            self.t_verify = {n: costs.verify(n) for n in range(2, MAX_DRAFT + 2)}
        # Seeded sampling must not depend on earlier replies either: no memory then.
        self.memory = None if reproducible or depth is not None else memory
        if self.memory is not None:
            m = self.memory
            self.t_decode, self.t_verify, self.t_draft = m.t_decode, dict(m.t_verify), m.t_draft
            self._prior_acc = [a / 2 for a in m.accepted_at]
            self._prior_tried = [t / 2 for t in m.tried_at]
        else:
            self._prior_acc = [0.0] * MAX_DRAFT
            self._prior_tried = [0.0] * MAX_DRAFT
        self._since_probe = self.memory.since_probe if self.memory is not None else 0
        # plain steps choose() still takes without weighing (_quiet_steps), carried across replies as since_probe is:
        # a reply's first step weighed every depth anew (~13 tokens a reply on the embedded model: auto at x0.95)
        self._quiet = self.memory.quiet if self.memory is not None else 0
        self._quiet_now = False  # this step is one of them: no probe either
        self._misses = self.memory.probe_misses if self.memory is not None else 0
        self._stays = self.memory.remeasures_plain if self.memory is not None else 0
        self._beyond = self.memory.beyond_reach if self.memory is not None else False
        self._compared = max(self.memory.compared, int(self.memory.tried_at[0])) if self.memory is not None else 0
        self._remeasure = False  # this step re-measures a verify cost that kept auto plain
        # the timings behind each t_verify (what _verify_cost weighs against the prior), the memory's
        # not halved as acceptance is: a pass's cost does not change with the topic (halved, a size re-measured every
        # ~20 replies weighed 1/2^20 against the prior, which on the embedded model said a verify costs half what
        # it does, and auto kept re-measuring it)
        self._timings = dict(self.memory.verify_timings) if self.memory is not None else {}
        self._once: set[int] = set()  # verify sizes timed once in this reply, not remembered: maybe a cold first pass
        self._drafting = 0  # steps in a row at depth ≥ 1 (every yardstick_interval()-th runs plain, re-measuring it)
        self._counts = (stats.drafted, stats.accepted)  # at the last weighing (_whole_chain)
        self._kept = self.memory.yardsticks_kept if self.memory is not None else 0
        self._yardstick = False  # this plain step re-measures decoding while drafting
        self._costs = 0  # bumped when a verify or draft cost changes (what _best_depth keeps depends on them)
        self._best_key: tuple | None = None
        self._best: tuple[int, float] = (0, 0.0)
        self._vc_key: tuple | None = None  # _verify_cost's figures, by size, and what they hold for
        self._vc: dict[int, float] = {}
        self._alpha_key: tuple | None = None
        self._alpha: list[float] = []
        self._decodes = 0
        self._cold = False  # t_decode is a reply's cold first step
        self._drafts = 0
        self._draft_cold = False  # t_draft is a reply's cold first draft pass
        self._chains = 0  # speculative steps of auto
        self._cut = 0.0  # this step's break-even cut
        self._explore_cut = False  # this step drafts its whole chain (chain_p_min)
        # drafts below the cut in the uncut chains, and those accepted (the memory's halved, as acceptance is)
        self._low_tried, self._low_acc = (t / 2 for t in self.memory.below_cut) if self.memory is not None else (0, 0)
        self._probe_acc = 0.0  # shadow probes (depth 1): drafts compared with the trunk's own next token
        self._probe_tried = 0

    def remember(self) -> None:
        """Fold this reply's costs and acceptance into the engine's memory (call when the reply ends)."""
        if self.memory is None:
            return
        m = self.memory
        m.t_decode, m.t_draft = self.t_decode, self.t_draft
        m.t_verify = dict(self.t_verify)
        m.verify_timings = dict(self._timings)
        if self._probe_tried or any(self.stats.tried_at):
            # halved as new evidence comes, not with every reply: replies decoded plain would otherwise fade what
            # auto knows to nothing (a reply of the embedded model runs ~13 steps), and it would re-learn it each
            # time at the cost of the head's catch-up
            m.accepted_at, m.tried_at = self._evidence()
        m.since_probe = self._since_probe
        m.quiet = self._quiet
        m.probe_misses = self._misses
        m.remeasures_plain = self._stays
        m.beyond_reach = self._beyond
        m.compared = self._compared_total()
        m.yardsticks_kept = self._kept
        m.below_cut = (self._low_tried, self._low_acc)

    @staticmethod
    def _ema(old: float | None, new: float, a: float = 0.2) -> float:
        return new if old is None else (1 - a) * old + a * new

    def observe_decode(self, seconds: float) -> None:
        if self.reproducible:
            return
        if self._yardstick and self.t_decode is not None:  # one that agrees spaces the next out, one that differs not
            self._kept = self._kept + 1 if abs(seconds - self.t_decode) <= self.YARDSTICK_TOLERANCE * self.t_decode \
                else 0
        self._yardstick = False
        self._decodes += 1
        if self._decodes == 1:
            # the first step after a prefill runs cold: it stands in only where nothing is known, and the next step
            # replaces it (a cold figure could make drafting look worth it, and while drafting nothing corrects it)
            if self.t_decode is None:
                self.t_decode, self._cold = seconds, True
        elif self._cold:
            # not the faster of the two either: on a shared host that picks a quiet moment's step, and every verify
            # timed later looks dear against it (the mid MoE stayed plain where depth 3 gained a quarter)
            self.t_decode, self._cold = seconds, False
        else:  # one slow step (a page fault, the collector) counts at most double: an outlier taken whole made
            # drafting look worth it for hundreds of steps, as drafting steps re-measure plain ones only now and then
            self.t_decode = self._ema(self.t_decode, min(seconds, 2.0 * self.t_decode))  # type: ignore[operator]

    def observe_verify(self, n: int, seconds: float, n_drafts: int, draft_seconds: float,
                       draft_faulted: bool = False) -> None:
        if self.reproducible:
            return
        # a re-measurement replaces the old figure: it was the one that kept auto plain (often a cold first pass)
        # ... and so does the second timing of a size: its first pass may have run cold
        self._quiet = 0  # new evidence is weighed at the next step
        replace = self._remeasure or n in self._once
        if n not in self.t_verify:
            self._once.add(n)
        else:
            self._once.discard(n)
        if not replace and self.t_decode is not None:  # one slow pass counts at most SPIKE × what was expected
            seconds = min(seconds, self.SPIKE * self._verify_cost(n))
        self.t_verify[n] = seconds if replace else self._ema(self.t_verify.get(n), seconds)
        self._timings[n] = 1.0 if replace else self._timings.get(n, 0.0) + 1.0
        self._costs += 1
        if n_drafts:
            self._observe_draft(draft_seconds / n_drafts, draft_faulted)
        if self._remeasure and self.t_decode is not None and self.t_draft is not None:
            # one that confirms plain decoding spaces the next out (each costs the head's catch-up over the plain
            # steps since the last and a verify): drafts that match on a model too small to gain from them
            depth1 = (1.0 + self._alphas()[0]) / (self._verify_cost(n) + self.t_draft)
            self._stays = self._stays + 1 if depth1 <= 1.0 / self.t_decode else 0
            # judged here, where the decode cost and the verify's are fresh: between re-measurements the decode cost
            # moves with the host's load and the verify's does not
            self._beyond = self._stays > 0 and \
                self._best_depth(MAX_DRAFT)[1] < (1.0 - self.DORMANT_MARGIN) / self.t_decode
        self._remeasure = False

    def choose(self, room: int) -> int:
        """Depth for the next step, given `room` free positions in the context after the next token."""
        if self.fixed is not None:
            return max(0, min(self.fixed, room))
        if self._quiet:
            self._quiet -= 1
            self._quiet_now = True
            self._since_probe += 1
            return 0
        self._quiet_now = False
        if self.t_decode is None or (self.memory is None or self.memory.t_decode is None) and \
                0 < self._decodes < self.FIRST_DECODES:
            return 0  # measure plain decoding first
        if self.t_draft is None:
            return 0  # a shadow probe (`probe_now`) measures the draft cost and first acceptance
        k_draft, rate = self._best_depth(room)
        whole = self._whole_chain()
        # near break-even, while depth 2 has few tries, drafting wins the tie: what it costs if wrong is at most the
        # slack, and its verifies learn the deeper acceptance plain steps never see (a head right 8 times in 10 at
        # the first draft and 9 in 10 past it sat at plain decoding where depth 4 gained 28 %)
        plain = 1.0 / self.t_decode
        # the tie's conditions are weighed only where they can decide (choose runs every step: on the embedded model
        # working them out each plain step cost ~10 % of its speed)
        near = (1.0 - self.TIE_SLACK) * plain < rate <= plain
        slack = self.TIE_SLACK if near and self._evidence()[1][1] < self.DEEPER_EVIDENCE and not self.reproducible \
            and k_draft < min(MAX_DRAFT, room) and self._deeper_could_pay(k_draft, plain) else 0.0
        best_k = k_draft if rate > (1.0 - slack) * plain else 0
        if best_k == 0:
            self._since_probe += 1
            if (self._since_probe >= self._remeasure_interval() or self._first_timing_due()) and \
                    room >= 1 and not self.reproducible and self._alphas()[0] >= 0.5:
                # Drafts do match, only the measured costs say no: re-measure them with one real step at depth 1
                # instead of a shadow probe (a first verify runs cold and can keep auto plain for good); spaced out
                # while re-measurements keep confirming plain decoding, and soon after a size's first timing.
                self._since_probe = 0
                self._remeasure = True
                return 1
            self._quiet = self._quiet_steps(room)
        elif not self.reproducible:
            self._drafting += 1
            if self._drafting >= self.yardstick_interval():  # a plain step keeps the cost it is weighed against current
                self._drafting = 0
                self._yardstick = True
                return 0
            # one draft deeper than the best: its acceptance is known only from a few tries (a single early rejection
            # at depth 2 of a head right 9 times in 10 kept auto at depth 1 for a whole reply); every step while
            # chains are taken whole (a head right 99 times in 100 climbed 1, 1, 2, 3 before its best depth, 8)
            d = max(best_k, whole)
            if d < min(MAX_DRAFT, room) and (self._drafting % self.DEEPER_EVERY == 0 or whole) and \
                    self._evidence()[1][d] < self.DEEPER_EVIDENCE and self._deeper_could_pay(d, rate):
                return d + 1
        return best_k

    def _whole_chain(self) -> int:
        """The depth of the last step's chain where the verify took every draft of it, else 0."""
        now = (self.stats.drafted, self.stats.accepted)
        last, self._counts = self._counts, now
        drafted = now[0] - last[0]
        return drafted if drafted and drafted == now[1] - last[1] else 0

    def _first_timing_due(self) -> bool:
        """Whether a verify size timed once ever (this reply's first pass of it, maybe cold) is due a second timing:
        THIN_GAP plain steps after it. (On the mid-size MoE a cold first 2-row verify kept auto plain for ~55 steps of
        a head right 9 times in 10, while its probes, every 4th step, kept the re-measurement from falling due.)"""
        return self._since_probe >= self.THIN_GAP and self._timed_once()

    def _timed_once(self) -> bool:
        """Whether a verify size this reply timed was timed once ever."""
        return any(self._timings.get(n, 0.0) < 2.0 for n in self._once)

    def _remeasure_interval(self) -> int:
        """Plain steps between re-measurements (choose): `probe_every`, doubled for each in a row that confirmed plain
        decoding, up to 8×; where every depth was clearly slower (DORMANT_MARGIN), quadrupled, up to 64×."""
        if self._stays and self._beyond:
            return self.probe_every << min(2 * self._stays, self.DORMANT_BACKOFF)
        return self.probe_every << min(self._stays, self.MAX_PROBE_BACKOFF)

    @property
    def cost_only(self) -> bool:
        """Whether this step (depth 1) re-measures the verify's cost alone: where every depth was clearly slower than
        plain decoding, a verify of the step's token and a stand-in draft tells auto what it needs without the head,
        which would first have to catch up on every plain step since it last ran (~0.06 of a decode step a row on
        the embedded model: ~6 % of the steps in between, whatever the interval). The acceptance it knows is kept
        (replies decoded plain do not fade it)."""
        return self._remeasure and bool(self._stays) and self._beyond

    def catch_up_budget(self) -> float | None:
        """Seconds the head may spend catching up before this step's draft (None: no limit; a fixed depth drafts every
        step, so its backlog is never long)."""
        if self.fixed is not None or self.t_decode is None:
            return None
        return self.CATCH_UP_STEPS * self.t_decode

    def head_at_prefill(self) -> bool:
        """Whether the MTP head should run over the prompt with prefill (the prompt's share of drafting, before the
        first token). Not while auto's last re-measurement kept plain decoding: the next probe or re-measurement
        catches it up instead (timed apart from its draft), and until then the trunk's first steps find its weights
        still in the caches (on the embedded model the head's pass over a chat prompt left the next steps ~10 % slower,
        ~4 % of a short reply's decode). Nor while the last shadow probe missed (a head that is never right)."""
        return self.fixed is not None or self.reproducible or not (self._stays or self._misses)

    @property
    def quiet(self) -> bool:
        """Whether this step is one of the plain steps taken without weighing (set by choose): no probe either."""
        return self._quiet_now

    def _quiet_steps(self, room: int) -> int:
        """How many plain steps after this one can be taken without weighing: none while the early probes run, else
        up to QUIET_STEPS, ending before the next shadow probe or re-measurement falls due (their conditions change only
        with new evidence, which ends the quiet steps) and well before the context's end."""
        if self.t_draft is None or self._compared_total() < self.EARLY_PROBES:
            return 0
        due = self.QUIET_STEPS + self._since_probe + 1
        matching = self._alphas()[0] >= 0.5
        if not matching or self._thin():  # as probe_now
            due = min(due, self._probe_gap())
        if matching and not self.reproducible:  # as choose
            due = min(due, self.THIN_GAP if self._timed_once() else self._remeasure_interval())
        return max(0, min(self.QUIET_STEPS, due - self._since_probe - 1, room - MAX_DRAFT - 1))

    @property
    def learns_cut(self) -> bool:
        """Whether this step's drafts should report their confidence (auto: the step drafts its whole chain, to learn
        whether unconfident drafts are accepted)."""
        return self._explore_cut

    def observe_chain(self, confidence: list[float], accepted: int) -> None:
        """An uncut chain's drafts: those past the first below the break-even cut, tried (the chain alive to them)
        and accepted."""
        if not self._explore_cut:
            return
        self._explore_cut = False
        for i, c in enumerate(confidence[1:accepted + 1], start=1):
            if c < self._cut:
                self._low_tried += 1
                self._low_acc += i < accepted

    def chain_p_min(self, k: int) -> float:
        """The top probability below which this step's chain of k drafts stops early (positions 2…k): p_min, or less
        where a draft costs less than it is worth — one more draft gains its acceptance probability (the head's top
        probability stands in for it) and costs a draft pass and a verify row, so it pays above the break-even
        probability best rate × that cost (on the mid-size MoE ~0.5, where a fixed 0.75 cut chains short of the
        best fixed depth's gain)."""
        if self.fixed is not None or self.t_draft is None or self.t_decode is None or self._best[1] <= 0:
            return self.p_min
        row = self._verify_cost(k + 1) - self._verify_cost(k) if k > 1 else 0.0
        self._cut = min(self.p_min, self._best[1] * (self.t_draft + max(row, 0.0)))
        # A head's top probability need not be calibrated (an under-confident one is right far more often than it
        # says): every CUT_EXPLORE-th step drafts its whole chain, and once the drafts it would have cut are
        # accepted above the break-even rate, chains are no longer cut.
        self._chains += 1
        if self._chains % self.CUT_EXPLORE == 0 and not self.reproducible:
            self._explore_cut = True
            return 0.0
        if self._low_tried >= self.CUT_EVIDENCE and self._low_acc / self._low_tried >= self._cut:
            return 0.0
        return self._cut

    def probe_now(self, room: int) -> bool:
        """Whether this plain step should also draft one token with the head, to compare it with the trunk's
        own next token (a shadow probe: it costs one head pass, not a verify). Taken when depth 1 has no
        evidence yet and then every `probe_every` plain steps while drafts miss, so acceptance can recover after
        a bad stretch while a model whose drafts never match (random weights) pays almost nothing for speculation."""
        if self.fixed is not None or room < 1 or self.t_decode is None or self._quiet_now:
            return False
        if (self.memory is None or self.memory.t_decode is None) and 0 < self._decodes < self.FIRST_DECODES:
            return False
        first = self.t_draft is None or self._compared_total() < self.EARLY_PROBES
        # while drafts do match, only the costs keep auto plain: choose() re-measures those with a real depth-1
        # step (spaced out while they confirm it), and a probe here would cost a head pass to learn nothing
        if first or self._since_probe >= self._probe_gap() and (self._alphas()[0] < 0.5 or self._thin()):
            self._since_probe = 0
            return True
        return False

    def _compared_total(self) -> int:
        return self._compared + self.stats.tried_at[0] + self._probe_tried

    def yardstick_interval(self) -> int:
        """Drafting steps between plain ones: `probe_every`, doubled (up to 8×) for each plain step in a row that found
        decoding's cost as it was — each costs the gain of one speculative step, so a steady one is checked less."""
        return self.probe_every << min(self._kept, self.MAX_PROBE_BACKOFF)

    def _thin(self) -> bool:
        """Whether depth 1's evidence is thin (fewer than THIN_EVIDENCE drafts compared) where drafts always right
        would pay: on a model whose draft costs a decode step, as the embedded one's, a probe costs more than it
        could ever teach."""
        return self.t_draft is not None and self.t_decode is not None and \
            self._compared_total() < self.THIN_EVIDENCE and self._deeper_could_pay(0, 1.0 / self.t_decode)

    def _probe_gap(self) -> int:
        """Plain steps before the next shadow probe: every THIN_GAP-th while the evidence is thin (two early misses
        of a head right 9 times in 10 made the estimate 0.45, and the doubled interval then kept auto plain for a
        whole 128-token reply; probed whatever the estimate), else probe_interval()."""
        return self.THIN_GAP if self._thin() else self.probe_interval()

    def probe_interval(self) -> int:
        """Plain steps between shadow probes: `probe_every`, doubled for each probe in a row that missed."""
        return self.probe_every << min(self._misses, self.MAX_PROBE_BACKOFF)

    def observe_probe(self, accepted: float, draft_seconds: float, faulted: bool = False) -> None:
        """A shadow probe's outcome: 1/0 for greedy, the acceptance probability Σ min(p, q) when sampling; `faulted`:
        its draft waited on the disk for weights (verify.major_faults)."""
        self._probe_acc += accepted
        self._probe_tried += 1
        self._quiet = 0  # new evidence is weighed at the next step
        self._misses = self._misses + 1 if accepted < 0.5 else 0
        if not self.reproducible:
            self._observe_draft(draft_seconds, faulted)
        elif self.t_draft is None:
            self.t_draft = self.costs.draft
        self._costs += 1

    def _observe_draft(self, seconds: float, faulted: bool = False) -> None:
        """A draft pass's time. A reply's first runs cold (the head's weights not in the caches: twice the later
        ones on the mid-size MoE): like the first decode step it stands in only where nothing is known, no dearer
        than the model's bytes say a draft is, and the next replaces it; after that a slow one counts at most SPIKE ×
        the estimate. One that waited on the disk for weights the page cache had dropped (`faulted`) counts at most
        SPIKE × what its bytes say, whatever the estimate: drafting keeps those weights in, plain decoding lets them
        go. (On the Qwen3.6-35B-A3B shape, a 22 GB file on a 23 GB host, a first draft took 2 decode steps against
        0.18 by its bytes, and the next few 0.66 while the MTP block's experts faulted in: taken whole, or clipped
        against an estimate they kept raising, they kept auto plain, so they never warmed, while drafts at a fixed
        depth settled at 0.21.)"""
        if faulted and self.t_decode is not None:
            seconds = min(seconds, self.SPIKE * self.costs.draft * self.t_decode)
        self._drafts += 1
        if self._drafts == 1:
            if self.t_draft is None:
                prior = self.costs.draft * self.t_decode if self.t_decode is not None else seconds
                self.t_draft, self._draft_cold = min(seconds, prior), True
        elif self._draft_cold:
            self.t_draft, self._draft_cold = min(seconds, self.SPIKE * self.t_draft), False  # type: ignore[operator]
        else:
            self.t_draft = self._ema(self.t_draft, min(seconds, self.SPIKE * self.t_draft))  # type: ignore[operator]

    def _best_depth(self, room: int) -> tuple[int, float]:
        """The draft depth ≥ 1 with the most expected tokens per second, and that rate. Kept until a cost or the
        evidence changes: a plain step moves only the decode cost it is compared with (choose runs every step)."""
        key = (self._costs, self.stats.steps, self._probe_tried, min(MAX_DRAFT, room))
        if key == self._best_key and self.t_verify:  # unmeasured verifies are costed in decode steps: not kept
            return self._best
        alpha, best_k, best = self._alphas(), 0, 0.0
        expect, prod = 1.0, 1.0
        for k in range(1, min(MAX_DRAFT, room) + 1):
            prod *= alpha[k - 1]
            expect += prod
            t_ver = self._verify_cost(k + 1)
            rate = expect / (t_ver + k * self.t_draft)  # type: ignore[operator]
            if rate > best:
                best_k, best = k, rate
        self._best_key, self._best = key, (best_k, best)
        return self._best

    def _deeper_could_pay(self, k: int, rate: float) -> bool:
        """Whether depth k + 1 would beat `rate` (depth k's) were its draft always accepted: else trying it teaches
        nothing worth its cost (a model whose verify rows are dear)."""
        alpha, expect, prod = self._alphas(), 1.0, 1.0
        for j in range(k):
            prod *= alpha[j]
            expect += prod
        cost = self._verify_cost(k + 2) + (k + 1) * self.t_draft  # type: ignore[operator]
        return (expect + prod) / cost > rate

    def _alphas(self) -> list[float]:
        """Acceptance by depth, each smoothed towards the depth before it (depth 1 towards 1/2) with the weight of
        two drafts: an untried depth is first assumed as good as the one before, so auto explores it, and a few
        observations overrule the assumption. Kept until the evidence changes."""
        key = (self.stats.steps, self._probe_tried)
        if key != self._alpha_key:
            alpha, prev = [], 0.5
            for a, t in zip(*self._evidence()):
                prev = (a + 2 * prev) / (t + 2)
                alpha.append(prev)
            self._alpha_key, self._alpha = key, alpha
        return self._alpha

    def _evidence(self) -> tuple[list[float], list[float]]:
        """Accepted and tried drafts by depth: this reply's verify steps and probes, plus the halved memory."""
        acc = [p + a for p, a in zip(self._prior_acc, self.stats.accepted_at)]
        tried = [p + t for p, t in zip(self._prior_tried, self.stats.tried_at)]
        acc[0] += self._probe_acc
        tried[0] += self._probe_tried
        return acc, tried

    def _verify_cost(self, n: int) -> float:
        """A verify of n rows: as timed, weighed against the prior as PRIOR_WEIGHT timings (on a shared host one
        pass can take twice another of the same size: the first few timings must not decide alone, and a cold first
        pass must not keep auto from timing the size again); else extrapolated. Kept while the costs and the decode
        step stay as they are (weighing every depth asks for each size, and the sizes measured again for each)."""
        key = (self._costs, self.t_decode)
        if key != self._vc_key:
            self._vc_key, self._vc = key, {}
        cost = self._vc.get(n)
        if cost is None:
            if n not in self.t_verify:
                cost = self._extrapolate(n)
            else:  # a size timed once costs no more than its neighbours say: one slow pass on a shared host must not
                # keep auto from ever trying it again (a 3-row verify timed once at 2.4 decode steps, against 1.9
                # later, held the mid-size MoE at depth 1 for a whole run, x1.07 where depth 3 gave x1.3)
                cost = self._weighed(n)
                if self._timings.get(n, 1.0) < 2.0 and len(self.t_verify) > 1:
                    cost = min(cost, self._extrapolate(n))
            self._vc[n] = cost
        return cost

    def _weighed(self, n: int) -> float:
        c = self._timings.get(n, 1.0)  # a remembered cost of unknown count: one timing
        if self.t_decode is None or self.reproducible:
            return self.t_verify[n]
        prior = self.t_decode * self.costs.verify(n)
        return (self.PRIOR_WEIGHT * prior + c * self.t_verify[n]) / (self.PRIOR_WEIGHT + c)

    def _extrapolate(self, n: int) -> float:
        """Verify cost for an unmeasured size: the decode step plus the extra cost of the measured size nearest it
        (below first), scaled by the prior's ratio of the two extras (PassCosts: the distinct experts more rows
        pick, and their arithmetic) — the extra, not the whole, so a prior that overrates the rows' arithmetic (a
        dense model on a fast core) does not keep deeper passes untried. Before any verify is measured, the prior in
        units of the measured decode step."""
        step = self.t_decode or 0.0
        sizes = [m for m in self.t_verify if m != n]  # the other sizes, where n itself was timed once
        if sizes:
            m = min(sizes, key=lambda m: (abs(m - n), m > n)) if len(sizes) > 1 else sizes[0]
            extra = max(self._weighed(m) - step, 0.0)
            return step + extra * (self.costs.verify(n) - 1.0) / (self.costs.verify(m) - 1.0)
        return step * self.costs.verify(n)
