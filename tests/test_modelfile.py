from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gq

from engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from engine.storage.gguf_read import GGUFFile
from engine.storage.modelfile import default_model_path, open_model
from tests.fixtures import KQUANT_DENSE, KQUANT_MOE, TINY_DENSE, TINY_MOE, FixtureSpec, fixture_path, hparams_of


def rewrite(src: Path, dst: Path, *, drop: tuple[str, ...] = (), tensors: dict | None = None,
            kv: dict | None = None, extra: dict | None = None) -> Path:
    """Copy a GGUF, dropping tensors, replacing some (name -> (array, raw_dtype|None)) or metadata values."""
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    kv = kv or {}
    w = GGUFWriter(dst, kv["general.architecture"][0] if "general.architecture" in kv else arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in kv:
            value, vtype = kv[name]
            w.add_key_value(name, value, vtype)
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        if tensors and t.name in tensors:
            arr, raw = tensors[t.name]
            w.add_tensor(t.name, arr, raw_dtype=raw)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type if t.tensor_type not in (T.F32, T.F16) else None)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("spec", [TINY_MOE, TINY_DENSE, FixtureSpec(mtp=False), FixtureSpec(qtype="F16"),
                                  FixtureSpec(qtype="Q8_0"), KQUANT_MOE, KQUANT_DENSE], ids=lambda s: f"{s.arch}-{s.qtype}-{s.mtp}")
def test_fixtures_open_and_parse(spec: FixtureSpec) -> None:
    mf = open_model(fixture_path(spec))
    hp = mf.hparams
    assert hp == hparams_of(spec)
    assert hp.n_layer == spec.n_layer and hp.has_mtp == spec.mtp
    assert hp.recurrent == (True, True, True, False)
    assert mf.layer_pattern() == "RRRA" + ("M" if spec.mtp else "")
    assert hp.ssm_conv_dim == 2 * spec.ssm_n_group * spec.ssm_d_state + spec.ssm_dt_rank * spec.ssm_d_state
    # Tensor data stays in the mmap: the reader's arrays are views of the file, not copies.
    arr = mf.raw("token_embd.weight")
    assert isinstance(arr.base, np.memmap) or isinstance(arr, np.memmap)
    w = mf.tensor("blk.0.attn_qkv.weight")
    assert w.shape == (hp.ssm_conv_dim, hp.n_embd)
    types = mf.type_histogram()
    assert "F32" in types
    if spec.qtype != "F32":
        assert spec.qtype in types
    pc = mf.param_counts
    assert pc.total == pc.trunk + pc.mtp and pc.active <= pc.trunk
    assert (pc.mtp > 0) == spec.mtp


def test_hparams_match_metadata_keys() -> None:
    mf = open_model(fixture_path(TINY_MOE))
    assert mf.get("qwen35moe.expert_count") == TINY_MOE.n_expert
    assert mf.get("qwen35moe.nextn_predict_layers") == 1
    assert mf.hparams.n_block == TINY_MOE.n_layer + 1
    assert mf.hparams.rope_sections == (11, 11, 10, 0)
    assert mf.hparams.n_rot == TINY_MOE.head_dim // 4
    assert mf.metadata["tokenizer.ggml.model"] == "gpt2"


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        open_model(p)
    p.write_bytes(b"GG")
    with pytest.raises(ModelFormatError, match="too short"):
        open_model(p)
    with pytest.raises(ModelFormatError, match="cannot open"):
        open_model(tmp_path / "missing.gguf")
    with pytest.raises(ModelFormatError, match="directory"):
        open_model(tmp_path)


def test_bad_version(tmp_path: Path) -> None:
    data = bytearray(fixture_path(TINY_MOE).read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    p = tmp_path / "v.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="version 99"):
        open_model(p)


def test_truncated_everywhere(tmp_path: Path) -> None:
    data = fixture_path(TINY_MOE).read_bytes()
    p = tmp_path / "t.gguf"
    cuts = sorted({8, 16, 24, 100, 1000, 5000, len(data) // 3, len(data) // 2, len(data) - 1000, len(data) - 1}
                  | set(random.Random(0).sample(range(8, len(data)), 30)))
    for cut in cuts:
        p.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError):
            open_model(p)


def test_byte_flips_raise_only_typed_errors(tmp_path: Path) -> None:
    data = fixture_path(TINY_MOE).read_bytes()
    rng = random.Random(1)
    p = tmp_path / "f.gguf"
    header_end = 64 * 1024  # metadata and tensor infos live at the front; flips there matter most
    outcomes = {"ok": 0, "error": 0}
    for _ in range(150):
        b = bytearray(data)
        for _ in range(rng.choice((1, 2, 4))):
            b[rng.randrange(4, min(header_end, len(b)))] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(b))
        try:
            open_model(p)
            outcomes["ok"] += 1
        except EngineError:
            outcomes["error"] += 1
    assert outcomes["error"] > 10  # the flips did hit structure, and each was reported as a typed error


def test_unknown_arch(tmp_path: Path) -> None:
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "a.gguf", kv={"general.architecture": ("llama", GGUFValueType.STRING)})
    with pytest.raises(UnsupportedModelError, match="'llama' is not supported"):
        open_model(p)


def test_missing_key(tmp_path: Path) -> None:
    src = fixture_path(TINY_MOE)
    r = GGUFReader(src)
    # Drop a required key by rewriting it under another name.
    p = tmp_path / "k.gguf"
    w = GGUFWriter(p, "qwen35moe")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = "x.unused" if name == "qwen35moe.ssm.state_size" else name
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelFormatError, match="'qwen35moe.ssm.state_size' is missing"):
        open_model(p)


def test_wrong_key_type(tmp_path: Path) -> None:
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "k.gguf",
                kv={"qwen35moe.embedding_length": ("sixty-four", GGUFValueType.STRING)})
    with pytest.raises(ModelFormatError, match="embedding_length"):
        open_model(p)


def test_missing_tensor(tmp_path: Path) -> None:
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "m.gguf", drop=("blk.2.ssm_a",))
    with pytest.raises(ModelFormatError, match="'blk.2.ssm_a' is missing"):
        open_model(p)


def test_missing_mtp_part_is_an_error_but_no_mtp_is_fine(tmp_path: Path) -> None:
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "m.gguf", drop=("blk.4.nextn.eh_proj.weight",))
    with pytest.raises(ModelFormatError, match="nextn.eh_proj"):
        open_model(p)
    assert not open_model(fixture_path(FixtureSpec(mtp=False))).hparams.has_mtp


def test_misshaped_tensor(tmp_path: Path) -> None:
    bad = np.zeros((TINY_MOE.n_expert, TINY_MOE.n_embd + 32), np.float32)
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "s.gguf", tensors={"blk.1.ffn_gate_inp.weight": (bad, None)})
    with pytest.raises(ModelFormatError, match=r"'blk.1.ffn_gate_inp.weight' has shape \(8, 96\), expected \(8, 64\)"):
        open_model(p)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    w = np.random.default_rng(0).normal(size=(TINY_MOE.n_ff_shexp, 256)).astype(np.float32)
    spec = FixtureSpec(n_embd=256, head_dim=64, n_ff_shexp=32)
    raw = gq.quantize(w, T.TQ1_0)
    p = rewrite(fixture_path(spec), tmp_path / "q.gguf", tensors={"blk.0.ffn_up_shexp.weight": (raw, T.TQ1_0)})
    with pytest.raises(UnsupportedModelError, match="'blk.0.ffn_up_shexp.weight' uses quant type TQ1_0"):
        open_model(p)


def test_vector_tensor_must_be_float(tmp_path: Path) -> None:
    raw = gq.quantize(np.ones((1, 64), np.float32), T.Q8_0).reshape(-1)
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "n.gguf", tensors={"output_norm.weight": (raw, T.Q8_0)})
    with pytest.raises(UnsupportedModelError, match="output_norm.weight"):
        open_model(p)


def test_fused_expert_tensors_are_refused_clearly(tmp_path: Path) -> None:
    s = TINY_MOE
    fused = np.zeros((s.n_expert, 2 * s.n_ff_exp, s.n_embd), np.float32)
    p = rewrite(fixture_path(s), tmp_path / "fused.gguf", extra={"blk.0.ffn_gate_up_exps.weight": fused})
    with pytest.raises(UnsupportedModelError, match="fused expert tensors"):
        open_model(p)


def test_string_arrays_are_decoded_only_when_asked() -> None:
    """The vocabulary and merges stay bytes in the mapping (a 248k-token file's take ~50 MiB as Python strings, used
    only to build the tokenizer): each read decodes them anew, and nothing keeps them once the tokenizer is built."""
    from engine.generate import text_side
    from engine.storage.gguf_read import Strings

    path = fixture_path(TINY_MOE)
    mf = open_model(path)
    ref = GGUFReader(path).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert isinstance(mf.gguf.fields[key].value, Strings)
        got = mf.get(key)
        assert got == ref[key].contents() and got is not mf.get(key)
    text_side(mf)
    assert not any(isinstance(v, list) for v in mf.__dict__.get("_values", {}).values())


def test_string_arrays_that_are_not_utf8_are_refused_at_open(tmp_path: Path) -> None:
    """Strings are checked at open as one block, each length field read as spaces: a multi-byte character cut short
    at a string's end, or one begun before a string's start, meets a space and fails the check."""
    data = fixture_path(TINY_MOE).read_bytes()
    tokens = open_model(fixture_path(TINY_MOE)).get("tokenizer.ggml.tokens")
    ends = next(t.encode() for t in tokens if len(t.encode()) > len(t) > 1 and ord(t[-1]) > 0x7F)
    starts = next(t.encode() for t in tokens if len(t.encode()) > len(t) > 1 and ord(t[0]) > 0x7F)
    p = tmp_path / "u.gguf"
    for text, at in ((ends, -1), (starts, 0)):  # a last continuation byte made ASCII; a first lead byte made one
        record = len(text).to_bytes(8, "little") + text
        i = data.index(record) + 8 + at % len(text)
        bad = bytearray(data)
        bad[i] = 0x21 if at else 0x80
        p.write_bytes(bytes(bad))
        with pytest.raises(ModelFormatError, match="not UTF-8"):
            open_model(p)


@pytest.mark.parametrize("bad", [b"\x00\x7c", b"\x00\xfc", b"\x00\x7e"], ids=["inf", "-inf", "nan"])
def test_a_nonfinite_scale_in_a_middle_block_is_refused_at_open(tmp_path: Path, bad: bytes) -> None:
    """The campaign of issue 48: a Q8_0 scale set to ±Inf/NaN away from a tensor's ends loaded and answered '!!!!'."""
    src = default_model_path()
    t = max((t for t in GGUFFile(src).tensors if t.qtype == T.Q8_0), key=lambda t: t.n_bytes)
    block = t.n_bytes // 34 // 2
    data = bytearray(src.read_bytes())
    data[t.offset + block * 34:t.offset + block * 34 + 2] = bad
    p = tmp_path / "s.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=f"damaged: tensor '{t.name}' has a non-finite scale in block {block} "):
        open_model(p)


def test_a_nonfinite_float_weight_is_refused_at_open(tmp_path: Path) -> None:
    src = fixture_path(TINY_MOE)
    t = next(t for t in GGUFFile(src).tensors if t.name == "blk.1.ffn_gate_inp.weight")
    data = bytearray(src.read_bytes())
    at = t.n_elements // 2
    data[t.offset + 4 * at:t.offset + 4 * at + 4] = np.array([np.inf], np.float32).tobytes()
    p = tmp_path / "w.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=f"'blk.1.ffn_gate_inp.weight' has a non-finite value at element {at} "):
        open_model(p)


@pytest.mark.parametrize("key,value", [
    ("rope.freq_base", 1e-45), ("rope.freq_base", 0.0), ("rope.freq_base", 1.0), ("rope.freq_base", -1e4),
    ("rope.freq_base", 1e30), ("rope.freq_base", float("inf")), ("rope.freq_base", float("nan")),
    ("attention.layer_norm_rms_epsilon", 0.0), ("attention.layer_norm_rms_epsilon", -1e-6),
    ("attention.layer_norm_rms_epsilon", 0.5), ("attention.layer_norm_rms_epsilon", float("nan")),
])
def test_float_hyperparameters_out_of_range_are_refused(tmp_path: Path, key: str, value: float) -> None:
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "r.gguf", kv={f"qwen35moe.{key}": (value, GGUFValueType.FLOAT32)})
    with pytest.raises(ModelFormatError, match=f"'qwen35moe.{key}' = .* is out of range"):
        open_model(p)


@pytest.mark.parametrize("key,value", [("rope.freq_base", 5e5), ("rope.freq_base", 1e9),
                                       ("attention.layer_norm_rms_epsilon", 1e-12),
                                       ("attention.layer_norm_rms_epsilon", 1e-5)])
def test_unusual_but_plausible_float_hyperparameters_load(tmp_path: Path, key: str, value: float) -> None:
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "r.gguf", kv={f"qwen35moe.{key}": (value, GGUFValueType.FLOAT32)})
    hp = open_model(p).hparams
    assert (hp.rope_base if key == "rope.freq_base" else hp.rms_eps) == pytest.approx(value)


@pytest.mark.parametrize("key,kv,why", [
    ("context_length", (0, GGUFValueType.UINT32), "context_length 0 must be ≥ 1"),
    ("rope.dimension_sections", ([11, -11, 10, 0], GGUFValueType.ARRAY), "must not be negative"),
])
def test_integer_hyperparameters_out_of_range_are_refused(tmp_path: Path, key: str, kv: tuple, why: str) -> None:
    p = rewrite(fixture_path(TINY_MOE), tmp_path / "r.gguf", kv={f"qwen35moe.{key}": kv})
    with pytest.raises(ModelFormatError, match=why):
        open_model(p)
