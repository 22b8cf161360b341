"""Tiny random qwen35moe / qwen35 GGUFs written with our writer (and so with the `gguf` package).

Weights are random but shaped like a trained model's: norms near 1 (stored 1+w), negative `ssm_a`,
1/√fan-in projections, and an embedding / LM-head scale that gives well-separated logits (spec §8(b)).
Files are cached per spec in one directory per test session.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.cache import Cache
from engine.storage.modelfile import HParams, expected_tensors
from engine.storage.writer import Vocab, make_hparams, write_gguf

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class FixtureSpec:
    arch: str = "qwen35moe"
    mtp: bool = True
    qtype: str = "F32"  # storage type of the matrices; 1-D tensors are always F32
    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    ssm_d_state: int = 16
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    n_ff_shexp: int = 32
    n_ff: int = 96
    n_vocab: int = 384
    logit_scale: float = 4.0  # std of the logits, in units of a unit-variance hidden state
    output_type: str | None = None  # e.g. "Q6_K" for a Q4_K_M-like mix
    expert_down_type: str | None = None  # the routed experts' down projections (UD-Q4_K_M: Q5_K)
    tied: bool = False
    chat_template: bool = True
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


# Ready-made specs. K-quant blocks hold 256 values, so every row length is a multiple of 256 there.
TINY_MOE = FixtureSpec()
TINY_DENSE = FixtureSpec(arch="qwen35", n_ff=96)
KQUANT_MOE = FixtureSpec(
    qtype="Q4_K", output_type="Q6_K", n_embd=256, n_head=4, head_dim=64, ssm_d_state=64, ssm_dt_rank=4,
    n_ff_exp=256, n_ff_shexp=256, n_layer=4,
)
KQUANT_DENSE = replace(KQUANT_MOE, arch="qwen35", n_ff=256)
# The popular Qwen3.6 UD-Q4_K_M mix: Q4_K matrices, Q5_K routed expert down projections, a Q6_K LM head
UD_Q4_K_M_MOE = replace(KQUANT_MOE, expert_down_type="Q5_K")


def hparams_of(spec: FixtureSpec) -> HParams:
    moe = spec.arch == "qwen35moe"
    return make_hparams(
        spec.arch, n_layer=spec.n_layer, n_embd=spec.n_embd, n_vocab=spec.n_vocab, n_head=spec.n_head,
        n_head_kv=spec.n_head_kv, head_dim=spec.head_dim, ssm_d_state=spec.ssm_d_state,
        ssm_n_group=spec.ssm_n_group, ssm_dt_rank=spec.ssm_dt_rank, n_ff=0 if moe else spec.n_ff,
        n_expert=spec.n_expert if moe else 0, n_expert_used=spec.n_expert_used if moe else 0,
        n_ff_exp=spec.n_ff_exp if moe else 0, n_ff_shexp=spec.n_ff_shexp if moe else 0,
        n_mtp=1 if spec.mtp else 0, n_ctx_train=4096,
    )


def random_tensors(hp: HParams, spec: FixtureSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    out: dict[str, np.ndarray] = {}
    for name, shapes, required in expected_tensors(hp):
        # Real MTP files carry shared_head_norm (spec §2.6); without it llama.cpp silently falls back
        # to output_norm, and a wrong norm in our MTP head would go unnoticed.
        optional_kept = (name == "output.weight" and not spec.tied) or name.endswith("nextn.shared_head_norm.weight")
        if not required and not optional_kept:
            continue
        shape = shapes[0] if isinstance(shapes[0], tuple) else shapes
        out[name] = _init(name, shape, rng, spec)
    return out


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator, spec: FixtureSpec) -> np.ndarray:
    f32 = np.float32
    if name.endswith("ssm_a"):
        return (-np.exp(rng.normal(0.0, 0.5, shape))).astype(f32)
    if name.endswith("ssm_dt.bias"):
        return rng.normal(0.0, 0.5, shape).astype(f32)
    if name.endswith("ssm_conv1d.weight"):
        return rng.normal(0.0, 0.4, shape).astype(f32)
    if name.endswith("norm.weight"):
        return (1.0 + rng.normal(0.0, 0.1, shape)).astype(f32)
    if name == "token_embd.weight":
        return rng.normal(0.0, 1.0, shape).astype(f32)
    if name == "output.weight":
        return rng.normal(0.0, spec.logit_scale / np.sqrt(shape[-1]), shape).astype(f32)
    if name.endswith("ffn_gate_inp.weight"):
        return rng.normal(0.0, 2.0 / np.sqrt(shape[-1]), shape).astype(f32)
    fan_in = shape[-1]
    return rng.normal(0.0, 1.0 / np.sqrt(fan_in), shape).astype(f32)


@lru_cache(maxsize=4)
def fixture_vocab(n_vocab: int, chat_template: bool = True) -> Vocab:
    """A small byte-level BPE vocabulary trained on stdlib docstrings, with the ChatML specials."""
    from engine.tokenizer import PRE_TOKENIZER_PATTERNS
    from engine.training.bpe import train_bpe

    return train_bpe(
        _sample_texts(), n_vocab, pattern=PRE_TOKENIZER_PATTERNS["qwen35"],
        chat_template=CHATML_TEMPLATE if chat_template else None,
    )


def _sample_texts() -> list[str]:
    import collections
    import json as js
    import os as o
    import re
    import textwrap

    mods = (collections, js, o, re, textwrap)
    texts = [m.__doc__ or "" for m in mods]
    for m in mods:
        texts += [getattr(m, n).__doc__ or "" for n in sorted(dir(m)) if not n.startswith("_")][:60]
    texts += ["Hello! How are you? I'm fine, thanks. 12 + 30 = 42. The year is 2026."] * 5
    return texts


def write_fixture(path: str | os.PathLike[str], spec: FixtureSpec) -> Path:
    hp = hparams_of(spec)
    vocab = fixture_vocab(spec.n_vocab, spec.chat_template)
    overrides = {"output.weight": T[spec.output_type]} if spec.output_type else {}
    if spec.expert_down_type:
        overrides["ffn_down_exps.weight"] = T[spec.expert_down_type]
    write_gguf(path, hp, random_tensors(hp, spec), vocab, qtype=T[spec.qtype], type_overrides=overrides or None,
               name=f"fixture-{spec.arch}-{spec.qtype}")
    return Path(path)


_CACHE_DIR = Path(os.environ.get("FORETELL_FIXTURE_DIR") or tempfile.mkdtemp(prefix="foretell-fixtures-"))


def fixture_path(spec: FixtureSpec = TINY_MOE) -> Path:
    """Path of the fixture for `spec`, written on first use (cached for the session)."""
    path = _CACHE_DIR / f"{spec.arch}-{spec.qtype}-{'mtp' if spec.mtp else 'nomtp'}-{spec.key()}.gguf"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        write_fixture(tmp, spec)
        tmp.replace(path)
    return path


if __name__ == "__main__":  # `python -m tests.fixtures OUT.gguf`: a demo model for `make run`
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "fixture.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_fixture(out, TINY_MOE)
    print(out)


# Rewinding a cache (tests and benchmarks; the engine itself never rewinds GDN states: it commits captured ones)

def snapshot(cache: Cache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the cache's GDN states (conv and recurrent), to rewind it with `restore` between passes."""
    return {i: (s.conv.clone(), s.ssm.clone()) for i, s in cache.gdn.items()}


def restore(cache: Cache, snap: dict[int, tuple[torch.Tensor, torch.Tensor]], pos: int) -> None:
    """The GDN states of `snap` back in `cache`, and its length set to `pos` (the KV rows past it are ignored)."""
    for i, (conv, ssm) in snap.items():
        st = cache.gdn[i]
        if st.conv.is_contiguous() and st.conv.untyped_storage().nbytes() == st.conv.nbytes:
            st.conv.copy_(conv)  # in place, as a decode step leaves it: the next step need not rebind its operands
        else:
            st.set_conv(conv)  # a copy of its own (the current one views a pass's window that captures read)
        st.ssm.copy_(ssm)
    cache.pos = pos
