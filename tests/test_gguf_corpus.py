"""The GGUF reader against files made here (issue 48): valid files at every edge the format allows open (a vocabulary
with no tensors, any alignment, scalars and empty tensors, every value type, every tensor type); a big-endian file
and paths that are not files are refused with their reason; a NaN/Inf in any block's scale or in any float value is
found wherever it lies, the scale fields found by gguf-py's own dequantization, not by a table of ours."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.storage.gguf_read import GGUFFile
from engine.storage.modelfile import open_model

QUANT_TYPES = [t for t, (block, _) in GGML_QUANT_SIZES.items() if block > 1]
FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64}
N_BLOCKS = 9  # per test tensor; the damaged one is in the middle


def write(path: Path, tensors: dict[str, tuple[np.ndarray, T | None]] | None = None, *, kv: Callable | None = None,
          alignment: int | None = None, endian: GGUFEndian = GGUFEndian.LITTLE, vocab_only: bool = False) -> Path:
    """A GGUF as gguf-py writes it; `vocab_only`: header and metadata only, as convert_hf_to_gguf --vocab-only."""
    w = GGUFWriter(path, "qwen35", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ä"])
    if kv is not None:
        kv(w)
    for name, (arr, raw) in (tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if not vocab_only:
        w.write_tensors_to_file()
    w.close()
    return path


def zero_blocks(qtype: T, n_blocks: int = N_BLOCKS) -> tuple[np.ndarray, T]:
    """One row of n_blocks all-zero blocks: valid data of any type (every scale 0.0)."""
    return np.zeros((1, n_blocks * GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype


def every_value_type(w: GGUFWriter) -> None:
    scalars = {GGUFValueType.UINT8: 255, GGUFValueType.INT8: -128, GGUFValueType.UINT16: 65535,
               GGUFValueType.INT16: -32768, GGUFValueType.UINT32: 2 ** 32 - 1, GGUFValueType.INT32: -2 ** 31,
               GGUFValueType.FLOAT32: 1.5, GGUFValueType.BOOL: True, GGUFValueType.UINT64: 2 ** 64 - 1,
               GGUFValueType.INT64: -2 ** 63, GGUFValueType.FLOAT64: -2.25, GGUFValueType.STRING: ""}
    for vtype, value in scalars.items():
        w.add_key_value(f"x.{vtype.name.lower()}", value, vtype)
        if vtype != GGUFValueType.STRING:
            w.add_key_value(f"x.{vtype.name.lower()}s", [value, value], GGUFValueType.ARRAY, sub_type=vtype)
    w.add_array("x.strings", ["", "é", "\x00", "日本"])


VALID: dict[str, Callable[[Path], Path]] = {
    "vocab-only": lambda p: write(p, vocab_only=True),
    "vocab-only, padded": lambda p: write(p),
    "vocab-only, alignment 2^31": lambda p: write(p, alignment=1 << 31, vocab_only=True),
    "alignment 1": lambda p: write(p, {"a": (np.ones(3, np.float32), None), "b": (np.ones(5, np.float16), None)},
                                   alignment=1),
    "alignment 2^16": lambda p: write(p, {"a": (np.ones(3, np.float32), None), "b": (np.ones(5, np.float32), None)},
                                      alignment=1 << 16),
    "alignment 2^20": lambda p: write(p, {"a": (np.ones(3, np.float32), None), "b": zero_blocks(T.Q4_K)},
                                      alignment=1 << 20),
    "a scalar and empty tensors": lambda p: write(p, {"e0": (np.zeros((0, 4), np.float32), None),
                                                      "s": (np.array(2.5, np.float32), None),
                                                      "e1": (np.zeros((3, 0), np.float16), None),
                                                      "t": (np.arange(4, dtype=np.float32), None)}),
    "every value type": lambda p: write(p, {"t": (np.ones(2, np.float32), None)}, kv=every_value_type),
    "every tensor type": lambda p: write(p, {
        **{f"q.{t.name}": zero_blocks(t) for t in QUANT_TYPES},
        **{f"f.{t.name}": (np.ones((2, 4), dtype), None) for t, dtype in FLOAT_TYPES.items()},
        "f.BF16": (np.full((2, 4), 0x3F80, np.uint16), T.BF16),
        **{f"i.{dt.__name__}": (np.arange(6, dtype=dt).reshape(2, 3), None)
           for dt in (np.int8, np.int16, np.int32, np.int64)}}),
}


@pytest.mark.parametrize("case", list(VALID))
def test_valid_files_open_as_gguf_py_reads_them(tmp_path: Path, case: str) -> None:
    path = VALID[case](tmp_path / "v.gguf")
    g = GGUFFile(path)
    g.check_data()
    ref = GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert {k: f.contents() for k, f in g.fields.items()} == want
    assert [(t.name, int(t.qtype), t.shape) for t in g.tensors] == \
        [(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape))) for t in ref.tensors]
    for mine, theirs in zip(g.tensors, ref.tensors):
        assert g.tensor_data(mine).tobytes() == theirs.data.tobytes()


def test_a_vocabulary_only_file_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="vocabulary-only GGUF"):
        open_model(VALID["vocab-only"](tmp_path / "v.gguf"))


def test_a_big_endian_file_is_refused_with_its_reason(tmp_path: Path) -> None:
    path = write(tmp_path / "be.gguf", {"t": (np.ones(4, np.float32), None)}, endian=GGUFEndian.BIG)
    with pytest.raises(ModelFormatError, match="big-endian GGUF .*little-endian"):
        GGUFFile(path)


def test_paths_that_are_not_files_are_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "f.gguf"
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.gguf"))
    cases = {fifo: "a FIFO", tmp_path: "a directory", tmp_path / "s.gguf": "a socket", Path("/dev/zero"):
             "a character device"}
    for path, kind in cases.items():
        for opener in (GGUFFile, open_model):
            with pytest.raises(ModelFormatError, match=f"is {kind}.*not a GGUF file"):
                opener(path)
    sock.close()
    r = subprocess.run([sys.executable, "-m", "engine", "inspect", str(fifo)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and r.stdout == "" and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert "FIFO" in r.stderr


def scale_fields(qtype: T) -> list[tuple[int, bytes]]:
    """(byte offset, bytes) that make a block of `qtype` dequantize (by gguf-py) to NaN/Inf: its float scales.
    IQ1_M spreads its one scale over the top nibbles of four words (bytes 48-55), so no single field shows it;
    MXFP4's E8M0 scale 0xFF (NaN in the OCP MX spec) decodes to 2^127, which overflows once its values are not 0."""
    size = GGML_QUANT_SIZES[qtype][1]
    if qtype == T.IQ1_M:
        return [(53, b"\xe0\x00\x70")]  # the top nibbles of words 2 and 3: scale 0x7E00, a NaN
    if qtype == T.MXFP4:
        return [(0, b"\xff")]
    found = []
    for at in range(size - 1):
        for pattern in (b"\x00\x7e", b"\x00\xfc"):  # f16 NaN, -Inf
            block = np.zeros(size, np.uint8)
            block[at:at + 2] = np.frombuffer(pattern, np.uint8)
            with np.errstate(all="ignore"):
                if not np.isfinite(gq.dequantize(block, qtype)).all():
                    found.append((at, pattern))
                    break
    return found


DEQUANTIZABLE = [t for t in QUANT_TYPES if t not in (T.Q8_1, T.Q8_K, T.Q1_0)]  # gguf-py cannot dequantize these


@pytest.mark.parametrize("qtype", DEQUANTIZABLE, ids=lambda t: t.name)
def test_a_nonfinite_scale_in_any_block_is_refused(tmp_path: Path, qtype: T) -> None:
    size = GGML_QUANT_SIZES[qtype][1]
    fields = scale_fields(qtype)
    assert fields or qtype == T.NVFP4  # its E4M3 scale codes all decode to finite numbers
    for at, pattern in fields:
        raw, _ = zero_blocks(qtype)
        block = raw.reshape(N_BLOCKS, size)[4]
        block[:] = 0x33  # values that overflow under a huge scale
        block[at:at + len(pattern)] = np.frombuffer(pattern, np.uint8)
        with np.errstate(all="ignore"):
            assert not np.isfinite(gq.dequantize(raw, qtype)).all()  # the damage gguf-py itself sees
        g = GGUFFile(write(tmp_path / "d.gguf", {"w": (raw, qtype)}))
        with pytest.raises(ModelFormatError, match="damaged: tensor 'w' has a non-finite scale in block 4 "):
            g.check_data()
    raw, _ = zero_blocks(qtype)  # every other byte of every block set: the data, not a scale
    others = np.ones(size, bool)
    for at, pattern in fields:
        others[at:at + len(pattern)] = False
    raw.reshape(N_BLOCKS, size)[:, others] = 0xFF
    with np.errstate(all="ignore"):
        assert np.isfinite(gq.dequantize(raw, qtype)).all()
    GGUFFile(write(tmp_path / "ok.gguf", {"w": (raw, qtype)})).check_data()


@pytest.mark.parametrize("qtype,at,pattern", [(T.Q8_K, 0, b"\x00\x00\xc0\x7f"), (T.Q1_0, 0, b"\x00\x7c")],
                         ids=["Q8_K", "Q1_0"])
def test_scales_gguf_py_cannot_dequantize(tmp_path: Path, qtype: T, at: int, pattern: bytes) -> None:
    """ggml-common.h: Q8_K's `d` is an f32 at byte 0, Q1_0's an f16 at byte 0."""
    raw, _ = zero_blocks(qtype)
    size = GGML_QUANT_SIZES[qtype][1]
    raw[0, 7 * size + at:7 * size + at + len(pattern)] = np.frombuffer(pattern, np.uint8)
    with pytest.raises(ModelFormatError, match="non-finite scale in block 7 "):
        GGUFFile(write(tmp_path / "d.gguf", {"w": (raw, qtype)})).check_data()


def float_tensor(qtype: T, values: np.ndarray) -> tuple[np.ndarray, T | None]:
    if qtype == T.BF16:  # the top half of each float32
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), T.BF16
    return values.astype(FLOAT_TYPES[qtype]), None


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.F64, T.BF16], ids=lambda t: t.name)
def test_a_nonfinite_float_value_anywhere_is_refused(tmp_path: Path, qtype: T) -> None:
    big = float(np.finfo(FLOAT_TYPES.get(qtype, np.float32)).max)
    values = np.array([0.0, -0.0, big, -big, 1e-30, 1.0] * 50)  # extreme but finite: a valid file
    GGUFFile(write(tmp_path / "ok.gguf", {"w": float_tensor(qtype, values)})).check_data()
    for bad in (np.inf, -np.inf, np.nan):
        damaged = values.copy()
        damaged[123] = bad
        g = GGUFFile(write(tmp_path / "d.gguf", {"w": float_tensor(qtype, damaged)}))
        with pytest.raises(ModelFormatError, match="tensor 'w' has a non-finite value at element 123 "):
            g.check_data()
