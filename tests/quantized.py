"""Fixtures quantized by llama.cpp itself (`llama_model_quantize`, through llama-cpp-python's ctypes API).

A float fixture written by our writer (tests/fixtures.py; every row a multiple of 256 values, like KQUANT_MOE) is
quantized with one of llama.cpp's file types ("ftypes": Q4_K_M, IQ4_XS, MXFP4_MOE, ...) into a file cached next
to the fixtures. llama.cpp picks the per-tensor types as it does for a real model (attention and GDN projections,
shared experts, routed experts' gate/up and down each by its own rules), so these files carry the mixes real
downloads carry, made by the reference quantizer.

The 2-bit and 1-bit i-quants and IQ3_XXS (IQ2_XXS, IQ2_XS, IQ2_M, IQ1_S, IQ1_M, IQ3_XXS) are refused by
llama.cpp without an importance matrix. For those a flat one (every column's importance 1: no column favoured,
the neutral choice for random weights) is passed as `llama_model_quantize_params.imatrix`, the typed
name → values array of this llama.cpp (one value per column, per expert for expert stacks). The others are
quantized as `llama-quantize` does with no imatrix.

    quantized_path(spec, "IQ4_XS")  -> Path of spec's weights in llama.cpp's IQ4_XS mix
    llama_quantize(src, dst, ftype, imatrix=..., overrides={regex: type}) -> one file, any options
    tensor_roles(path)              -> {role: sorted types} (attention, GDN, shared, expert gate/up, down, head)
"""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import replace
from pathlib import Path

import numpy as np

from engine.storage.modelfile import open_model
from tests.fixtures import KQUANT_MOE, FixtureSpec, fixture_path
from tests.oracle_llama import LlamaOracleError, _fail, _mark  # its log capture: failures carry llama.cpp's log

import llama_cpp as L  # noqa: E402  (after tests.oracle_llama, which sets the OpenMP wait policy)

# ftypes llama.cpp will not make without an importance matrix (measured: llama_model_quantize returns 1,
# "requires an importance matrix"). IQ2_S and IQ3_S go through without one; IQ2_M (whose main type is IQ2_S) not.
NEEDS_IMATRIX = frozenset({"IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_M", "IQ1_S", "IQ1_M"})

# Every ftype the parity tests run, and the ggml types it brings (llama.cpp's choices on KQUANT_MOE's shapes):
# together they cover every type with a product of its own in engine.ops.
FTYPES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL", "MXFP4_MOE", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
          "F16", "BF16", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_M", "IQ1_S", "IQ1_M")

# Unsloth's "UD-Q4_K_M"-like mix: Q8_0 attention, GDN and shared expert; routed gate/up Q4_K, routed down Q5_K
# (llama.cpp's own Q4_K_M gives routed down Q4_K / Q6_K by layer). Regexes searched in tensor names, first wins.
UD_Q4_K_M = {r"ffn_down_exps": "Q5_K", r"ffn_(gate|up)_exps": "Q4_K", r"shexp": "Q8_0", r"attn_|ssm_": "Q8_0"}


def _ftype(name: str) -> int:
    try:
        return int(getattr(L, "LLAMA_FTYPE_ALL_F32" if name == "F32" else f"LLAMA_FTYPE_MOSTLY_{name}"))
    except AttributeError:
        raise ValueError(f"llama.cpp has no file type {name}") from None


def _ggml_type(name: str) -> int:
    from gguf import GGMLQuantizationType as T

    return int(T[name])


def flat_imatrix(src: Path) -> tuple[ctypes.Array, list]:
    """A null-terminated llama_model_imatrix_data array with importance 1 for every column of every matrix of
    `src` (one row of values per expert for expert stacks), and the Python objects it points into (keep them
    alive while llama.cpp reads it)."""
    mats = [t for t in open_model(src).tensors.values() if len(t.shape) >= 2]
    arr = (L.llama_model_imatrix_data * (len(mats) + 1))()  # zeroed: the last entry is the terminator
    keep: list = []
    for i, t in enumerate(mats):
        n = t.shape[-1] * (t.shape[0] if len(t.shape) == 3 else 1)
        vals, name = np.ones(n, dtype=np.float32), t.name.encode()
        keep += [vals, name]
        arr[i].name, arr[i].size = name, n
        arr[i].data = vals.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    return arr, keep


def llama_quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: str, *,
                   imatrix: bool | None = None, overrides: dict[str, str] | None = None, threads: int = 2) -> Path:
    """`src` quantized by llama.cpp into `dst` with file type `ftype`. `imatrix`: pass a flat importance matrix
    (default: only for the ftypes in NEEDS_IMATRIX); `overrides`: {tensor-name regex: ggml type name}, llama.cpp's
    per-tensor type overrides (`--tensor-type`)."""
    src, dst = Path(src), Path(dst)
    p = L.llama_model_quantize_default_params()
    p.nthread = threads
    p.ftype = _ftype(ftype)
    keep: list = []
    if imatrix if imatrix is not None else ftype in NEEDS_IMATRIX:
        p.imatrix, keep = flat_imatrix(src)
    if overrides:
        tto = (L.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, tname) in enumerate(overrides.items()):
            pat = pattern.encode()
            keep.append(pat)
            tto[i].pattern, tto[i].type = pat, _ggml_type(tname)
        p.tt_overrides = tto
        keep.append(tto)
    mark = _mark()
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise _fail(f"llama_model_quantize({src.name} -> {ftype}) returned {rc}", mark)
    return dst


def float_source(spec: FixtureSpec) -> FixtureSpec:
    """The F32 fixture llama.cpp quantizes for `spec` (its shapes and seed, no storage type of its own)."""
    return replace(spec, qtype="F32", output_type=None)


def quantized_path(spec: FixtureSpec = KQUANT_MOE, ftype: str = "Q4_K_M", *,
                   overrides: dict[str, str] | None = None, tag: str = "") -> Path:
    """Path of `spec`'s F32 fixture quantized by llama.cpp into `ftype` (with `overrides`, named by `tag`),
    written on first use next to the fixtures."""
    src = fixture_path(float_source(spec))
    if overrides and not tag:
        raise ValueError("name a mix with overrides by a tag")
    path = src.with_name(f"{src.stem}.llama-{ftype}{'-' + tag if tag else ''}.gguf")
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        llama_quantize(src, tmp, ftype, overrides=overrides)
        tmp.replace(path)
    return path


ROLES = (
    ("attention", re.compile(r"\.attn_(q|k|v|output)\.weight$")),
    ("gdn", re.compile(r"\.(attn_qkv|attn_gate|ssm_alpha|ssm_beta|ssm_out)\.weight$")),
    ("router", re.compile(r"ffn_gate_inp(_shexp)?\.weight$")),
    ("shared expert", re.compile(r"_shexp\.weight$")),
    ("expert gate/up", re.compile(r"ffn_(gate|up)_exps\.weight$")),
    ("expert down", re.compile(r"ffn_down_exps\.weight$")),
    ("mtp eh_proj", re.compile(r"eh_proj\.weight$")),
    ("output", re.compile(r"^output\.weight$")),
    ("token_embd", re.compile(r"^token_embd\.weight$")),
)


def tensor_roles(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """The ggml types a file holds per role of matrix, as {role: sorted type names}."""
    out: dict[str, set[str]] = {}
    for t in open_model(path).tensors.values():
        for role, pat in ROLES:
            if pat.search(t.name):
                out.setdefault(role, set()).add(t.qtype.name)
                break
    return {role: sorted(out[role]) for role, _ in ROLES if role in out}


__all__ = ["FTYPES", "NEEDS_IMATRIX", "UD_Q4_K_M", "LlamaOracleError", "flat_imatrix", "float_source",
           "llama_quantize", "quantized_path", "tensor_roles"]


if __name__ == "__main__":  # `python -m tests.quantized`: the table of types per ftype on KQUANT_MOE
    for ft in FTYPES:
        print(ft, tensor_roles(quantized_path(KQUANT_MOE, ft)))
    print("UD-Q4_K_M", tensor_roles(quantized_path(KQUANT_MOE, "Q4_K_M", overrides=UD_Q4_K_M, tag="ud")))
