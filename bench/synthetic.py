"""Synthetic qwen35moe / qwen35 GGUFs with real-model shapes and random valid blocks (benchmarks only).

`MID` is the trunk issue's mid-size MoE: hidden 1024, 24 layers, 64 experts top-8, expert FFN 256,
shared FFN 512, vocab 32k, weights Q4_K with Q6_K down-projections and head (a Q4_K_M-like mix).
`QWEN36_35B` and `QWEN35_9B` have the published shapes of Qwen3.6-35B-A3B and Qwen3.5-9B (hidden, layers, heads,
GDN heads, experts, vocab 248,320, context 262,144, one MTP block) in the mixes people download: the 35B in
unsloth's UD-Q4_K_M (Q8_0 attention, GDN and shared expert, Q4_K expert gate/up, Q5_K expert down, Q6_K head), the
9B in llama.cpp's Q4_K_M (Q4_K, Q6_K FFN down and head). Tensors are drawn as they are written (writer.Lazy), so a
20 GB file is written with one tensor in memory.

Agreement files (`--mtp-agreement P`; `write_synthetic(..., agreement=Agreement(noise))`): the same shapes, types and
bytes per token, built so that the MTP head agrees with the trunk at a chosen rate, in our engine and in llama.cpp
alike. The trunk is a function of the current token only: every attention and GDN output projection is zero, and so
is every FFN down projection (routed and shared experts, or the dense FFN) but the last layer's, so each weight is
still read but adds nothing; the last layer's FFN is live, its down projections small (LIVE_DOWN_SCALE). Embedding
rows are ±a, a ≈ 1 (unit RMS, _sign_rows); the output head's rows have equal norm (`LOGIT_STD`; without it a few
"hub" tokens win every argmax and a greedy run circles among a handful of tokens). The MTP block gets a copy of the
live layer's FFN and its norm, enorm = 1, the output norm as its shared_head_norm and eh_proj = [a·I | 0] (the
identity times the embedding's level on the embedding half, zero on the hidden half): its prediction is then the
trunk's, bit for bit. The knob is a Gaussian matrix of std `noise`/√hidden added to that identity (`noise` None: a
random eh_proj, a head that is never right). The tensors that make the token map (embedding, head, output norm, the
live FFN, eh_proj) are drawn from streams named after them, so a file with fewer trunk layers has the same map: the
calibration of bench/mtp_agreement.py measures agreement on such a file for a ladder of noise levels, and
`noise_for` interpolates it (bench/results/mtp_agreement.json).
"""
from __future__ import annotations

import argparse
import json
import zlib
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import quants as gq
from gguf import GGMLQuantizationType as T

from engine.storage.modelfile import HParams, expected_tensors
from engine.storage.quantize import quantize, random_blocks
from engine.storage.writer import Lazy, Vocab, make_hparams, write_gguf

ROOT = Path(__file__).resolve().parent.parent


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
# TINY for agreement tests: a 4096-token vocabulary (a greedy run over an agreement file's token map, a random function
# of the token, visits about √(πV/2) distinct tokens before it cycles: ~80 here, ~28 with 512) and hidden 512 (at 256,
# eh_proj's rows hold one Q4_K super-block of the identity each, whose scale rounds the noise away)
TINY_MTP = replace(TINY, n_embd=512, n_vocab=4096)
# The sweep's (bench/sweep.py) small MoE with a GPT-2-size vocabulary: the output head's 50,259 rows outweigh the layers
VOCAB50K = replace(TINY, n_vocab=50259, n_expert=16, n_expert_used=4)
# Qwen3.5-0.8B and 2B (dense): 24 layers, 8 query / 2 KV heads of 256, 16 GDN heads of 128 for QK and V, FFN 3584 /
# 6144, the 248,320-token vocabulary (bench/sweep.py's SHAPE_SOURCES says where these numbers come from)
QWEN35_08B = replace(QWEN35_9B, n_layer=24, n_embd=1024, n_head=8, n_head_kv=2, ssm_n_group=16, ssm_dt_rank=16,
                     n_ff=3584)
QWEN35_2B = replace(QWEN35_08B, n_embd=2048, n_ff=6144)
SHAPES = {"mid": MID, "qwen36-35b": QWEN36_35B, "qwen35-9b": QWEN35_9B, "tiny": TINY, "tiny-mtp": TINY_MTP,
          "vocab50k": VOCAB50K, "qwen35-0.8b": QWEN35_08B, "qwen35-2b": QWEN35_2B}

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


def shape_hparams(s: Shape) -> HParams:
    return make_hparams(s.arch, n_layer=s.n_layer, n_embd=s.n_embd, n_vocab=s.n_vocab, n_head=s.n_head,
                        n_head_kv=s.n_head_kv, head_dim=s.head_dim, ssm_n_group=s.ssm_n_group,
                        ssm_dt_rank=s.ssm_dt_rank, ssm_d_state=s.ssm_d_state, n_ff=s.n_ff, n_expert=s.n_expert,
                        n_expert_used=s.n_expert_used, n_ff_exp=s.n_ff_exp, n_ff_shexp=s.n_ff_shexp,
                        n_mtp=1 if s.mtp else 0, n_ctx_train=s.n_ctx_train)


@dataclass(frozen=True)
class Agreement:
    """An agreement file's MTP head (module docstring): eh_proj = [I + N(0, (noise/√hidden)²) | 0], or a random
    eh_proj where `noise` is None (P = 0)."""

    noise: float | None


# Agreement files: the output head's row norm, so the logits' std over a unit-RMS hidden state. Greedy decoding does
# not see it, but a draft's confidence does: at 12 the mid shape's head puts over 0.75 on its top token 58 % of the
# time (median 0.84), as a trained head often does; at a random file's 1, never.
LOGIT_STD = 12.0
# Agreement files: the live FFN's down projections' std, in units of a random file's. A routing near-tie or an
# activation's rounding moves the FFN's output: at 1 that output is ~1.3× the embedding's norm, and any noise at all
# on eh_proj (once the head's input leaves the 8-bit grid the embedding is on) drops the mid shape's agreement from
# 1 to ~0.95 at once; at 0.03 (~4 % of the embedding's norm) agreement falls smoothly with the noise, 0.994 at
# 0.0005, 0.90 at 0.032 (1,000 random tokens, our engine).
LIVE_DOWN_SCALE = 0.03
ROWS_PER_CHUNK = 8192  # embedding and head rows drawn and encoded at a time (a 248k × 4096 table is 4 GB as floats)
_MIXER_OUT = ("attn_output.weight", "ssm_out.weight")
_FFN_DOWN = ("ffn_down_exps.weight", "ffn_down_shexp.weight", "ffn_down.weight")
EH_PROJ = "nextn.eh_proj.weight"


def write_synthetic(path: str | Path, s: Shape = MID, seed: int = 0, float_source: bool = False,
                    agreement: Agreement | None = None) -> Path:
    """`float_source`: F16 matrices (random normal) instead of quantized blocks, for llama.cpp to quantize.
    `agreement`: an agreement file (module docstring)."""
    if agreement is not None and not s.mtp:
        raise ValueError("an agreement file needs an MTP block")
    hp = shape_hparams(s)
    rng = np.random.default_rng(seed)  # drawn in write order: the bytes do not depend on memory or laziness
    tensors: dict[str, Lazy] = {}
    for name, shape in _tensor_shapes(hp):
        qt = _storage_type(name, shape, s.mix, float_source)
        make = _agreement_maker(name, shape, qt, s, agreement, seed) if agreement is not None else None
        if make is None:
            make = lambda name=name, shape=shape, qt=qt: _random(name, shape, qt, rng)  # noqa: E731
        tensors[name] = Lazy(make, qt, shape)
    vocab = bpe_vocab(s.n_vocab, seed) if s.bpe else byte_vocab(s.n_vocab)
    write_gguf(path, hp, tensors, vocab, name=f"synthetic-{s.arch}")
    return Path(path)


def set_mtp_noise(path: str | Path, s: Shape, agreement: Agreement, seed: int = 0) -> None:
    """Rewrite an agreement file's eh_proj in place for another noise level: the bytes `write_synthetic` would write
    with `agreement` (the rest of the file does not depend on it). Nothing may have the file loaded meanwhile."""
    name = f"blk.{s.n_layer}.{EH_PROJ}"
    reader = GGUFReader(path)
    info = next(t for t in reader.tensors if t.name == name)
    offset, n_bytes, qt = int(info.data_offset), int(info.n_bytes), T(info.tensor_type)
    del reader, info  # its memory map
    data = np.ascontiguousarray(_eh_proj((s.n_embd, 2 * s.n_embd), qt, agreement, seed, s.mix))
    if data.nbytes != n_bytes:
        raise ValueError(f"{path}: {name} holds {n_bytes} bytes, not {data.nbytes}: not an agreement file of {s}")
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data.tobytes())


def _tensor_shapes(hp: HParams) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors a synthetic file holds: the required ones, the LM head and the MTP block's own output norm."""
    out = []
    for name, shapes, required in expected_tensors(hp):
        if required or name.endswith(("output.weight", "shared_head_norm.weight")):
            out.append((name, shapes[0] if isinstance(shapes[0], tuple) else shapes))
    return out


def _storage_type(name: str, shape: tuple[int, ...], mix: str, float_source: bool) -> T:
    if len(shape) == 1 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight")):
        return T.F32
    return T.F16 if float_source else matrix_type(name, mix)


def _random(name: str, shape: tuple[int, ...], qt: T, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """A random file's tensor: small vectors (_small), else blocks of values with std `scale`/√fan-in (`scale` for
    the embedding)."""
    if qt == T.F32:
        return _small(name, shape, rng)
    std = scale if name == "token_embd.weight" else scale / np.sqrt(shape[-1])
    if qt == T.F16:
        return rng.normal(0, std, shape).astype(np.float16)
    return random_blocks(shape, qt, rng, std)


def _small(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("ssm_a"):
        return -np.exp(rng.normal(0, 0.5, shape)).astype(np.float32)
    if name.endswith("norm.weight"):
        return (1 + rng.normal(0, 0.1, shape)).astype(np.float32)
    return rng.normal(0, 1 / np.sqrt(shape[-1]), shape).astype(np.float32)


def _agreement_maker(name: str, shape: tuple[int, ...], qt: T, s: Shape, a: Agreement,
                     seed: int) -> Callable[[], np.ndarray] | None:
    """How an agreement file makes `name` where that differs from a random file (module docstring), else None."""
    if name == "token_embd.weight":
        return lambda: _sign_rows(shape, qt, _stream(seed, name))
    if name == "output.weight":
        return lambda: _normed_rows(shape, qt, LOGIT_STD, _stream(seed, name))
    if name.endswith(("output_norm.weight", "shared_head_norm.weight")):  # the MTP head's is a copy of the trunk's
        return lambda: _small(name, shape, _stream(seed, "output_norm.weight"))
    _, layer, part = name.split(".", 2)
    il, live = int(layer), s.n_layer - 1
    if part in _MIXER_OUT or (part in _FFN_DOWN and il < live):
        return lambda: _zeros(shape, qt)
    if il >= live and (part.startswith("ffn_") or part == "post_attention_norm.weight"):  # the live FFN, or its copy
        scale = LIVE_DOWN_SCALE if part in _FFN_DOWN else 1.0
        return lambda: _random(part, shape, qt, _stream(seed, "live." + part), scale)
    if part == "nextn.enorm.weight":
        return lambda: np.ones(shape, np.float32)
    if part == EH_PROJ:
        return lambda: _eh_proj(shape, qt, a, seed, s.mix)
    return None


def _stream(seed: int, role: str) -> np.random.Generator:
    """A random stream of its own for one role, whatever else the file holds."""
    return np.random.default_rng([seed, zlib.crc32(role.encode())])


def _encode(x: np.ndarray, qt: T) -> np.ndarray:
    return x.astype(np.float16) if qt == T.F16 else quantize(x, qt)


def _zeros(shape: tuple[int, ...], qt: T) -> np.ndarray:
    """Zero values (all-zero blocks: every scale zero), without making the floats."""
    if qt in (T.F32, T.F16):
        return np.zeros(shape, np.float32 if qt == T.F32 else np.float16)
    block, size = GGML_QUANT_SIZES[qt]
    return np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8)


def _rows(shape: tuple[int, ...], qt: T, draw: Callable[[int], np.ndarray]) -> np.ndarray:
    """A table of rows `draw(n)` makes, encoded as `qt` ROWS_PER_CHUNK rows at a time."""
    out = None
    for start in range(0, shape[0], ROWS_PER_CHUNK):
        q = _encode(draw(min(ROWS_PER_CHUNK, shape[0] - start)), qt)
        if out is None:
            out = np.empty((shape[0], q.shape[1]), q.dtype)
        out[start:start + len(q)] = q
    assert out is not None
    return out


def _sign_rows(shape: tuple[int, ...], qt: T, rng: np.random.Generator) -> np.ndarray:
    """Rows of ±v, v the level near 1 that `qt` stores as exactly ±a (_sign_level): RMS a, on an 8-bit activation
    grid, so that the MTP head's eh_proj product (its normed embedding times a·I, _eh_proj) gives the embedding back
    to the last bits and its FFN routes and computes as the trunk's live layer does, bit for bit."""
    v, _ = _sign_level(qt)
    levels = np.array([-v, v], np.float32)
    return _rows(shape, qt, lambda n: rng.choice(levels, (n, shape[1])))


def _stored(x: np.ndarray, qt: T) -> np.ndarray:
    """The values `qt` stores for x."""
    return x.astype(np.float16).astype(np.float32) if qt in (T.F16, T.F32) else gq.dequantize(_encode(x, qt), qt)


@lru_cache
def _sign_level(qt: T) -> tuple[np.float32, float]:
    """(v, a): the level v nearest 1 (within 2 %) whose ±v values `qt` stores as exactly ±a (Q4_K's minimum and
    scale fields round apart: ±1 is stored as −0.99976 / +1.00096; ±0.99535 as ±0.99495)."""
    signs = np.resize(np.array([-1.0, 1.0], np.float32), (1, 256))
    for v in sorted(np.linspace(0.98, 1.02, 801, dtype=np.float32), key=lambda v: abs(v - 1)):
        y = _stored(signs * v, qt)
        if np.all(np.abs(y) == abs(y.flat[0])):
            return v, float(abs(y.flat[0]))
    raise ValueError(f"no level near 1 that {qt.name} stores symmetrically")


@lru_cache
def _identity_level(a: float, qt: T) -> np.float32:
    """The diagonal u for which `qt` stores an identity's diagonal nearest a (Q4_K: exactly; Q8_0: within 5e-4)."""
    row = np.zeros((1, 256), np.float32)

    def stored(u: np.float32) -> float:
        row[0, 0] = u
        return float(_stored(row, qt)[0, 0])
    candidates = np.float32(a) * (1 + np.linspace(-2e-3, 2e-3, 401, dtype=np.float32))
    return min(candidates, key=lambda u: (abs(stored(u) - a), abs(u - a)))


def _normed_rows(shape: tuple[int, ...], qt: T, norm: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian rows scaled to Euclidean norm `norm`."""
    def draw(n: int) -> np.ndarray:
        x = rng.standard_normal((n, shape[1]), dtype=np.float32)
        return x * (np.float32(norm) / np.linalg.norm(x, axis=1, keepdims=True))
    return _rows(shape, qt, draw)


def _eh_proj(shape: tuple[int, ...], qt: T, a: Agreement, seed: int, mix: str) -> np.ndarray:
    """[u·I + noise | 0], u·I stored as the embedding's level times I (the embedding F16 where eh_proj is: a
    float-source file); or random (a.noise None)."""
    d = shape[0]
    rng = _stream(seed, EH_PROJ)
    if a.noise is None:
        return _encode(rng.normal(0, 1 / np.sqrt(shape[1]), shape).astype(np.float32), qt)
    _, level = _sign_level(T.F16 if qt == T.F16 else matrix_type("token_embd.weight", mix))
    x = np.zeros(shape, np.float32)
    x[:, :d] = _identity_level(level, qt) * np.eye(d, dtype=np.float32)
    x[:, :d] += rng.normal(0, a.noise / np.sqrt(d), (d, d)).astype(np.float32)
    return _encode(x, qt)


# ---------------------------------------------------------------------------------------------- agreement levels
CALIBRATION = ROOT / "bench/results/mtp_agreement.json"


def noise_for(name: str, p: float, table: Path = CALIBRATION) -> Agreement:
    """The agreement file of shape `name` whose MTP head agrees with the trunk at first position at rate `p`: the noise
    level interpolated between the calibration's measured levels (linear in the noise; the measured agreement made
    non-increasing in it first, as it is but for sampling). P = 0: a random head."""
    if not 0 <= p <= 1:
        raise ValueError(f"agreement {p} not in [0, 1]")
    if p == 0:
        return Agreement(None)
    cal = json.loads(table.read_text())["calibration"].get(name) if table.exists() else None
    if cal is None:
        raise ValueError(f"no agreement calibration for {name!r} in {table}: run python bench/mtp_agreement.py "
                         f"calibrate --shapes {name}")
    points = sorted((c["noise"], c["agreement"]) for c in cal["levels"])
    noise = [x for x, _ in points]
    agree = np.minimum.accumulate([y for _, y in points])
    if p >= agree[0]:
        return Agreement(noise[0])
    if p < agree[-1]:
        raise ValueError(f"{name}: agreement {p} is below the calibrated range (least {agree[-1]:.3f} at noise "
                         f"{noise[-1]}): calibrate with higher noise levels")
    i = int(np.nonzero(agree <= p)[0][0])  # the first level at or below p; the one before is above it
    f = (agree[i - 1] - p) / (agree[i - 1] - agree[i])
    return Agreement(float(noise[i - 1] + f * (noise[i] - noise[i - 1])))


def cached(name: str = "mid", directory: str | Path = "build/bench", float_source: bool = False,
           agreement: float | None = None) -> Path:
    """The synthetic model `name` (a key of SHAPES), written once under `directory` (`float_source`: its F16 form;
    `agreement`: the agreement file at that first-position rate)."""
    shape = SHAPES[name]
    tag = ("-f16" if float_source else "") + (f"-mtp{agreement:g}" if agreement is not None else "")
    path = Path(directory) / f"synthetic-{name}{tag}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_synthetic(tmp, shape, float_source=float_source,
                        agreement=noise_for(name, agreement) if agreement is not None else None)
        tmp.replace(path)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="write a synthetic benchmark model")
    ap.add_argument("name", choices=sorted(SHAPES))
    ap.add_argument("--dir", default="build/bench")
    ap.add_argument("--mtp-agreement", type=float, metavar="P",
                    help="an MTP head that agrees with the trunk at first position at rate P (0: a random head)")
    args = ap.parse_args()
    print(cached(args.name, args.dir, agreement=args.mtp_agreement))
