"""What the engine takes and gives: its configuration, and the events `Engine.generate` streams (the CLI, the app's
worker thread and any other caller read only these)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine import ops
from engine.constrain import Constraint
from engine.placement import PlacementConfig, Plan
from engine.sampling import SamplingConfig
# GenerationConfig.draft's limit. It is defined in engine.validate, which checks it: validate cannot import this module
# (this one imports engine.sampling, which imports validate).
from engine.validate import MAX_DRAFT  # noqa: F401


@dataclass(frozen=True)
class SpeculativeTimes:
    """Seconds spent per part of speculative decoding."""

    draft: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    plain_decode: float = 0.0


@dataclass(frozen=True)
class SpeculativeStats:
    """How much MTP speculation is helping, so far in a reply."""

    drafted: int = 0
    accepted: int = 0
    acceptance: float = 0.0  # accepted / drafted
    acceptance_by_depth: list[float] = field(default_factory=list)  # per draft position 1..MAX_DRAFT
    tried_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    mean_accepted_length: float = 0.0  # tokens emitted per verify pass (accepted drafts + the trunk's own)
    accepted_length_histogram: list[int] = field(default_factory=list)  # verify passes by drafts accepted
    verify_steps: int = 0
    plain_steps: int = 0  # steps decoded without drafting (auto chose depth 0)
    # tokens per second of this reply's plain steps (auto runs one now and then while drafting, to keep its yardstick
    # current): what the same engine decodes without MTP, measured in the same reply; 0 where none ran
    plain_tok_s: float = 0.0
    time_s: SpeculativeTimes = field(default_factory=SpeculativeTimes)
    # Where the figures came from: "engine" (this process), or for a remote engine "timings" / "request metrics"
    # (per request), "/metrics" / "sglang gauges" / "/server_info" (server-wide: other clients count too).
    source: str = "engine"
    server_wide: bool = False


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int = 4096
    device: str = "cpu"  # "cpu" or "cuda[:i]": then the hybrid placement below applies
    n_threads: int | None = None  # None: torch's default (all cores)
    gpu_layers: int | None = None  # trunk layers on the GPU; None = auto-fit to free VRAM
    cpu_moe: bool = False  # routed experts stay on the CPU (hot ones cached on the GPU)
    expert_cache: str | None = None  # "N" experts per layer or "N MiB" in all; None = what is left
    miss_policy: str = "load"  # expert-cache miss: "load" to the GPU, or compute on the "cpu"
    plan: Plan | None = None  # a ready plan instead of the above (tests: a CUDA plan run on CPU stand-ins)
    backend: ops.Backend | None = None  # the kernels (engine.ops); None: the fastest this machine runs
    memory_budget: int | None = None  # bytes of RAM to plan for (engine.memory); None: what the system has free
    step_graphs: str = "auto"  # decode steps replayed from CUDA graphs: "auto" (where capturable), "on", "off"
    # where auto draft depth keeps what it learned of this model across processes (engine.speculative.remembered);
    # None: within this process only
    auto_memory_dir: str | None = None

    def placement(self) -> PlacementConfig:
        return PlacementConfig(self.device, self.gpu_layers, self.cpu_moe, self.expert_cache,
                               miss_policy=self.miss_policy)


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 512
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    enable_thinking: bool | None = None
    stats_interval_s: float = 0.25
    mtp: bool = True  # speculative decoding with the model's MTP head (when it has one)
    draft: int | None = None  # draft depth 1..MAX_DRAFT, None = auto (engine.validate.parse_draft reads a setting)
    p_min: float = 0.75  # auto: stop a chain at a draft whose top probability is below this (or below the
    # break-even probability where drafts cost less: DepthController.chain_p_min)
    # each emitted token's log-probability and this many most likely alternatives (None: none, and no cost)
    logprobs: int | None = None
    # the output held to a JSON schema by constrained decoding (engine.constrain; None: free text, and no cost)
    constraint: Constraint | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token under the model's own distribution (log-softmax of its logits, before sampling settings)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens and their log-probabilities, most likely first


@dataclass(frozen=True)
class Token:
    ids: list[int]
    text: str
    accepted_draft: bool = False
    logprobs: tuple[TokenLogprob, ...] = ()  # one per id when GenerationConfig.logprobs is set


@dataclass(frozen=True)
class Stats:
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens actually computed (the rest was reused from the cache)
    generated_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    elapsed_s: float
    cache_bytes: int
    state_bytes: int
    final: bool = False
    mtp: bool = False
    speculative: SpeculativeStats | None = None  # with MTP: drafted, accepted, by depth, histogram, times
    expert_cache: dict[int, dict] | None = None  # GPU expert cache per layer: hits, misses, evictions, bytes, occupancy
    expert_usage: dict[int, list[int]] | None = None  # MoE: tokens routed to each expert, per layer (cumulative)


@dataclass(frozen=True)
class Progress:
    """Prompt processing under way: `done` of `total` prompt tokens computed. Yielded between prefill chunks of a
    prompt longer than one chunk, so a caller can show progress before the first token; others ignore it."""

    done: int
    total: int


@dataclass(frozen=True)
class Done:
    # "eos" (the model's end token, or a constraint's output complete) | "max_tokens" | "stop_string" | "stopped" |
    # "context_full" | "context_overflow"
    reason: str
    message: str = ""


Event = Token | Stats | Done | Progress
