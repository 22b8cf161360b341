"""Where every tensor lives: trunk layers on the accelerator or the CPU, routed experts resident on the
accelerator or on the CPU with a per-layer cache of hot experts on the accelerator, and why.

The plan is pure arithmetic over tensor sizes and a VRAM budget, so it is tested on any machine with a
fake budget. Conventions follow llama.cpp's `-ngl` / `--n-cpu-moe`: the *last* `gpu_layers` trunk layers
run on the GPU (so the hidden state crosses devices once per pass and meets the LM head there); the token
embedding stays on the CPU (a lookup reads one row); the LM head and the MTP block go to the GPU when
every trunk layer does.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from engine.errors import EngineError, OutOfMemoryError
from engine.storage.modelfile import HParams
from engine.validate import expert_cache

MiB = 1 << 20
# Left free on the device: the CUDA context, the allocator's fragmentation, dequantization tiles.
DEFAULT_MARGIN = 768 * MiB


@dataclass(frozen=True)
class PlacementConfig:
    device: str = "cpu"  # "cpu" or an accelerator ("cuda", "cuda:1"; tests use "cpu" stand-ins via Placement)
    gpu_layers: int | None = None  # trunk layers on the accelerator; None = as many as fit (auto)
    cpu_moe: bool = False  # keep every layer's routed experts on the CPU (then cache hot ones on the GPU)
    expert_cache: str | None = None  # per-layer cache: "N" experts or "N MiB" in all; None = fill what is left
    margin_bytes: int = DEFAULT_MARGIN
    miss_policy: str = "load"  # expert-cache miss: "load" it to the GPU then compute, or compute it on the "cpu"


@dataclass(frozen=True)
class ModelSizes:
    """Bytes of the parts that can be placed, read from the GGUF's tensor table."""

    n_layer: int
    trunk: list[int]  # per trunk layer: everything but the routed experts
    experts: list[int]  # per trunk layer: all routed experts (0 for dense layers)
    expert_one: list[int]  # per trunk layer: one routed expert (gate + up + down)
    n_expert: int
    kv: list[int]  # per trunk layer: attention KV at the chosen context (0 for GDN layers)
    state: list[int]  # per trunk layer: GDN conv + recurrent state (0 for attention layers)
    output: int  # LM head + final norm
    embedding: int
    mtp: int  # the MTP block with its KV cache (0 when the model has none)

    @classmethod
    def from_model(cls, mf, n_ctx: int) -> ModelSizes:  # type: ignore[no-untyped-def]
        hp: HParams = mf.hparams
        L = hp.n_layer
        trunk, experts = [0] * L, [0] * L
        mtp = output = embedding = 0
        for name, t in mf.tensors.items():
            m = re.match(r"blk\.(\d+)\.", name)
            if m is None:
                if name == "token_embd.weight":
                    embedding += t.n_bytes
                else:
                    output += t.n_bytes
                continue
            il = int(m.group(1))
            if il >= L:
                mtp += t.n_bytes
            elif "_exps." in name:
                experts[il] += t.n_bytes
            else:
                trunk[il] += t.n_bytes
        if "output.weight" not in mf.tensors:
            output += mf.tensors["token_embd.weight"].n_bytes  # tied head: the GPU needs its own copy
        kv_one = n_ctx * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v) * 4  # float32 K and V
        state_one = (hp.conv_state_floats() + hp.ssm_state_floats()) * 4
        kv = [0 if hp.recurrent[i] else kv_one for i in range(L)]
        state = [state_one if hp.recurrent[i] else 0 for i in range(L)]
        if hp.has_mtp:
            mtp += kv_one
        n_exp = hp.n_expert if hp.is_moe else 0
        return cls(L, trunk, experts, [e // n_exp if n_exp else 0 for e in experts], n_exp, kv, state, output,
                   embedding, mtp)


@dataclass
class Plan:
    device: str  # the accelerator ("cpu" when there is none)
    layer_on_gpu: list[bool]
    experts_on_gpu: list[bool]  # all routed experts of the layer resident on the accelerator
    cache_experts: list[int]  # per layer: expert-cache capacity on the accelerator (0 = none)
    output_on_gpu: bool
    mtp_on_gpu: bool
    miss_policy: str
    gpu_bytes: dict[str, int] = field(default_factory=dict)  # estimate by part
    budget_bytes: int | None = None  # free VRAM minus the margin, when known
    reason: str = ""

    @property
    def gpu_layers(self) -> int:
        return sum(self.layer_on_gpu)

    @property
    def uses_gpu(self) -> bool:
        return self.device != "cpu" and (any(self.layer_on_gpu) or self.output_on_gpu)

    def summary(self) -> str:
        """One line for the CLI and the app: "24/40 layers on GPU, experts on CPU, cache 64 experts — because …"."""
        n = len(self.layer_on_gpu)
        if not self.uses_gpu:
            return f"all {n} layers on CPU — because {self.reason}"
        moe = [i for i, on in enumerate(self.layer_on_gpu) if on]
        if any(self.experts_on_gpu[i] for i in moe) and all(self.experts_on_gpu[i] for i in moe):
            ex = "experts on GPU"
        elif any(self.experts_on_gpu):
            ex = f"experts of {sum(self.experts_on_gpu)} layers on GPU, the rest on CPU"
        else:
            ex = "experts on CPU"
        caches = {c for c in self.cache_experts if c}
        cache = f", cache {max(caches)} experts/layer" if caches else ""
        total = sum(self.gpu_bytes.values())
        return (f"{self.gpu_layers}/{n} layers on GPU, {ex}{cache} ({total / MiB:.0f} MiB of VRAM) — because "
                f"{self.reason}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(gpu_layers=self.gpu_layers, summary=self.summary())
        return d


def plan_placement(sizes: ModelSizes, cfg: PlacementConfig, free_bytes: int | None) -> Plan:
    """The plan for `cfg` on a device with `free_bytes` free (None: unknown, only explicit choices)."""
    L = sizes.n_layer
    cpu_plan = Plan("cpu", [False] * L, [False] * L, [0] * L, False, False, cfg.miss_policy)
    if cfg.miss_policy not in ("load", "cpu"):
        raise EngineError(f"expert-cache miss policy must be 'load' or 'cpu', not '{cfg.miss_policy}'")
    if cfg.device == "cpu":
        if cfg.gpu_layers:
            raise EngineError(f"--gpu-layers {cfg.gpu_layers} needs a GPU device (--device cuda)")
        cpu_plan.reason = "the device is the CPU"
        return cpu_plan
    if cfg.gpu_layers is not None and not 0 <= cfg.gpu_layers <= L:
        raise EngineError(f"gpu_layers must be 0…{L} (this model has {L} layers), or auto")
    budget = None if free_bytes is None else free_bytes - cfg.margin_bytes
    if budget is None and cfg.gpu_layers is None:
        raise EngineError("cannot choose GPU layers automatically: free VRAM is unknown; give --gpu-layers")
    moe = sizes.n_expert > 0

    def layer_cost(i: int, with_experts: bool) -> int:
        return sizes.trunk[i] + sizes.kv[i] + sizes.state[i] + (sizes.experts[i] if with_experts else 0)

    def fits(b: int) -> bool:
        return budget is None or b <= budget

    # 1. Which layers, and whether their experts come along.
    experts_gpu = moe and not cfg.cpu_moe
    why: list[str] = []
    if cfg.gpu_layers is not None:
        g = cfg.gpu_layers
        why.append(f"gpu_layers = {g} was asked for")
    else:
        g = 0
        full = sum(layer_cost(i, experts_gpu) for i in range(L)) + sizes.output + sizes.mtp
        if experts_gpu and not fits(full):
            experts_gpu = False  # a GPU full of trunk layers + cached hot experts beats half the model
            why.append(f"the whole model ({full / MiB:.0f} MiB) does not fit in {budget / MiB:.0f} MiB "
                       "of free VRAM, so routed experts stay on the CPU")
        used = sizes.output
        for i in reversed(range(L)):
            c = layer_cost(i, experts_gpu)
            if not fits(used + c):
                break
            used += c
            g += 1
        if g == 0:
            cpu_plan.reason = f"no layer fits in {max(budget or 0, 0) / MiB:.0f} MiB of free VRAM"
            cpu_plan.budget_bytes = budget
            return cpu_plan
        why.append(f"{g} of {L} layers fit in {budget / MiB:.0f} MiB of free VRAM" if g < L
                   else f"all layers fit in {budget / MiB:.0f} MiB of free VRAM")
    if cfg.cpu_moe and moe:
        why.append("experts were asked to stay on the CPU")
    on = [i >= L - g for i in range(L)]
    all_on = g == L
    ex_on = [on[i] and experts_gpu and sizes.experts[i] > 0 for i in range(L)]
    parts = {
        "trunk": sum(sizes.trunk[i] for i in range(L) if on[i]),
        "experts": sum(sizes.experts[i] for i in range(L) if ex_on[i]),
        "kv_cache": sum(sizes.kv[i] for i in range(L) if on[i]),
        "gdn_state": sum(sizes.state[i] for i in range(L) if on[i]),
        "output": sizes.output if g > 0 else 0,
    }
    mtp_on = all_on and sizes.mtp > 0 and fits(sum(parts.values()) + sizes.mtp)
    parts["mtp"] = sizes.mtp if mtp_on else 0
    if budget is not None and sum(parts.values()) > budget:
        raise OutOfMemoryError(
            f"{g} GPU layers need {sum(parts.values()) / MiB:.0f} MiB but only {budget / MiB:.0f} MiB of VRAM "
            f"is free (after a {cfg.margin_bytes / MiB:.0f} MiB margin); use fewer layers, --cpu-moe, or auto")

    # 2. The expert cache: hot experts of GPU layers whose experts live on the CPU.
    cached = [i for i in range(L) if on[i] and not ex_on[i] and sizes.experts[i] > 0]
    cache = [0] * L
    if cached:
        n_req, bytes_req = expert_cache(cfg.expert_cache)
        one = max(sizes.expert_one[i] for i in cached)
        left = None if budget is None else budget - sum(parts.values())
        if n_req is not None:
            per_layer = min(n_req, sizes.n_expert)
            if left is not None and per_layer * one * len(cached) > left:
                raise OutOfMemoryError(
                    f"an expert cache of {per_layer} experts × {len(cached)} layers needs "
                    f"{per_layer * one * len(cached) / MiB:.0f} MiB but only {left / MiB:.0f} MiB is left")
            why.append(f"{per_layer} cached experts per layer were asked for")
        else:
            total = bytes_req if bytes_req is not None else left
            if total is None:
                total = 0
                why.append("no expert cache: free VRAM is unknown")
            if bytes_req is not None and left is not None and bytes_req > left:
                raise OutOfMemoryError(f"an expert cache of {bytes_req / MiB:.0f} MiB does not fit in the "
                                       f"{left / MiB:.0f} MiB left")
            per_layer = min(sizes.n_expert, max(0, total) // (one * len(cached)))
            if bytes_req is None and total:
                why.append(f"the {total / MiB:.0f} MiB left hold {per_layer} experts per GPU layer")
        for i in cached:
            cache[i] = per_layer
        parts["expert_cache"] = sum(cache[i] * sizes.expert_one[i] for i in cached)
    return Plan(cfg.device, on, ex_on, cache, g > 0, mtp_on, cfg.miss_policy, parts, budget, "; ".join(why))


def free_device_bytes(device: str) -> int | None:
    """Free memory of a CUDA device (None for the CPU or when it cannot be queried)."""
    import torch

    if not device.startswith("cuda"):
        return None
    from engine.metrics import cuda_status

    ok, why = cuda_status()
    if not ok:
        raise EngineError(f"the device 'cuda' was asked for, but {why}")
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
