"""Trainable parameters for a qwen35moe / qwen35 model, stored in GGUF naming and conventions.

The parameters are served to `engine.models.build.load_model` through its `WeightSource` protocol, so
training runs the very layers inference runs, in their training forms (engine.training.layers: `F.linear`,
one causal SDPA per attention layer, the chunk-parallel delta rule). Conventions are those of the file:
norms hold the stored weight (1 + w, initialised to 1), `ssm_a` is derived from a trained `A_log` as
−exp(A_log), V-heads are in GGUF's tiled order from the start (no reorder needed at export).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from engine.storage.modelfile import HParams, expected_tensors
from engine.models.build import build_model
from engine.models.qwen35 import Qwen35Model
from engine.training.layers import for_training


class ModelParams(nn.Module):
    """All tensors of the GGUF as parameters (A_log stands in for ssm_a)."""

    def __init__(self, hp: HParams, seed: int = 0, tied: bool = False):
        super().__init__()
        self.hparams = hp
        self.tied = tied
        g = torch.Generator().manual_seed(seed)
        self.p = nn.ParameterDict()
        for name, shapes, required in expected_tensors(hp):
            keep_optional = name.endswith("nextn.shared_head_norm.weight") or (name == "output.weight" and not tied)
            if not required and not keep_optional:
                continue
            shape = shapes[0] if isinstance(shapes[0], tuple) else shapes
            self.p[_key(_param_name(name))] = nn.Parameter(_init(name, shape, g, hp))

    # -- WeightSource ------------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        if name.endswith(".ssm_a"):
            return -torch.exp(self.p[_key(_param_name(name))])
        if name == "output.weight" and self.tied:
            return self.p[_key("token_embd.weight")]
        return self.p[_key(name)]

    def has_tensor(self, name: str) -> bool:
        if name.endswith(".ssm_a"):
            return _key(_param_name(name)) in self.p
        return _key(name) in self.p or (name == "output.weight" and self.tied)

    # -- use -----------------------------------------------------------------------------------------
    def build(self, n_ctx: int, gdn_chunk: int = 64, n_seq: int = 1) -> Qwen35Model:
        """A model over the current parameters (rebuilt every step: derived tensors such as ssm_a must
        be recomputed from the parameters inside each step's autograd graph). Its passes hold `n_seq`
        independent sequences of equal length, flattened one after the other."""
        m = build_model(self, device=next(self.parameters()).device, n_ctx=n_ctx)
        return for_training(m, n_seq, gdn_chunk)

    def export_tensors(self) -> dict[str, np.ndarray]:
        """Every tensor as the GGUF stores it (ssm_a = −exp(A_log))."""
        out = {}
        for name, _, _ in expected_tensors(self.hparams):
            if self.has_tensor(name) and not (name == "output.weight" and self.tied):
                out[name] = self.tensor(name).detach().float().cpu().numpy()
        return out


def _param_name(name: str) -> str:
    """The trained parameter behind a GGUF tensor: `blk.i.ssm_a` is stored as −exp(A_log)."""
    return name[:-len("ssm_a")] + "ssm_A_log" if name.endswith(".ssm_a") else name


def _key(name: str) -> str:
    return name.replace(".", "__")  # ParameterDict keys cannot contain dots


def _init(name: str, shape: tuple[int, ...], g: torch.Generator, hp: HParams) -> torch.Tensor:
    if name.endswith("ssm_a"):  # A_log: decays spread over time scales, as Mamba/GDN initialise them
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=g))
    if name.endswith("ssm_dt.bias"):  # softplus⁻¹ of dt ∈ [1e-3, 1e-1], log-uniform
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("ssm_conv1d.weight"):
        return torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    if name == "token_embd.weight":
        return torch.randn(shape, generator=g) * 0.02
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight",
                      "ffn_down.weight")):
        std /= math.sqrt(2 * hp.n_layer)  # residual branches start small
    return torch.randn(shape, generator=g) * std
