"""GGUF → ModelFile: metadata parsed into HParams, tensor views (mmap, zero-copy), validation.

Everything a malformed file can do wrong surfaces here as a typed error naming the key or tensor,
before a single weight is touched. Shapes below are in torch order (reversed ggml `ne`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.storage.gguf_read import GGUFFile, regular_file_size

SUPPORTED_ARCHS = ("qwen35moe", "qwen35")
MAX_BLOCKS = 4096
# 1-D parameters (norms, gates, biases): every GGUF converter writes them F32 and quantizers never touch them, so
# another type there is a damaged type field (one that still fits the tensor's alignment padding: the layout check
# cannot see it). The conv kernels are read as floats of any width.
_VECTOR_TYPES = frozenset({GGMLQuantizationType.F32})
_CONV_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
# Ranges of the float hyperparameters (key -> low, high, what models use) beyond which a model computes only garbage,
# far wider than any model's: a rope base of 1 or less turns positions into no rotation a model can read (issue 48:
# 1e-45 loaded and answered "!!!!"); an epsilon past 1e-2 flattens every norm. The low end is excluded.
FLOAT_RANGES = {"rope.freq_base": (1.0, 1e12, "1e4 to 1e7"),
                "attention.layer_norm_rms_epsilon": (0.0, 1e-2, "1e-6 or 1e-5")}


@dataclass(frozen=True)
class HParams:
    """Hyperparameters of a qwen35 / qwen35moe GGUF, with the derived values the graph needs."""

    arch: str
    n_block: int  # block_count as stored: trunk layers + MTP layers
    n_mtp: int  # nextn_predict_layers (0 when the file has no MTP block)
    n_ctx_train: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    rms_eps: float
    n_rot: int
    rope_base: float
    rope_sections: tuple[int, ...]
    ssm_conv_kernel: int
    ssm_d_state: int  # d_k = d_v of the GDN heads
    ssm_n_group: int  # H_k
    ssm_dt_rank: int  # H_v
    ssm_d_inner: int  # H_v * d_v
    full_attention_interval: int
    recurrent: tuple[bool, ...]  # per trunk layer: True = Gated DeltaNet, False = gated attention
    n_ff: int = 0  # dense FFN width (qwen35)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0

    @property
    def n_layer(self) -> int:
        """Trunk layers (llama.cpp's n_layer()): the MTP block is not run by the trunk."""
        return self.n_block - self.n_mtp

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen35moe"

    @property
    def has_mtp(self) -> bool:
        return self.n_mtp > 0

    @property
    def mtp_layer(self) -> int | None:
        return self.n_layer if self.n_mtp else None

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_dt_rank

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the GDN conv: [q (H_k·d_k) ; k (H_k·d_k) ; v (H_v·d_v)]."""
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_d_inner

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if not r)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.recurrent) if r)

    def conv_state_floats(self) -> int:
        """llama.cpp's n_embd_r: the last K-1 pre-conv vectors per GDN layer."""
        return (self.ssm_conv_kernel - 1) * self.ssm_conv_dim

    def ssm_state_floats(self) -> int:
        """llama.cpp's n_embd_s: one d_k × d_v matrix per value head."""
        return self.ssm_d_state * self.ssm_d_inner


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order
    n_elements: int
    n_bytes: int
    offset: int


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every tensor in the file
    trunk: int  # without the MTP block
    active: int  # trunk parameters touched per token (k of E routed experts)
    mtp: int


def expected_tensors(hp: HParams) -> Iterator[tuple[str, tuple[int, ...] | tuple[tuple[int, ...], ...], bool]]:
    """(name, allowed torch shape(s), required) for every tensor the architecture reads."""
    d, V = hp.n_embd, hp.n_vocab
    yield "token_embd.weight", (V, d), True
    yield "output_norm.weight", (d,), True
    yield "output.weight", (V, d), False  # absent → tied to token_embd
    for i in range(hp.n_block):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (d,), True
        yield p + "post_attention_norm.weight", (d,), True
        if i < hp.n_layer and hp.recurrent[i]:
            C, Hv, dv = hp.ssm_conv_dim, hp.ssm_dt_rank, hp.ssm_head_v_dim
            yield p + "attn_qkv.weight", (C, d), True
            yield p + "attn_gate.weight", (hp.ssm_d_inner, d), True
            yield p + "ssm_beta.weight", (Hv, d), True
            yield p + "ssm_alpha.weight", (Hv, d), True
            yield p + "ssm_a", (Hv,), True
            yield p + "ssm_dt.bias", (Hv,), True
            yield p + "ssm_conv1d.weight", (C, hp.ssm_conv_kernel), True
            yield p + "ssm_norm.weight", (dv,), True
            yield p + "ssm_out.weight", (d, hp.ssm_d_inner), True
        else:
            Dk, Dv = hp.head_dim_k, hp.head_dim_v
            yield p + "attn_q.weight", (2 * hp.n_head * Dk, d), True
            yield p + "attn_k.weight", (hp.n_head_kv * Dk, d), True
            yield p + "attn_v.weight", (hp.n_head_kv * Dv, d), True
            yield p + "attn_output.weight", (d, hp.n_head * Dv), True
            yield p + "attn_q_norm.weight", (Dk,), True
            yield p + "attn_k_norm.weight", (Dk,), True
        if hp.is_moe:
            E, F, Fs = hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp
            yield p + "ffn_gate_inp.weight", (E, d), True
            yield p + "ffn_gate_exps.weight", (E, F, d), True
            yield p + "ffn_up_exps.weight", (E, F, d), True
            yield p + "ffn_down_exps.weight", (E, d, F), True
            if Fs:
                yield p + "ffn_gate_inp_shexp.weight", ((d,), (1, d)), True
                yield p + "ffn_gate_shexp.weight", (Fs, d), True
                yield p + "ffn_up_shexp.weight", (Fs, d), True
                yield p + "ffn_down_shexp.weight", (d, Fs), True
        else:
            yield p + "ffn_gate.weight", (hp.n_ff, d), True
            yield p + "ffn_up.weight", (hp.n_ff, d), True
            yield p + "ffn_down.weight", (d, hp.n_ff), True
        if i >= hp.n_layer:  # the MTP ("nextn") block
            yield p + "nextn.eh_proj.weight", (d, 2 * d), True
            yield p + "nextn.enorm.weight", (d,), True
            yield p + "nextn.hnorm.weight", (d,), True
            yield p + "nextn.shared_head_norm.weight", (d,), False
            yield p + "nextn.embed_tokens.weight", (V, d), False
            yield p + "nextn.shared_head_head.weight", (V, d), False


EMBEDDED_DIR = Path(__file__).resolve().parents[2] / "resources" / "models"


def default_model_path() -> Path:
    """The embedded default model shipped in resources/models/ (the last .gguf there by name)."""
    from engine.errors import EngineError

    found = sorted(EMBEDDED_DIR.glob("*.gguf")) if EMBEDDED_DIR.is_dir() else []
    if not found:
        raise EngineError(f"no MODEL given and no embedded model found in {EMBEDDED_DIR}; pass a GGUF path")
    return found[-1]


def open_model(path: str | os.PathLike[str]) -> "ModelFile":
    """Open and validate a GGUF. Raises ModelFormatError / UnsupportedModelError, nothing else."""
    return ModelFile(path)


class ModelFile:
    """A validated, memory-mapped GGUF. Tensor bytes are never copied here."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.file_size = regular_file_size(self.path)
        self.gguf = GGUFFile(self.path)  # every count, length, offset and the layout checked on the way
        if not self.gguf.tensors:
            raise UnsupportedModelError(f"{self.path.name}: a vocabulary-only GGUF (no tensors): it holds a "
                                        "tokenizer, not a model to run")
        from engine.storage.pages import register_file_mapping

        register_file_mapping(self.gguf.data)
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, t.qtype, t.shape, t.n_elements, t.n_bytes, t.offset) for t in self.gguf.tensors
        }
        self._raw = {t.name: t for t in self.gguf.tensors}
        self.hparams = self._parse_hparams()
        fused = next((n for n in self.tensors if n.endswith("ffn_gate_up_exps.weight")), None)
        if fused:
            raise UnsupportedModelError(
                f"{self.path.name}: fused expert tensors ('{fused}') are not supported; convert without --fuse"
            )
        self._validate_tensors()
        self.gguf.check_data()

    # -- metadata --------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.gguf.fields)

    def has_key(self, key: str) -> bool:
        return key in self.gguf.fields

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value as a Python object (str, int, float, bool, or list); default if absent."""
        if key not in self.gguf.fields:
            return default
        return self._value(key)

    def require(self, key: str, kind: type | tuple[type, ...] = (int, float, str, bool, list)) -> Any:
        if key not in self.gguf.fields:
            raise ModelFormatError(f"{self.path.name}: required metadata key '{key}' is missing")
        value = self._value(key)
        if not isinstance(value, kind):
            raise ModelFormatError(
                f"{self.path.name}: metadata key '{key}' has type {type(value).__name__}, expected {_kind_name(kind)}"
            )
        return value

    def _value(self, key: str) -> Any:
        field = self.gguf.fields[key]
        if field.item_type is not None:  # arrays anew on each call: kept here, a vocabulary would outlive its use
            return field.contents()
        cache = self.__dict__.setdefault("_values", {})
        if key not in cache:
            cache[key] = field.contents()
        return cache[key]

    @property
    def metadata(self) -> dict[str, Any]:
        """Every metadata key decoded, the arrays (the tokenizer's vocabulary, types and merges) anew on each call."""
        return {k: self._value(k) for k in self.keys()}

    @property
    def arch(self) -> str:
        return self.hparams.arch

    def _parse_hparams(self) -> HParams:
        arch = self.require("general.architecture", str)
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"{self.path.name}: architecture '{arch}' is not supported; Foretell runs {', '.join(SUPPORTED_ARCHS)}"
            )

        def num(key: str, default: Any = None, kind: type = int) -> Any:
            full = f"{arch}.{key}"
            if default is not None and full not in self.gguf.fields:
                return default
            v = self.require(full, float if kind is float else int)  # a float key stored as an integer: damaged
            if kind is int and (isinstance(v, bool) or v < 0):
                raise ModelFormatError(f"{self.path.name}: metadata key '{full}' = {v} must be a non-negative integer")
            return kind(v)

        n_block = num("block_count")
        if not 1 <= n_block <= min(MAX_BLOCKS, len(self.tensors) // 2):  # ≥ 2 tensors (norms) per block
            raise ModelFormatError(f"{self.path.name}: '{arch}.block_count' = {n_block} does not fit the file's "
                                   f"{len(self.tensors)} tensors")
        n_mtp = num("nextn_predict_layers", 0)
        if n_mtp > 1:
            raise UnsupportedModelError(f"{self.path.name}: {n_mtp} MTP blocks; only one (nextn_predict_layers=1) is supported")
        n_layer = n_block - n_mtp
        if n_layer < 1:
            raise ModelFormatError(f"{self.path.name}: block_count {n_block} leaves no trunk layers after {n_mtp} MTP layers")
        n_embd = num("embedding_length")
        n_head = num("attention.head_count")
        n_head_kv = num("attention.head_count_kv")
        head_dim_k = num("attention.key_length", n_embd // max(n_head, 1))
        head_dim_v = num("attention.value_length", head_dim_k)
        interval = num("full_attention_interval", 4)
        if interval < 1:
            raise ModelFormatError(f"{self.path.name}: '{arch}.full_attention_interval' must be ≥ 1, got {interval}")
        override = self.get(f"{arch}.attention.recurrent_layers")
        if override is not None:
            if not isinstance(override, list) or len(override) < n_layer:
                raise ModelFormatError(
                    f"{self.path.name}: '{arch}.attention.recurrent_layers' must list {n_layer} booleans"
                )
            recurrent = tuple(bool(x) for x in override[:n_layer])
        else:
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
        sections = self.get(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
        if not isinstance(sections, list) or not all(isinstance(s, int) for s in sections):
            raise ModelFormatError(f"{self.path.name}: '{arch}.rope.dimension_sections' must be an integer array")
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFormatError(f"{self.path.name}: required tensor 'token_embd.weight' is missing")
        if len(embd.shape) != 2 or embd.shape[1] != n_embd:
            raise ModelFormatError(
                f"{self.path.name}: tensor 'token_embd.weight' has shape {embd.shape}, expected (n_vocab, {n_embd})"
            )
        n_vocab = embd.shape[0]
        tokens = self.gguf.fields.get("tokenizer.ggml.tokens")
        if tokens is not None and tokens.count != n_vocab:
            raise ModelFormatError(
                f"{self.path.name}: 'tokenizer.ggml.tokens' has {tokens.count} entries but token_embd has {n_vocab} rows"
            )
        hp = HParams(
            arch=arch, n_block=n_block, n_mtp=n_mtp,
            n_ctx_train=num("context_length"), n_embd=n_embd, n_vocab=n_vocab,
            n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v,
            rms_eps=num("attention.layer_norm_rms_epsilon", kind=float),
            n_rot=num("rope.dimension_count", head_dim_k), rope_base=num("rope.freq_base", 10000.0, float),
            rope_sections=tuple(sections),
            ssm_conv_kernel=num("ssm.conv_kernel"), ssm_d_state=num("ssm.state_size"),
            ssm_n_group=num("ssm.group_count"), ssm_dt_rank=num("ssm.time_step_rank"),
            ssm_d_inner=num("ssm.inner_size"), full_attention_interval=interval, recurrent=recurrent,
            n_ff=num("feed_forward_length", 0),
            n_expert=num("expert_count", 0) if arch == "qwen35moe" else 0,
            n_expert_used=num("expert_used_count", 0) if arch == "qwen35moe" else 0,
            n_ff_exp=num("expert_feed_forward_length", 0) if arch == "qwen35moe" else 0,
            n_ff_shexp=num("expert_shared_feed_forward_length", 0) if arch == "qwen35moe" else 0,
        )
        self._check_hparams(hp)
        return hp

    def _check_hparams(self, hp: HParams) -> None:
        name = self.path.name

        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ModelFormatError(f"{name}: inconsistent hyperparameters: {what}")

        need(hp.n_head > 0 and hp.n_head_kv > 0 and hp.n_head % hp.n_head_kv == 0,
             f"attention.head_count {hp.n_head} must be a positive multiple of head_count_kv {hp.n_head_kv}")
        need(hp.head_dim_k > 0 and 0 < hp.n_rot <= hp.head_dim_k and hp.n_rot % 2 == 0,
             f"rope.dimension_count {hp.n_rot} must be even and ≤ key_length {hp.head_dim_k}")
        for key, value in (("rope.freq_base", hp.rope_base), ("attention.layer_norm_rms_epsilon", hp.rms_eps)):
            low, high, usual = FLOAT_RANGES[key]
            if not low < value <= high:  # NaN too
                raise ModelFormatError(f"{name}: metadata key '{hp.arch}.{key}' = {value:g} is out of range "
                                       f"(above {low:g}, at most {high:g}; models use {usual})")
        need(hp.n_ctx_train >= 1, f"context_length {hp.n_ctx_train} must be ≥ 1")
        need(all(s >= 0 for s in hp.rope_sections), f"rope.dimension_sections {list(hp.rope_sections)} must not be "
             "negative")
        need(hp.ssm_n_group > 0 and hp.ssm_dt_rank > 0 and hp.ssm_dt_rank % hp.ssm_n_group == 0,
             f"ssm.time_step_rank {hp.ssm_dt_rank} must be a positive multiple of ssm.group_count {hp.ssm_n_group}")
        need(hp.ssm_d_inner % hp.ssm_dt_rank == 0, f"ssm.inner_size {hp.ssm_d_inner} not divisible by time_step_rank")
        need(hp.ssm_conv_kernel >= 1, "ssm.conv_kernel must be ≥ 1")
        if hp.is_moe:
            need(hp.n_expert > 0 and 0 < hp.n_expert_used <= hp.n_expert,
                 f"expert_used_count {hp.n_expert_used} must be in 1..expert_count {hp.n_expert}")
            need(hp.n_ff_exp > 0, "expert_feed_forward_length must be > 0")
        else:
            need(hp.n_ff > 0, "feed_forward_length must be > 0 for a dense qwen35 model")

    # -- tensors ---------------------------------------------------------------------------------
    def expected_tensors(self) -> Iterator[tuple[str, tuple[int, ...] | tuple[tuple[int, ...], ...], bool]]:
        return expected_tensors(self.hparams)

    def _validate_tensors(self) -> None:
        from engine.storage.qtensor import SUPPORTED_TYPES  # local: quant imports torch, keep `inspect` of headers light

        name = self.path.name
        for tname, shapes, required in self.expected_tensors():
            info = self.tensors.get(tname)
            if info is None:
                if required:
                    raise ModelFormatError(f"{name}: required tensor '{tname}' is missing")
                continue
            allowed = shapes if isinstance(shapes[0], tuple) else (shapes,)
            if info.shape not in allowed:
                want = " or ".join(str(s) for s in allowed)
                raise ModelFormatError(f"{name}: tensor '{tname}' has shape {info.shape}, expected {want}")
            if len(info.shape) == 1:
                if info.qtype not in _VECTOR_TYPES:
                    raise UnsupportedModelError(
                        f"{name}: 1-D tensor '{tname}' is stored as {info.qtype.name}; GGUF files store them as F32 "
                        "(a damaged type field?)"
                    )
            elif tname.endswith("ssm_conv1d.weight"):
                if info.qtype not in _CONV_TYPES:
                    raise UnsupportedModelError(
                        f"{name}: tensor '{tname}' is stored as {info.qtype.name}; expected F32, F16 or BF16"
                    )
            elif info.qtype not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{name}: tensor '{tname}' uses quant type {info.qtype.name}, which Foretell cannot run yet"
                )
            block, _ = GGML_QUANT_SIZES[info.qtype]
            if info.shape[-1] % block:
                raise ModelFormatError(
                    f"{name}: tensor '{tname}' row length {info.shape[-1]} is not a multiple of the "
                    f"{info.qtype.name} block size {block}"
                )

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored data as the reader maps it (a view of the mmap, no copy)."""
        t = self._raw.get(name)
        if t is None:
            raise ModelFormatError(f"{self.path.name}: tensor '{name}' is not in the file")
        return self.gguf.tensor_data(t)

    def tensor(self, name: str):
        """The tensor as an engine.storage.qtensor.QTensor (still in its stored block format)."""
        from engine.storage.qtensor import QTensor

        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path.name}: tensor '{name}' is not in the file")
        return QTensor(self.raw(name), info.qtype, info.shape)

    # -- summaries -------------------------------------------------------------------------------
    @cached_property
    def param_counts(self) -> ParamCounts:
        hp = self.hparams
        total = sum(t.n_elements for t in self.tensors.values())
        mtp = sum(t.n_elements for n, t in self.tensors.items() if _layer_of(n) is not None and _layer_of(n) >= hp.n_layer)
        trunk = total - mtp
        routed = sum(
            t.n_elements for n, t in self.tensors.items()
            if "_exps." in n and (_layer_of(n) or 0) < hp.n_layer
        )
        active = trunk - routed + (routed * hp.n_expert_used // hp.n_expert if hp.n_expert else 0)
        if "output.weight" in self.tensors:
            active -= self.tensors["token_embd.weight"].n_elements  # an embedding lookup reads one row
        return ParamCounts(total=total, trunk=trunk, active=active, mtp=mtp)

    def type_histogram(self) -> dict[str, dict[str, int]]:
        """Per quant type: tensor count, elements, bytes."""
        out: dict[str, dict[str, int]] = {}
        for t in self.tensors.values():
            row = out.setdefault(t.qtype.name, {"tensors": 0, "elements": 0, "bytes": 0})
            row["tensors"] += 1
            row["elements"] += t.n_elements
            row["bytes"] += t.n_bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))

    def layer_pattern(self) -> str:
        """One letter per trunk layer: R = Gated DeltaNet (recurrent), A = gated attention; M = MTP."""
        hp = self.hparams
        return "".join("R" if r else "A" for r in hp.recurrent) + "M" * hp.n_mtp


def _layer_of(name: str) -> int | None:
    if not name.startswith("blk."):
        return None
    try:
        return int(name.split(".", 2)[1])
    except ValueError:
        return None


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)
