"""Our own qwen35 / qwen35moe GGUF writer, in llama.cpp's conventions.

Used by the test fixtures, the benchmarks' synthetic models and the default-model export. Tensors are
given in GGUF naming and torch orientation, already in the file's conventions (norms stored as 1+w,
`ssm_a` = −exp(A_log), tiled V-head order); this module decides storage types the way the converter
does (F32 for every 1-D tensor, norms, routers, conv kernels) and writes the metadata keys of spec §1/§4.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, GGUFWriter

from engine.storage.modelfile import HParams, expected_tensors
from engine.storage.quantize import quantize

# Tensors the converter forces to F32 whatever the output type (base.py prepare_tensors).
_F32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


@dataclass(frozen=True)
class Raw:
    """A tensor given as ready-made ggml blocks (bytes [..., row_bytes]) of `qtype`."""

    data: np.ndarray
    qtype: T
    shape: tuple[int, ...]  # logical torch shape


@dataclass(frozen=True)
class Lazy:
    """A tensor made only when it is written (ready-made ggml blocks of `qtype`, or float32 for F32), so a file larger
    than memory can be written one tensor at a time."""

    make: Callable[[], np.ndarray]
    qtype: T
    shape: tuple[int, ...]  # logical torch shape

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * (self.shape[-1] // block) * size


@dataclass
class Vocab:
    """Tokenizer metadata as stored in GGUF (`tokenizer.ggml.*`)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    pad_id: int | None = None
    pre: str = "qwen35"
    add_bos: bool = False
    chat_template: str | None = None


def make_hparams(
    arch: str = "qwen35moe", *, n_layer: int, n_embd: int, n_vocab: int, n_head: int, n_head_kv: int,
    head_dim: int, n_rot: int | None = None, rope_base: float = 1e7, rms_eps: float = 1e-6,
    n_ctx_train: int = 4096, ssm_conv_kernel: int = 4, ssm_d_state: int = 128, ssm_n_group: int = 16,
    ssm_dt_rank: int = 32, full_attention_interval: int = 4, n_ff: int = 0, n_expert: int = 0,
    n_expert_used: int = 0, n_ff_exp: int = 0, n_ff_shexp: int = 0, n_mtp: int = 0,
) -> HParams:
    """HParams for a model to be written; derived fields computed as the loader would."""
    return HParams(
        arch=arch, n_block=n_layer + n_mtp, n_mtp=n_mtp, n_ctx_train=n_ctx_train, n_embd=n_embd, n_vocab=n_vocab,
        n_head=n_head, n_head_kv=n_head_kv, head_dim_k=head_dim, head_dim_v=head_dim, rms_eps=float(np.float32(rms_eps)),  # as stored (float32)
       
        n_rot=n_rot if n_rot is not None else head_dim // 4, rope_base=float(np.float32(rope_base)), rope_sections=(11, 11, 10, 0),
        ssm_conv_kernel=ssm_conv_kernel, ssm_d_state=ssm_d_state, ssm_n_group=ssm_n_group, ssm_dt_rank=ssm_dt_rank,
        ssm_d_inner=ssm_dt_rank * ssm_d_state, full_attention_interval=full_attention_interval,
        recurrent=tuple((i + 1) % full_attention_interval != 0 for i in range(n_layer)),
        n_ff=n_ff, n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
    )


def storage_type(name: str, shape: tuple[int, ...], qtype: T, overrides: Mapping[str, T] | None = None) -> T:
    """The ggml type a tensor is stored in: F32 where the converter forces it, else `qtype`."""
    if overrides:
        for key, t in overrides.items():
            if key in name:
                qtype = t
                break
    if len(shape) == 1 or name.endswith(_F32_SUFFIXES) or not name.endswith(".weight"):
        return T.F32
    return qtype


def write_gguf(
    path: str | os.PathLike[str], hp: HParams, tensors: Mapping[str, np.ndarray | Raw], vocab: Vocab,
    qtype: T = T.F32, type_overrides: Mapping[str, T] | None = None, name: str = "foretell-model",
    extra_kv: Mapping[str, str | int | float] | None = None,
) -> None:
    """Write a GGUF with every tensor the architecture needs (checked against `expected_tensors`)."""
    want = {n: (s, req) for n, s, req in expected_tensors(hp)}
    missing = [n for n, (_, req) in want.items() if req and n not in tensors]
    if missing:
        raise ValueError(f"tensors missing for {hp.arch}: {missing[:5]}")
    unknown = [n for n in tensors if n not in want]
    if unknown:
        raise ValueError(f"tensors not part of {hp.arch}: {unknown[:5]}")
    a = hp.arch
    w = GGUFWriter(os.fspath(path), a)
    w.add_name(name)
    # uint32 keys in spec §1 (a zero value means "not written": absent MTP, dense vs MoE widths)
    counts = {
        "block_count": hp.n_block, "nextn_predict_layers": hp.n_mtp, "context_length": hp.n_ctx_train,
        "embedding_length": hp.n_embd, "feed_forward_length": hp.n_ff, "expert_count": hp.n_expert,
        "expert_used_count": hp.n_expert_used, "expert_feed_forward_length": hp.n_ff_exp,
        "expert_shared_feed_forward_length": hp.n_ff_shexp, "attention.head_count": hp.n_head,
        "attention.head_count_kv": hp.n_head_kv, "attention.key_length": hp.head_dim_k,
        "attention.value_length": hp.head_dim_v, "rope.dimension_count": hp.n_rot,
        "ssm.conv_kernel": hp.ssm_conv_kernel, "ssm.state_size": hp.ssm_d_state, "ssm.group_count": hp.ssm_n_group,
        "ssm.time_step_rank": hp.ssm_dt_rank, "ssm.inner_size": hp.ssm_d_inner,
        "full_attention_interval": hp.full_attention_interval,
    }
    for key, value in counts.items():
        if value:
            w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hp.rms_eps)
    w.add_float32(f"{a}.rope.freq_base", hp.rope_base)
    w.add_array(f"{a}.rope.dimension_sections", list(hp.rope_sections))
    w.add_uint32("general.quantization_version", 2)
    for k, v in (extra_kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    _add_vocab(w, vocab)
    # Tensor infos first, then the data one tensor at a time in the same order (GGUFWriter.write_tensor_data), so
    # only one tensor's bytes are in memory at once when they are given as Lazy.
    makers = []
    for tname, arr in tensors.items():
        shapes, _ = want[tname]
        allowed = shapes if isinstance(shapes[0], tuple) else (shapes,)
        shape = arr.shape if isinstance(arr, (Raw, Lazy)) else tuple(arr.shape)
        if tuple(shape) not in allowed:
            raise ValueError(f"{tname}: shape {tuple(shape)}, expected {allowed}")
        if isinstance(arr, Lazy):
            w.add_tensor_info(tname, arr.shape, np.dtype(np.float32), arr.nbytes, raw_dtype=arr.qtype)
            makers.append(arr.make)
            continue
        if isinstance(arr, Raw):
            data, t = arr.data, arr.qtype
        else:
            t = storage_type(tname, tuple(arr.shape), qtype, type_overrides)
            if t == T.F32:
                data = np.ascontiguousarray(arr, dtype=np.float32)
            elif t == T.F16:
                data = np.ascontiguousarray(arr, dtype=np.float16)
            else:
                data = quantize(arr, t)
        w.add_tensor_info(tname, data.shape, data.dtype, data.nbytes, raw_dtype=t if data.dtype == np.uint8 else None)
        makers.append(lambda data=data: data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for make in makers:
        w.write_tensor_data(np.ascontiguousarray(make()))
    w.close()


def _add_vocab(w: GGUFWriter, v: Vocab) -> None:
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", v.pre)
    w.add_array("tokenizer.ggml.tokens", v.tokens)
    w.add_array("tokenizer.ggml.token_type", v.token_types)
    w.add_array("tokenizer.ggml.merges", v.merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", v.bos_id)
    w.add_uint32("tokenizer.ggml.eos_token_id", v.eos_id)
    if v.pad_id is not None:
        w.add_uint32("tokenizer.ggml.padding_token_id", v.pad_id)
    w.add_bool("tokenizer.ggml.add_bos_token", v.add_bos)
    if v.chat_template is not None:
        w.add_string("tokenizer.chat_template", v.chat_template)
