"""A second oracle: HF transformers' Qwen3.5 text models (trunk only, no MTP), converted to GGUF by us.

`tiny_hf_config` + `build_hf_model` give a small randomly initialised `Qwen3_5MoeForCausalLM` (arch
`qwen35moe`) or `Qwen3_5ForCausalLM` (arch `qwen35`), with every parameter perturbed away from HF's
"identity" init (zero 1+w norms, ones/zeros elsewhere) so that each storage convention matters.
`hf_to_gguf` applies the converter transforms of spec §2 (our own test code, independent of
llama.cpp's `convert_hf_to_gguf.py`) and writes the file with `engine.storage.writer`. `hf_logits` is the
reference forward pass.

Requires `transformers` 5.x with `transformers.models.qwen3_5_moe` (tested with 5.23.0).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.storage.writer import Vocab, make_hparams, write_gguf
from tests.fixtures import fixture_vocab

ARCHS = ("qwen35moe", "qwen35")

_TINY = dict(
    vocab_size=384, hidden_size=64, num_hidden_layers=4, full_attention_interval=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
)
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_TINY_DENSE = dict(intermediate_size=96)


def _classes(arch: str):
    if arch == "qwen35moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM
    if arch == "qwen35":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5TextConfig, Qwen3_5ForCausalLM
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def tiny_hf_config(arch: str = "qwen35moe", **overrides):
    """A tiny HF text config (float32, eager attention). Keyword overrides replace the defaults;
    `rope_theta` / `partial_rotary_factor` / `mrope_section` go into `rope_parameters`."""
    cfg_cls, _ = _classes(arch)
    kw = dict(_TINY, **(_TINY_MOE if arch == "qwen35moe" else _TINY_DENSE))
    rope = {
        "rope_type": "default", "rope_theta": float(overrides.pop("rope_theta", 1e7)),
        "partial_rotary_factor": float(overrides.pop("partial_rotary_factor", 0.25)),
        "mrope_section": list(overrides.pop("mrope_section", [11, 11, 10])), "mrope_interleaved": True,
    }
    kw.update(overrides)
    kw.setdefault("rope_parameters", rope)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    cfg.dtype = torch.float32
    return cfg


def _arch_of(config) -> str:
    return "qwen35moe" if getattr(config, "num_experts", 0) else "qwen35"


@torch.no_grad()
def build_hf_model(config, seed: int):
    """HF model with random, non-trivial weights (deterministic in `seed`), in eval mode.

    Every parameter is redrawn (HF's own init leaves 1+w norms at 0, dt_bias at 1, …):
    1+w norms w ~ N(0, 0.1); the gated GDN norm (a plain multiplier) 1 + N(0, 0.1); A_log, dt_bias
    ~ N(0, 0.5); embeddings N(0, 1); LM head N(0, 4/√d); routers N(0, 2/√d); every other weight
    (projections, experts, conv taps, shared-expert gate) N(0, 1/√fan_in) with fan_in = last dim.
    """
    _, model_cls = _classes(_arch_of(config))
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    d = config.hidden_size
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            std, mean = 0.1, 1.0
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            std, mean = 0.1, 0.0
        elif name.endswith(("A_log", "dt_bias")):
            std, mean = 0.5, 0.0
        elif name.endswith("embed_tokens.weight"):
            std, mean = 1.0, 0.0
        elif name == "lm_head.weight":
            std, mean = 4.0 / math.sqrt(d), 0.0
        elif name.endswith("mlp.gate.weight"):
            std, mean = 2.0 / math.sqrt(d), 0.0
        else:
            std, mean = 1.0 / math.sqrt(p.shape[-1]), 0.0
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)
    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        raise AssertionError("lm_head is tied to embed_tokens; the oracle expects an untied head")
    return model


def _interval(config) -> int:
    types = list(config.layer_types)
    for k in range(1, len(types) + 1):
        if types == ["linear_attention" if (i + 1) % k else "full_attention" for i in range(len(types))]:
            return k
    raise ValueError(f"layer_types {types} follow no full_attention_interval rule")


def hparams_of(config):
    """Our HParams for an HF text config (no MTP)."""
    arch = _arch_of(config)
    moe = arch == "qwen35moe"
    if config.linear_key_head_dim != config.linear_value_head_dim:
        raise ValueError("GGUF qwen35 stores one ssm.state_size: linear key and value head dims must match")
    rp = config.rope_parameters
    return make_hparams(
        arch, n_layer=config.num_hidden_layers, n_embd=config.hidden_size, n_vocab=config.vocab_size,
        n_head=config.num_attention_heads, n_head_kv=config.num_key_value_heads, head_dim=config.head_dim,
        n_rot=int(config.head_dim * rp.get("partial_rotary_factor", 0.25)), rope_base=rp["rope_theta"],
        rms_eps=config.rms_norm_eps, n_ctx_train=config.max_position_embeddings,
        ssm_conv_kernel=config.linear_conv_kernel_dim, ssm_d_state=config.linear_key_head_dim,
        ssm_n_group=config.linear_num_key_heads, ssm_dt_rank=config.linear_num_value_heads,
        full_attention_interval=_interval(config), n_ff=0 if moe else config.intermediate_size,
        n_expert=config.num_experts if moe else 0, n_expert_used=config.num_experts_per_tok if moe else 0,
        n_ff_exp=config.moe_intermediate_size if moe else 0,
        n_ff_shexp=config.shared_expert_intermediate_size if moe else 0,
    )


def v_head_perm(n_k: int, n_v: int) -> np.ndarray:
    """perm[h'] = HF (grouped) v-head stored at GGUF (tiled) position h' (spec §2.4)."""
    r = n_v // n_k
    return np.array([(h % n_k) * r + h // n_k for h in range(n_v)])


def _reorder_rows(x: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Permute blocks of rows: x has len(perm)·k rows, block h' of the result is block perm[h']."""
    n = len(perm)
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])[perm].reshape(x.shape)


def hf_to_gguf_tensors(model, *, reorder_v: bool = True, norm_plus_one: bool = True,
                       shexp_gate_2d: bool = False) -> dict[str, np.ndarray]:
    """GGUF-named tensors (torch orientation) for an HF model, with the converter transforms of spec §2.

    The keyword switches exist only to show that each convention is load-bearing (tests break them).
    """
    cfg = model.config
    sd = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in model.state_dict().items()}

    def norm(w: np.ndarray) -> np.ndarray:
        return (1.0 + w) if norm_plus_one else w

    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd = cfg.linear_key_head_dim * Hk
    perm = v_head_perm(Hk, Hv) if reorder_v else np.arange(Hv)
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": norm(sd["model.norm.weight"]),
        "output.weight": sd["lm_head.weight"],
    }
    for i, kind in enumerate(cfg.layer_types):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = norm(sd[h + "input_layernorm.weight"])
        out[b + "post_attention_norm.weight"] = norm(sd[h + "post_attention_layernorm.weight"])
        if kind == "linear_attention":
            la = h + "linear_attn."
            qkv = sd[la + "in_proj_qkv.weight"]
            out[b + "attn_qkv.weight"] = np.concatenate([qkv[: 2 * kd], _reorder_rows(qkv[2 * kd:], perm)])
            conv = sd[la + "conv1d.weight"][:, 0, :]  # (C, 1, K) → (C, K)
            out[b + "ssm_conv1d.weight"] = np.concatenate([conv[: 2 * kd], _reorder_rows(conv[2 * kd:], perm)])
            out[b + "attn_gate.weight"] = _reorder_rows(sd[la + "in_proj_z.weight"], perm)
            out[b + "ssm_beta.weight"] = _reorder_rows(sd[la + "in_proj_b.weight"], perm)
            out[b + "ssm_alpha.weight"] = _reorder_rows(sd[la + "in_proj_a.weight"], perm)
            out[b + "ssm_a"] = -np.exp(sd[la + "A_log"])[perm]
            out[b + "ssm_dt.bias"] = sd[la + "dt_bias"][perm]
            out[b + "ssm_norm.weight"] = sd[la + "norm.weight"]  # gated norm: no +1
            w_out = sd[la + "out_proj.weight"]  # (d, Hv·dv): permute column blocks
            out[b + "ssm_out.weight"] = _reorder_rows(w_out.T, perm).T
        else:
            at = h + "self_attn."
            out[b + "attn_q.weight"] = sd[at + "q_proj.weight"]  # already [q_h ; gate_h] per head
            out[b + "attn_k.weight"] = sd[at + "k_proj.weight"]
            out[b + "attn_v.weight"] = sd[at + "v_proj.weight"]
            out[b + "attn_output.weight"] = sd[at + "o_proj.weight"]
            out[b + "attn_q_norm.weight"] = norm(sd[at + "q_norm.weight"])
            out[b + "attn_k_norm.weight"] = norm(sd[at + "k_norm.weight"])
        m = h + "mlp."
        if _arch_of(cfg) == "qwen35moe":
            F = cfg.moe_intermediate_size
            gate_up = sd[m + "experts.gate_up_proj"]  # (E, 2F, d): gate first, then up
            out[b + "ffn_gate_inp.weight"] = sd[m + "gate.weight"]
            out[b + "ffn_gate_exps.weight"] = gate_up[:, :F]
            out[b + "ffn_up_exps.weight"] = gate_up[:, F:]
            out[b + "ffn_down_exps.weight"] = sd[m + "experts.down_proj"]
            sg = sd[m + "shared_expert_gate.weight"]  # (1, d)
            out[b + "ffn_gate_inp_shexp.weight"] = sg if shexp_gate_2d else sg[0]
            out[b + "ffn_gate_shexp.weight"] = sd[m + "shared_expert.gate_proj.weight"]
            out[b + "ffn_up_shexp.weight"] = sd[m + "shared_expert.up_proj.weight"]
            out[b + "ffn_down_shexp.weight"] = sd[m + "shared_expert.down_proj.weight"]
        else:
            out[b + "ffn_gate.weight"] = sd[m + "gate_proj.weight"]
            out[b + "ffn_up.weight"] = sd[m + "up_proj.weight"]
            out[b + "ffn_down.weight"] = sd[m + "down_proj.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def hf_to_gguf(model, path: str | os.PathLike[str], qtype: str = "F32", *, vocab: Vocab | None = None,
               **convention_switches) -> Path:
    """Convert an HF Qwen3.5 text model to a GGUF at `path` with our writer; returns the path.

    `qtype` is the storage type of the matrices (1-D tensors, norms, routers and conv taps stay F32).
    """
    hp = hparams_of(model.config)
    tensors = hf_to_gguf_tensors(model, **convention_switches)
    write_gguf(path, hp, tensors, vocab or fixture_vocab(hp.n_vocab), qtype=T[qtype],
               name=f"hf-oracle-{hp.arch}-{qtype}")
    return Path(path)


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """float32 [n, vocab] logits of one forward pass over `tokens` (no cache)."""
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    return model(input_ids=ids, use_cache=False).logits[0].to(torch.float32).numpy()
