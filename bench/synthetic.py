"""Synthetic qwen35moe / qwen35 GGUFs with real-model shapes and random valid blocks (benchmarks only).

`MID` is the trunk issue's mid-size MoE: hidden 1024, 24 layers, 64 experts top-8, expert FFN 256,
shared FFN 512, vocab 32k, weights Q4_K with Q6_K down-projections and head (a Q4_K_M-like mix).
`QWEN36_35B` and `QWEN35_9B` have the published shapes of Qwen3.6-35B-A3B and Qwen3.5-9B (hidden, layers, heads,
GDN heads, experts, vocab 248,320, context 262,144, one MTP block) in the mixes people download: the 35B in
unsloth's UD-Q4_K_M (Q8_0 attention, GDN and shared expert, Q4_K expert gate/up, Q5_K expert down, Q6_K head), the
9B in llama.cpp's Q4_K_M (Q4_K, Q6_K FFN down and head). Tensors are drawn as they are written (writer.Lazy), so a
20 GB file is written with one tensor in memory.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.storage.modelfile import expected_tensors
from engine.storage.quantize import random_blocks
from engine.storage.writer import Lazy, Vocab, make_hparams, write_gguf

@dataclass(frozen=True)
class Shape:
    arch: str = "qwen35moe"
    n_layer: int = 24
    n_embd: int = 1024
    n_vocab: int = 32768
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 256
    ssm_n_group: int = 8
    ssm_dt_rank: int = 16
    ssm_d_state: int = 128
    n_expert: int = 64
    n_expert_used: int = 8
    n_ff_exp: int = 256
    n_ff_shexp: int = 512
    n_ff: int = 0  # dense FFN width (qwen35)
    mtp: bool = True
    mix: str = "q4_k_m"  # "q4_k_m": Q4_K, Q6_K expert down and head; "ud-q4_k_m": see the module docstring
    n_ctx_train: int = 8192
    bpe: bool = False  # a full BPE vocabulary (a merge per token, as real files have) instead of byte tokens + filler


MID = Shape()
QWEN36_35B = Shape(n_layer=40, n_embd=2048, n_vocab=248320, n_head=16, n_head_kv=2, ssm_n_group=16, ssm_dt_rank=32,
                   n_expert=256, n_ff_exp=512, n_ff_shexp=512, mix="ud-q4_k_m", n_ctx_train=262144, bpe=True)
QWEN35_9B = Shape(arch="qwen35", n_layer=32, n_embd=4096, n_vocab=248320, n_head=16, n_head_kv=4, ssm_n_group=16,
                  ssm_dt_rank=32, n_expert=0, n_expert_used=0, n_ff_exp=0, n_ff_shexp=0, n_ff=12288, mix="q4_k_m",
                  n_ctx_train=262144, bpe=True)
TINY = Shape(n_layer=4, n_embd=256, n_vocab=512, n_head=2, n_head_kv=1, head_dim=128, ssm_n_group=2, ssm_dt_rank=2,
             ssm_d_state=128, n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256)  # smoke runs: rows of 256
SHAPES = {"mid": MID, "qwen36-35b": QWEN36_35B, "qwen35-9b": QWEN35_9B, "tiny": TINY}

_Q8_0_IN_UD = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "attn_qkv.", "attn_gate.", "ssm_alpha.", "ssm_beta.",
               "ssm_out.", "_shexp.", "eh_proj.")


def matrix_type(name: str, mix: str) -> T:
    """The storage type of a 2-D/3-D weight in `mix`."""
    if name.endswith(("output.weight", "shared_head_head.weight")):
        return T.Q6_K
    if mix == "ud-q4_k_m":
        if "ffn_down_exps" in name:
            return T.Q5_K
        return T.Q8_0 if any(k in name for k in _Q8_0_IN_UD) else T.Q4_K
    return T.Q6_K if name.endswith(("ffn_down_exps.weight", "ffn_down.weight")) else T.Q4_K


def byte_vocab(n_vocab: int) -> Vocab:
    """256 byte tokens, filler, and the ChatML specials: enough for loading and benchmarking."""
    from engine.tokenizer import BYTE_TO_UNICODE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "i n", "Ġt he"]  # GGUF readers need a non-empty merge list
    merged = [m.replace(" ", "") for m in merges]
    n_pad = n_vocab - 256 - len(merged) - len(specials)
    tokens = list(BYTE_TO_UNICODE) + merged + [f"[PAD{i}]" for i in range(n_pad)] + specials
    types = [1] * (256 + len(merged)) + [5] * n_pad + [3] * 3
    return Vocab(tokens, types, merges, bos_id=n_vocab - 3, eos_id=n_vocab - 1, pad_id=n_vocab - 3)


def bpe_vocab(n_vocab: int, seed: int = 0) -> Vocab:
    """256 byte tokens, then tokens made by merging two earlier ones (each with its merge rule, up to 16 characters),
    and the ChatML specials: a vocabulary and merge list the size of a real one, for load-time measurements."""
    from engine.tokenizer import BYTE_TO_UNICODE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = list(BYTE_TO_UNICODE)
    seen, merges = set(tokens), []
    rng = np.random.default_rng(seed)
    n_merge = n_vocab - len(tokens) - len(specials)
    while len(merges) < n_merge:
        for a, b in rng.integers(0, len(tokens), (4096, 2)):
            t = tokens[a] + tokens[b]
            if len(t) <= 16 and t not in seen and len(merges) < n_merge:
                seen.add(t)
                tokens.append(t)
                merges.append(f"{tokens[a]} {tokens[b]}")
    types = [1] * len(tokens) + [3] * len(specials)
    return Vocab(tokens + specials, types, merges, bos_id=n_vocab - 3, eos_id=n_vocab - 1, pad_id=n_vocab - 3)


def write_synthetic(path: str | Path, s: Shape = MID, seed: int = 0, float_source: bool = False) -> Path:
    """`float_source`: F16 matrices (random normal) instead of quantized blocks, for llama.cpp to quantize."""
    hp = make_hparams(s.arch, n_layer=s.n_layer, n_embd=s.n_embd, n_vocab=s.n_vocab, n_head=s.n_head,
                      n_head_kv=s.n_head_kv, head_dim=s.head_dim, ssm_n_group=s.ssm_n_group,
                      ssm_dt_rank=s.ssm_dt_rank, ssm_d_state=s.ssm_d_state, n_ff=s.n_ff, n_expert=s.n_expert,
                      n_expert_used=s.n_expert_used, n_ff_exp=s.n_ff_exp, n_ff_shexp=s.n_ff_shexp,
                      n_mtp=1 if s.mtp else 0, n_ctx_train=s.n_ctx_train)
    rng = np.random.default_rng(seed)  # drawn in write order: the bytes do not depend on memory or laziness
    tensors: dict[str, Lazy] = {}
    for name, shapes, required in expected_tensors(hp):
        if not required and not name.endswith(("output.weight", "shared_head_norm.weight")):
            continue
        shape = shapes[0] if isinstance(shapes[0], tuple) else shapes
        if len(shape) == 1 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight")):
            tensors[name] = Lazy(lambda name=name, shape=shape: _small(name, shape, rng), T.F32, shape)
            continue
        qt = matrix_type(name, s.mix)
        std = 1.0 if name == "token_embd.weight" else 1 / np.sqrt(shape[-1])
        if float_source:
            tensors[name] = Lazy(lambda shape=shape, std=std: rng.normal(0, std, shape).astype(np.float16), T.F16,
                                 shape)
        else:
            tensors[name] = Lazy(lambda shape=shape, qt=qt, std=std: random_blocks(shape, qt, rng, std), qt, shape)
    vocab = bpe_vocab(s.n_vocab, seed) if s.bpe else byte_vocab(s.n_vocab)
    write_gguf(path, hp, tensors, vocab, name=f"synthetic-{s.arch}")
    return Path(path)


def _small(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("ssm_a"):
        return -np.exp(rng.normal(0, 0.5, shape)).astype(np.float32)
    if name.endswith("norm.weight"):
        return (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
    return rng.normal(0, 1 / np.sqrt(shape[-1]), shape).astype(np.float32)


def cached(name: str = "mid", directory: str | Path = "build/bench", float_source: bool = False) -> Path:
    """The synthetic model `name` (a key of SHAPES), written once under `directory` (`float_source`: its F16 form)."""
    shape = SHAPES[name]
    path = Path(directory) / f"synthetic-{name}{'-f16' if float_source else ''}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_synthetic(tmp, shape, float_source=float_source)
        tmp.replace(path)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="write a synthetic benchmark model")
    ap.add_argument("name", choices=sorted(SHAPES))
    ap.add_argument("--dir", default="build/bench")
    print(cached(ap.parse_args().name, ap.parse_args().dir))
