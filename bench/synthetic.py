"""Synthetic qwen35moe GGUFs with real-model shapes and random valid K-quant blocks (benchmarks only).

`MID` is the trunk issue's mid-size MoE: hidden 1024, 24 layers, 64 experts top-8, expert FFN 256,
shared FFN 512, vocab 32k, weights Q4_K with Q6_K down-projections and head (a Q4_K_M-like mix).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.storage.modelfile import expected_tensors
from engine.storage.quantize import random_blocks
from engine.storage.writer import Raw, Vocab, make_hparams, write_gguf


@dataclass(frozen=True)
class Shape:
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
    mtp: bool = True


MID = Shape()
QWEN36_35B = Shape(n_layer=40, n_embd=2048, n_vocab=248320, n_head=16, n_head_kv=2, ssm_n_group=16, ssm_dt_rank=32,
                   n_expert=256, n_ff_exp=512, n_ff_shexp=512)


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


TINY = Shape(n_layer=4, n_embd=256, n_vocab=512, n_head=2, n_head_kv=1, head_dim=128, ssm_n_group=2, ssm_dt_rank=2,
             ssm_d_state=128, n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256)  # smoke runs: rows of 256


def write_synthetic(path: str | Path, s: Shape = MID, seed: int = 0, float_source: bool = False) -> Path:
    """`float_source`: F16 matrices (random normal) instead of K-quant blocks, for llama.cpp to quantize."""
    hp = make_hparams("qwen35moe", n_layer=s.n_layer, n_embd=s.n_embd, n_vocab=s.n_vocab, n_head=s.n_head,
                      n_head_kv=s.n_head_kv, head_dim=s.head_dim, ssm_n_group=s.ssm_n_group,
                      ssm_dt_rank=s.ssm_dt_rank, ssm_d_state=s.ssm_d_state, n_expert=s.n_expert,
                      n_expert_used=s.n_expert_used, n_ff_exp=s.n_ff_exp, n_ff_shexp=s.n_ff_shexp,
                      n_mtp=1 if s.mtp else 0, n_ctx_train=8192)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray | Raw] = {}
    for name, shapes, required in expected_tensors(hp):
        if not required and not name.endswith(("output.weight", "shared_head_norm.weight")):
            continue
        shape = shapes[0] if isinstance(shapes[0], tuple) else shapes
        if len(shape) == 1 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight")):
            if name.endswith("ssm_a"):
                tensors[name] = -np.exp(rng.normal(0, 0.5, shape)).astype(np.float32)
            elif name.endswith("norm.weight"):
                tensors[name] = (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
            else:
                tensors[name] = rng.normal(0, 1 / np.sqrt(shape[-1]), shape).astype(np.float32)
            continue
        qt = T.Q6_K if name.endswith(("ffn_down_exps.weight", "output.weight")) else T.Q4_K
        std = 1.0 if name == "token_embd.weight" else 1 / np.sqrt(shape[-1])
        tensors[name] = (rng.normal(0, std, shape).astype(np.float16) if float_source
                         else Raw(random_blocks(shape, qt, rng, std), qt, shape))
    write_gguf(path, hp, tensors, byte_vocab(s.n_vocab), qtype=T.F16, name="synthetic-qwen35moe")
    return Path(path)


SHAPES = {"mid": MID, "qwen36-35b": QWEN36_35B, "tiny": TINY}


def cached(name: str = "mid", directory: str | Path = "build/bench", float_source: bool = False) -> Path:
    """The synthetic model `name` ("mid"), written once under `directory` (`float_source`: its F16 form)."""
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
    ap.add_argument("name", choices=list(SHAPES))
    ap.add_argument("--dir", default="build/bench")
    print(cached(ap.parse_args().name, ap.parse_args().dir))
