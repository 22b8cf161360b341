"""A GGUF reader that checks before it reads: every count and length against the bytes left, every tensor's dims,
type, offset and place in the data section, so a damaged file ends in one typed error naming what is wrong.

Why not gguf's GGUFReader: it walks arrays one element at a time in Python and trusts their counts, so an array
that claims 2^40 items runs for hours and takes gigabytes; it takes tensor offsets as given (zero, misaligned,
overlapping, past the end); and it takes ~1.7 s on the embedded model. This one reads numeric arrays as numpy
views, loops only over string arrays (whose count is bounded by the bytes left first), and takes tens of ms.
The format: github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""
from __future__ import annotations

import codecs
import os
import stat
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

from engine.errors import ModelFormatError

MAX_COUNT = 1 << 24  # keys, tensors or array items: far above any model (a 256k vocabulary is 1 << 18)
_U64 = struct.Struct("<Q")
MAX_NAME = 255  # key and tensor names (ggml's own limit for tensor names is 63)
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 48
DEFAULT_ALIGNMENT = 32
# The floating-point fields of one block of each type (ggml-common.h): byte offset and type. Float tensors are blocks
# of one value. A non-finite one turns the block's every value into NaN/Inf. BF16 is read as _U16, MXFP4's E8M0 scale
# as _E8M0 (0xFF: NaN in the OCP MX spec; ggml decodes it as 2^127, which overflows). IQ1_M spreads its f16 scale over
# the top nibbles of four words (_IQ1_M_WORDS). Not checked: NVFP4's E4M3 scales (ggml decodes every code to a finite
# number) and Q8_1, an activation type no model file holds, sized by gguf-py unlike ggml (40 bytes, not 36).
_F16, _F32, _F64, _U16, _E8M0 = (np.dtype(c) for c in ("<f2", "<f4", "<f8", "<u2", "u1"))
_IQ1_M_WORDS = 48  # offset of the four uint16 `scales` words
_FLOAT_FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, np.dtype], ...]] = {
    GGMLQuantizationType.F32: ((0, _F32),), GGMLQuantizationType.F16: ((0, _F16),),
    GGMLQuantizationType.F64: ((0, _F64),), GGMLQuantizationType.BF16: ((0, _U16),),
    GGMLQuantizationType.Q4_0: ((0, _F16),), GGMLQuantizationType.Q4_1: ((0, _F16), (2, _F16)),
    GGMLQuantizationType.Q5_0: ((0, _F16),), GGMLQuantizationType.Q5_1: ((0, _F16), (2, _F16)),
    GGMLQuantizationType.Q8_0: ((0, _F16),), GGMLQuantizationType.Q1_0: ((0, _F16),),
    GGMLQuantizationType.Q2_K: ((80, _F16), (82, _F16)), GGMLQuantizationType.Q3_K: ((108, _F16),),
    GGMLQuantizationType.Q4_K: ((0, _F16), (2, _F16)), GGMLQuantizationType.Q5_K: ((0, _F16), (2, _F16)),
    GGMLQuantizationType.Q6_K: ((208, _F16),), GGMLQuantizationType.Q8_K: ((0, _F32),),
    GGMLQuantizationType.IQ2_XXS: ((0, _F16),), GGMLQuantizationType.IQ2_XS: ((0, _F16),),
    GGMLQuantizationType.IQ2_S: ((0, _F16),), GGMLQuantizationType.IQ3_XXS: ((0, _F16),),
    GGMLQuantizationType.IQ3_S: ((0, _F16),), GGMLQuantizationType.IQ1_S: ((0, _F16),),
    GGMLQuantizationType.IQ4_NL: ((0, _F16),), GGMLQuantizationType.IQ4_XS: ((0, _F16),),
    GGMLQuantizationType.TQ1_0: ((52, _F16),), GGMLQuantizationType.TQ2_0: ((64, _F16),),
    GGMLQuantizationType.MXFP4: ((0, _E8M0),),
}
_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_SCAN_BLOCKS = 1 << 20  # blocks per step of the scan: bounds its temporaries to a few MiB

_SCALAR = {  # value type -> (struct code, size)
    GGUFValueType.UINT8: ("B", 1), GGUFValueType.INT8: ("b", 1), GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2), GGUFValueType.UINT32: ("I", 4), GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4), GGUFValueType.BOOL: ("B", 1), GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8), GGUFValueType.FLOAT64: ("d", 8),
}
_NUMPY = {t: np.dtype("<" + c) for t, (c, _) in _SCALAR.items()}
_TYPED_VIEWS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


class Strings:
    """A string array of the header, decoded only when asked (`tolist`): a 248k-token vocabulary and its merges take
    ~50 MiB as Python strings, needed only while a tokenizer is built. Its bytes were checked to be UTF-8 at open."""

    def __init__(self, data: np.ndarray, starts: np.ndarray, end: int):
        """`starts`: where each string's bytes begin in `data` (each after its 8-byte length); `end`: past the last."""
        self._data, self._starts, self._end = data, starts, end

    def __len__(self) -> int:
        return len(self._starts)

    def tolist(self) -> list[str]:
        if not len(self._starts):
            return []
        base = int(self._starts[0])
        block = bytes(self._data[base:self._end])
        begins = self._starts - base
        ends = np.append(begins[1:] - 8, self._end - base)  # each string ends where the next one's length begins
        return [block[a:b].decode("utf-8") for a, b in zip(array("q", begins.tobytes()), array("q", ends.tobytes()))]


@dataclass(frozen=True)
class Field:
    """One metadata key: its type (the item type for arrays) and value. Numeric arrays stay numpy views, string
    arrays undecoded (Strings)."""

    name: str
    type: GGUFValueType
    item_type: GGUFValueType | None  # arrays only
    value: Any
    count: int = 1  # items, for arrays

    def contents(self) -> Any:
        v = self.value
        if isinstance(v, Strings):
            return v.tolist()
        if isinstance(v, np.ndarray):
            return [bool(x) for x in v] if self.item_type == GGUFValueType.BOOL else v.tolist()
        return bool(v) if self.type == GGUFValueType.BOOL else v


@dataclass(frozen=True)
class RawTensor:
    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order (fastest dimension first)
    offset: int  # absolute, in the file
    n_elements: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch order."""
        return tuple(reversed(self.ne))


def regular_file_size(path: Path) -> int:
    """The size of `path` when it is a regular file (after links); else ModelFormatError. A FIFO would block the
    open until a writer came, a device would never end: neither is a model file."""
    try:
        st = path.stat()
    except OSError as e:
        raise ModelFormatError(f"cannot open model file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _NOT_FILES if test(st.st_mode)), "not a regular file")
        raise ModelFormatError(f"{path} is {kind}, not a GGUF file")
    return st.st_size


class GGUFFile:
    """The parsed header of a GGUF and a read-only memory map of the whole file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.name = self.path.name
        regular_file_size(self.path)
        try:
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"cannot read model file {self.path}: {getattr(e, 'strerror', None) or e}") from None
        self.size = int(self.data.size)
        self._buf = memoryview(self.data)  # type: ignore[arg-type]
        self._pos = 0
        self._what = "the file header"
        self.fields: dict[str, Field] = {}
        self.tensors: list[RawTensor] = []
        self._parse()

    # -- primitive reads, each bounded by the bytes left ---------------------------------------------
    def _fail(self, why: str) -> None:
        raise ModelFormatError(f"{self.name}: damaged GGUF: {why} (in {self._what}, at byte {self._pos})")

    def _need(self, n: int) -> None:
        if n < 0 or self._pos + n > self.size:
            self._fail(f"needs {n} more bytes but the file has {self.size - self._pos} left (truncated?)")

    def _scalar(self, t: GGUFValueType) -> Any:
        code, size = _SCALAR[t]
        self._need(size)
        v = struct.unpack_from("<" + code, self._buf, self._pos)[0]
        self._pos += size
        return v

    def _count(self, what: str, item_size: int) -> int:
        n = self._scalar(GGUFValueType.UINT64)
        left = self.size - self._pos
        if n > MAX_COUNT or n * item_size > left:
            self._fail(f"{what} claims {n:,} items, more than the {left:,} bytes left can hold")
        return n

    def _string(self, limit: int | None = None) -> str:
        n = self._scalar(GGUFValueType.UINT64)
        if limit is not None and n > limit:
            self._fail(f"a name of {n:,} bytes (the limit is {limit})")
        self._need(n)
        raw = bytes(self._buf[self._pos:self._pos + n])
        self._pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self._fail("text that is not UTF-8")
        raise AssertionError  # unreachable: _fail raises

    def _strings(self, n: int) -> Strings:
        """n strings in a row, checked to be UTF-8 but left undecoded (a 248k-token vocabulary: one tight loop over the
        lengths, then one check of all the bytes)."""
        buf, pos, end = self._buf, self._pos, self.size
        unpack = _U64.unpack_from
        starts = array("q")
        for _ in range(n):
            if end - pos < 8:
                self._pos = pos
                self._need(8)
            m = unpack(buf, pos)[0]
            pos += 8
            if m > end - pos:
                self._pos = pos
                self._need(m)
            starts.append(pos)
            pos += m
        at = np.frombuffer(starts, dtype=np.int64)
        if n:
            # Each length field as eight spaces: every string then stands between ASCII bytes, so the whole block is
            # UTF-8 exactly when each string is (a sequence cut short, or begun mid-character, meets a space).
            base = int(at[0]) - 8
            block = np.array(self.data[base:pos])
            for k in range(1, 9):
                block[at - base - k] = 0x20
            try:
                codecs.utf_8_decode(block, "strict", True)
            except UnicodeDecodeError:
                self._fail("text that is not UTF-8")
        self._pos = pos
        return Strings(self.data, at, pos)

    def _value_type(self, raw: int) -> GGUFValueType:
        try:
            return GGUFValueType(raw)
        except ValueError:
            self._fail(f"unknown value type {raw}")
        raise AssertionError

    # -- the header ----------------------------------------------------------------------------------
    def _parse(self) -> None:
        if self.size < 24:
            raise ModelFormatError(f"{self.name}: file too short to be a GGUF ({self.size} bytes)")
        if bytes(self._buf[:4]) != b"GGUF":
            raise ModelFormatError(f"{self.name}: not a GGUF file (magic {bytes(self._buf[:4])!r}, expected b'GGUF')")
        self._pos = 4
        self.version = self._scalar(GGUFValueType.UINT32)
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            if swapped in (2, 3):  # gguf-py writes big-endian files on request, with nothing else to tell them
                raise ModelFormatError(f"{self.name}: a big-endian GGUF (version {swapped} in big-endian byte "
                                       "order); Foretell reads little-endian files, as published models are: convert "
                                       "it with gguf-py's gguf-convert-endian")
            raise ModelFormatError(f"{self.name}: GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors = self._count("the tensor count", 8 + 4 + 4 + 8)  # the smallest record: no name, no dims
        n_kv = self._count("the metadata key count", 8 + 1 + 4 + 1)  # the smallest key record
        for _ in range(n_kv):
            self._what = "a metadata key name"
            key = self._string(MAX_NAME)
            self._what = f"metadata key '{key}'"
            if key in self.fields:
                self._fail("the key appears twice")
            self.fields[key] = self._field(key)
        self.alignment = self._alignment()
        records = []
        for i in range(n_tensors):
            self._what = f"tensor record {i}"
            name = self._string(MAX_NAME)
            self._what = f"tensor '{name}'"
            n_dims = self._scalar(GGUFValueType.UINT32)
            if n_dims > MAX_DIMS:  # 0: a scalar (gguf-py writes a 0-d array so; llama.cpp reads it)
                self._fail(f"{n_dims} dimensions (0…{MAX_DIMS} allowed)")
            ne = tuple(self._scalar(GGUFValueType.UINT64) for _ in range(n_dims))
            raw_type = self._scalar(GGUFValueType.UINT32)
            offset = self._scalar(GGUFValueType.UINT64)
            records.append((name, ne, raw_type, offset))
        self.header_end = header_end = self._pos
        self.data_offset = -(-header_end // self.alignment) * self.alignment
        self._what = "the padding before the tensor data"
        if records and self.data_offset > self.size:  # with no tensors (a vocabulary), no padding is written either
            self._fail("the tensor data section starts past the end of the file")
        if np.any(self.data[header_end:self.data_offset]):
            self._fail("the padding between the header and the tensor data is not zero (shifted data?)")
        names: set[str] = set()
        for name, ne, raw_type, offset in records:
            self._what = f"tensor '{name}'"
            if name in names:
                self._fail("the tensor name appears twice")
            names.add(name)
            self.tensors.append(self._tensor(name, ne, raw_type, offset))
        self._check_layout()

    def _field(self, key: str) -> Field:
        t = self._value_type(self._scalar(GGUFValueType.UINT32))
        if t == GGUFValueType.STRING:
            return Field(key, t, None, self._string())
        if t != GGUFValueType.ARRAY:
            v = self._scalar(t)
            if t == GGUFValueType.BOOL and v > 1:
                self._fail(f"a boolean stored as {v} (0 or 1 expected)")
            return Field(key, t, None, v)
        it = self._value_type(self._scalar(GGUFValueType.UINT32))
        if it == GGUFValueType.ARRAY:
            self._fail("arrays of arrays are not supported")
        if it == GGUFValueType.STRING:
            n = self._count("the array", 8)
            return Field(key, t, it, self._strings(n), n)
        size = _SCALAR[it][1]
        n = self._count("the array", size)
        arr = np.frombuffer(self._buf, dtype=_NUMPY[it], count=n, offset=self._pos)
        if it == GGUFValueType.BOOL and (arr > 1).any():
            self._fail("a boolean array holds values other than 0 and 1")
        self._pos += n * size
        return Field(key, t, it, arr, n)

    def _alignment(self) -> int:
        f = self.fields.get("general.alignment")
        if f is None:
            return DEFAULT_ALIGNMENT
        self._what = "metadata key 'general.alignment'"
        if f.type not in (GGUFValueType.UINT32, GGUFValueType.UINT64) or not 0 < f.value < 1 << 32 \
                or f.value & (f.value - 1):  # any power of two of a uint32, as llama.cpp takes
            self._fail(f"the alignment must be a power of two below 2^32, not {f.value!r}")
        return int(f.value)

    def _tensor(self, name: str, ne: tuple[int, ...], raw_type: int, offset: int) -> RawTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            self._fail(f"unknown tensor type {raw_type}")
            raise AssertionError from None
        if any(d > MAX_ELEMENTS for d in ne):  # a 0 is an empty tensor, which llama.cpp reads too
            self._fail(f"a dimension of {max(ne):,} in {list(ne)}")
        n = 1
        for d in ne:
            n *= d
        if n > MAX_ELEMENTS:
            self._fail(f"dimensions {list(ne)} give {n:,} elements, more than any model holds")
        row = ne[0] if ne else 1
        if row % block:
            self._fail(f"row length {row} is not a multiple of the {qtype.name} block size {block}")
        if offset % self.alignment:
            self._fail(f"data offset {offset} is not a multiple of the alignment {self.alignment}")
        return RawTensor(name, qtype, ne, self.data_offset + offset, n, n // block * type_size)

    def _check_layout(self) -> None:
        """Tensors tile the data section in order of offset, each at the next aligned byte after the one before:
        how every GGUF writer lays them out. A gap, an overlap or bytes left over mean a damaged table."""
        at = self.data_offset
        prev = None
        for t in sorted(self.tensors, key=lambda t: (t.offset, t.n_bytes)):  # an empty tensor shares its offset
            self._what = f"tensor '{t.name}'"
            if t.offset < at:
                self._fail(f"its data (bytes {t.offset}…{t.offset + t.n_bytes}) overlaps tensor '{prev}'")
            if t.offset > at:
                self._fail(f"{t.offset - at} unused bytes before its data (offset {t.offset - self.data_offset}, "
                           f"expected {at - self.data_offset}): wrong offset or type?")
            end = t.offset + t.n_bytes
            if end > self.size:
                raise ModelFormatError(f"{self.name}: tensor '{t.name}' ends at byte {end} but the file has "
                                       f"{self.size} bytes (truncated download?)")
            at = -(-end // self.alignment) * self.alignment
            prev = t.name
        self._what = "the end of the file"
        last_end = max((t.offset + t.n_bytes for t in self.tensors), default=self.header_end)
        if self.size not in (last_end, at):
            self._fail(f"{self.size - last_end} bytes after the last tensor's data (shifted or appended data?)")

    # -- tensor data ---------------------------------------------------------------------------------
    def check_data(self) -> None:
        """No NaN/Inf in any float tensor, nor in any scale of any block of a quantized one (llama.cpp's
        ggml_validate_row_data does the same): one non-finite scale makes its block's every value NaN/Inf, and then
        the whole output. Bytes read from the wrong place (a shifted data section, a wrong offset) make them too.
        A strided view of the scales, a few % of the bytes, but on every page: ~0.1 s a GB from the page cache on
        the 2-core VM, the disk's read speed from cold (pages the loader then finds cached)."""
        for t in self.tensors:
            bad = _first_nonfinite(self._buf, t)
            if bad is not None:
                what = "value at element" if GGML_QUANT_SIZES[t.qtype][0] == 1 else "scale in block"
                raise ModelFormatError(f"{self.name}: damaged: tensor '{t.name}' has a non-finite {what} {bad} "
                                       "(NaN or infinity: its data is damaged or not where the table says)")

    def tensor_data(self, t: RawTensor) -> np.ndarray:
        """The tensor's bytes as gguf's reader views them: typed for float/int types, else uint8 rows."""
        raw = self.data[t.offset:t.offset + t.n_bytes]  # a slice of the memmap: no copy
        view = _TYPED_VIEWS.get(t.qtype)
        if view is not None:
            return raw.view(view).reshape(t.shape)
        block, type_size = GGML_QUANT_SIZES[t.qtype]
        return raw.reshape(t.shape[:-1] + (t.ne[0] // block * type_size,))


def _first_nonfinite(buf: memoryview, t: RawTensor) -> int | None:
    """The first block of t (element, for float tensors) with a NaN/Inf float field; None when all are finite."""
    type_size = GGML_QUANT_SIZES[t.qtype][1]
    fields = _FLOAT_FIELDS.get(t.qtype, ())
    n_blocks = t.n_bytes // type_size
    if not fields and t.qtype != GGMLQuantizationType.IQ1_M:
        return None
    for first in range(0, n_blocks, _SCAN_BLOCKS):
        n = min(_SCAN_BLOCKS, n_blocks - first)
        at = t.offset + first * type_size
        bad = np.zeros(n, dtype=bool)
        for offset, dtype in fields:
            v = np.ndarray((n,), dtype=dtype, buffer=buf, offset=at + offset, strides=(type_size,))
            bad |= _nonfinite(v)
        if t.qtype == GGMLQuantizationType.IQ1_M:
            w = np.ndarray((n, 4), dtype=_U16, buffer=buf, offset=at + _IQ1_M_WORDS, strides=(type_size, 2))
            scale = (w[:, 0] >> 12) | ((w[:, 1] >> 8) & 0xF0) | ((w[:, 2] >> 4) & 0xF00) | (w[:, 3] & 0xF000)
            bad |= _nonfinite(scale.view(_F16))
        hit = np.flatnonzero(bad)
        if hit.size:
            return first + int(hit[0])
    return None


def _nonfinite(v: np.ndarray) -> np.ndarray:
    """Per value of a float field: NaN or infinite."""
    if v.dtype == _U16:  # BF16: all exponent bits set
        return (v & 0x7F80) == 0x7F80
    if v.dtype == _E8M0:
        return v == 0xFF
    return ~np.isfinite(v)
