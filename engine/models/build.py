"""Building a model: read its weights from a WeightSource, put them on their devices (engine.placement's plan)
and bind each to the kernels that will run it (engine.ops, through one Backend), then assemble the layers, the
trunk and the MTP head. The only place where a weight meets its backend."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine import ops
from engine.expert_cache import ExpertCache
from engine.models.mtp import MTPHead
from engine.models.runner import Runner
from engine.models.qwen35 import (AttentionWeights, DecoderLayer, DenseFFN, DenseWeights, GatedAttention,
                                  GatedDeltaNet, GDNWeights, MoE, MoEWeights, Qwen35Model, RoutingStats)
from engine.placement import Plan
from engine.storage.modelfile import HParams
from engine.storage.qtensor import QTensor


class WeightSource(Protocol):
    """Where a model's weights come from: a GGUF `ModelFile` (QTensors), or the trainer's parameters."""

    hparams: HParams

    def tensor(self, name: str) -> ops.Weight: ...

    def has_tensor(self, name: str) -> bool: ...


def _dense(src: WeightSource, name: str, device: torch.device) -> torch.Tensor:
    """A small tensor (norm, gate, conv kernel) as float32, kept as-is when it is a trained parameter."""
    t = src.tensor(name)
    return t.dequantize(dtype=torch.float32, device=device) if isinstance(t, QTensor) else t


def _vec(src: WeightSource, name: str, device: torch.device) -> torch.Tensor:
    return _dense(src, name, device).reshape(-1)


class _Builder:
    def __init__(self, src: WeightSource, backend: ops.Backend, plan: Plan | None, accelerator: torch.device):
        self.src, self.hp, self.backend, self.plan, self.acc = src, src.hparams, backend, plan, accelerator
        self.routing = RoutingStats()
        self.expert_caches: dict[int, ExpertCache] = {}

    def weight(self, name: str, dev: torch.device) -> ops.Weight:
        """A weight on `dev`, still in its stored format (a trained parameter already there is kept)."""
        return self.src.tensor(name).to(dev)

    def linear(self, name: str, dev: torch.device) -> ops.Linear:
        return ops.bind(self.weight(name, dev), self.backend)

    def ffn(self, p: str, il: int, dev: torch.device) -> MoE | DenseFFN:
        hp, lin = self.hp, self.linear
        if not hp.is_moe:
            return DenseFFN(DenseWeights(lin(p + "ffn_gate.weight", dev), lin(p + "ffn_up.weight", dev),
                                         lin(p + "ffn_down.weight", dev)))
        plan = self.plan
        on_cpu = plan is not None and il < hp.n_layer and not plan.experts_on_gpu[il]
        edev = torch.device("cpu") if on_cpu else dev
        gate, up, down = (self.weight(p + f"ffn_{n}_exps.weight", edev) for n in ("gate", "up", "down"))
        cache = None
        if on_cpu and plan is not None and plan.cache_experts[il] > 0 and isinstance(gate, QTensor):
            cache = self.expert_caches[il] = ExpertCache(gate, up, down, plan.cache_experts[il],  # type: ignore[arg-type]
                                                         self.acc, plan.miss_policy)
        shared = hp.n_ff_shexp > 0
        sgi = sw = None
        if shared:  # stored as (d,) or (1, d): one scalar gate per token either way
            w = self.weight(p + "ffn_gate_inp_shexp.weight", dev)
            sgi = ops.bind(QTensor(w.raw, w.qtype, (1, w.n_cols)) if isinstance(w, QTensor) else w.reshape(1, -1),
                           self.backend)
            sw = tuple(self.weight(p + f"ffn_{n}_shexp.weight", dev) for n in ("gate", "up", "down"))
        experts = ops.bind_experts(gate, up, down, self.backend, dev, cache, sw)  # type: ignore[arg-type]
        s_gate, s_up, s_down = (ops.bind(t, self.backend) for t in sw) if sw else (None, None, None)
        return MoE(hp, MoEWeights(lin(p + "ffn_gate_inp.weight", dev), experts, sgi, s_gate, s_up, s_down), il,
                   self.routing)

    def layer(self, il: int, dev: torch.device) -> DecoderLayer:
        src, hp, lin = self.src, self.hp, self.linear
        backend = self.backend.on(dev)
        p = f"blk.{il}."
        if il < hp.n_layer and hp.recurrent[il]:
            mixer: GatedAttention | GatedDeltaNet = GatedDeltaNet(hp, GDNWeights(
                lin(p + "attn_qkv.weight", dev), lin(p + "attn_gate.weight", dev),
                lin(p + "ssm_beta.weight", dev), lin(p + "ssm_alpha.weight", dev),
                _vec(src, p + "ssm_a", dev), _vec(src, p + "ssm_dt.bias", dev),
                _dense(src, p + "ssm_conv1d.weight", dev),
                _vec(src, p + "ssm_norm.weight", dev), lin(p + "ssm_out.weight", dev)), il, backend)
        else:
            mixer = GatedAttention(hp, AttentionWeights(
                lin(p + "attn_q.weight", dev), lin(p + "attn_k.weight", dev), lin(p + "attn_v.weight", dev),
                lin(p + "attn_output.weight", dev), _vec(src, p + "attn_q_norm.weight", dev),
                _vec(src, p + "attn_k_norm.weight", dev)), il, backend)
        return DecoderLayer(il, _vec(src, p + "attn_norm.weight", dev), _vec(src, p + "post_attention_norm.weight", dev),
                            mixer, self.ffn(p, il, dev), hp.rms_eps, dev, backend)


def _indexed(dev: torch.device) -> torch.device:
    """`cuda` as `cuda:N`, the device tensors placed there report: device comparisons (step graphs' "one device"
    test among them) would otherwise see two devices."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def load_model(src: WeightSource, device: torch.device | str = "cpu", n_ctx: int | None = None,
               plan: Plan | None = None, backend: ops.Backend | None = None,
               on_layer: Callable[[int, int], None] | None = None, step_graphs: str = "auto") -> Runner:
    """The model of `src` (build_model's arguments) with its passes' execution decided (engine.models.runner):
    layers fused where their backend runs them in one call, decode steps and verify passes replayed from CUDA graphs
    where the trunk allows it (`step_graphs`: "auto", "on", "off")."""
    return Runner(build_model(src, device, n_ctx, plan, backend, on_layer), step_graphs)


def build_model(src: WeightSource, device: torch.device | str = "cpu", n_ctx: int | None = None,
                plan: Plan | None = None, backend: ops.Backend | None = None,
                on_layer: Callable[[int, int], None] | None = None) -> Qwen35Model:
    """The model of `src` with weights on `device`, or where `plan` puts them (engine.placement): trunk layers on
    the plan's accelerator or the CPU, routed experts resident, on the CPU, or on the CPU with a GPU cache. Every
    weight is bound to `backend`'s kernels (default: the fastest this machine runs) on its device.
    `on_layer(done, total)` is called after each block (progress; it may raise to cancel). The math only: training
    runs it as it is, inference through load_model's Runner."""
    hp = src.hparams
    backend = backend or ops.default_backend()
    cpu = torch.device("cpu")
    if plan is None:
        acc = _indexed(torch.device(device))
        layer_devices = [acc] * hp.n_layer
        out_dev = mtp_dev = acc
    else:
        acc = _indexed(torch.device(plan.device))
        layer_devices = [acc if on else cpu for on in plan.layer_on_gpu]
        out_dev = acc if plan.output_on_gpu else cpu
        mtp_dev = acc if plan.mtp_on_gpu else cpu
    b = _Builder(src, backend, plan, acc)
    tok_embd = src.tensor("token_embd.weight")
    output = ops.bind((src.tensor("output.weight") if src.has_tensor("output.weight") else tok_embd).to(out_dev),
                      backend)
    output_norm = _vec(src, "output_norm.weight", out_dev)
    total = hp.n_layer + (1 if hp.has_mtp else 0)
    layers = []
    for i in range(hp.n_layer):
        layers.append(b.layer(i, layer_devices[i]))
        if on_layer is not None:
            on_layer(i + 1, total)
    model = Qwen35Model(hp, layers, tok_embd, output, output_norm, n_ctx or hp.n_ctx_train, out_dev, acc,
                        b.routing, b.expert_caches)
    if hp.has_mtp:
        p = f"blk.{hp.n_layer}.nextn."
        has = src.has_tensor
        model.mtp = MTPHead(
            model, b.layer(hp.n_layer, mtp_dev), b.linear(p + "eh_proj.weight", mtp_dev),
            _vec(src, p + "enorm.weight", mtp_dev), _vec(src, p + "hnorm.weight", mtp_dev),
            _vec(src, p + "shared_head_norm.weight", mtp_dev) if has(p + "shared_head_norm.weight") else output_norm,
            src.tensor(p + "embed_tokens.weight") if has(p + "embed_tokens.weight") else tok_embd,
            b.linear(p + "shared_head_head.weight", mtp_dev) if has(p + "shared_head_head.weight") else output,
            mtp_dev)
        if on_layer is not None:
            on_layer(total, total)
    return model
