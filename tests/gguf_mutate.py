"""A deterministic GGUF mutator (tests/test_fuzz_gguf.py and bench/fuzz_gguf.py), and the judge of one case.

The mutator maps a valid file's structure (counts, lengths, value types, array counts, tensor dims, types and
offsets, the data section) and damages it one way per case, chosen from a seeded generator: the same seed gives
the same bytes. It leaves content alone where a change makes another valid file (string payloads such as names,
token texts and the template, finite weights, integers no file can be checked against: rope dims, top-k), and
changes it only into what no valid file holds (issue 48): a NaN/Inf block scale or float weight anywhere in a
tensor, a float hyperparameter out of any model's range, byte tokens typed as control or unused. A case passes
when loading ends in a typed EngineError, or in a model identical to the valid one (same hyperparameters, tensor
table and bytes, tokenizer and template); anything else (an untyped exception, a different model, a hang) is a
finding.
"""
from __future__ import annotations

import hashlib
import signal
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

# value type -> size of a scalar (gguf spec); 8 = STRING, 9 = ARRAY
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# Integer hyperparameters that shape tensors (so a wrong value must be caught) and the tokenizer's ids.
_CHECKABLE = ("block_count", "nextn_predict_layers", "embedding_length", "attention.head_count",
              "attention.head_count_kv", "attention.key_length", "attention.value_length", "ssm.conv_kernel",
              "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "expert_count",
              "expert_feed_forward_length", "expert_shared_feed_forward_length", "full_attention_interval",
              "_token_id", "tokenizer.ggml.add_bos_token")
CLASSES = ("counts", "lengths", "value_types", "tensor_dims", "tensor_types", "tensor_offsets", "data_shift",
           "truncation", "metadata_values", "header_bytes", "block_scales", "float_weights", "metadata_ranges",
           "token_types")
_HUGE = (2 ** 32, 2 ** 40, 2 ** 63, 2 ** 64 - 1)
# Byte offsets of the f16 scales in a block of the quant types the fuzzed files hold (ggml-common.h).
_SCALES = {8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}  # Q8_0, Q4_K, Q5_K, Q6_K
_NONFINITE_F16 = (0x7C00, 0xFC00, 0x7E00)  # +Inf, -Inf, NaN
# Float hyperparameters and values no model holds (issue 48: a rope base of 1e-45 loaded and answered "!!!!").
_ABSURD = {"rope.freq_base": (1e-45, 0.0, -1e4, 1.0, 1e30, np.inf, np.nan),
           "attention.layer_norm_rms_epsilon": (0.0, -1e-6, 0.5, 10.0, np.inf, np.nan), "context_length": (0,)}
_TOKEN_TYPES = (0, 2, 3, 4, 5)  # undefined, unknown, control, user-defined, unused: nothing a byte token is


@dataclass
class Spot:
    kind: str  # "count", "strlen", "vtype", "itype", "ndims", "dim", "ttype", "toffset", "value", "array_item"
    offset: int
    size: int
    key: str = ""
    vtype: int = 0


@dataclass
class Tensor:
    name: str
    qtype: int
    ne: list[int]
    offset: int  # absolute

    @property
    def n_blocks(self) -> int:
        return int(np.prod(self.ne)) // GGML_QUANT_SIZES[self.qtype][0]  # type: ignore[index]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]  # type: ignore[index]


@dataclass
class Layout:
    spots: list[Spot]
    data_start: int
    header_end: int
    alignment: int
    size: int
    tensors: list[Tensor]


def layout(buf: bytes) -> Layout:
    """Where every structural field of a valid GGUF lies."""
    pos = 8
    spots: list[Spot] = []

    def u(fmt: str) -> int:
        nonlocal pos
        v = struct.unpack_from("<" + fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string(key: str) -> str:
        spots.append(Spot("strlen", pos, 8, key))
        n = u("Q")
        nonlocal_pos_advance(n)
        return buf[pos - n:pos].decode()

    def nonlocal_pos_advance(n: int) -> None:
        nonlocal pos
        pos += n

    spots.append(Spot("count", pos, 8, "tensor count"))
    n_t = u("Q")
    spots.append(Spot("count", pos, 8, "key count"))
    n_kv = u("Q")
    alignment = 32
    for _ in range(n_kv):
        key = string("key name")
        spots.append(Spot("vtype", pos, 4, key))
        t = u("I")
        if t == 8:
            string(key)
        elif t == 9:
            spots.append(Spot("itype", pos, 4, key))
            it = u("I")
            spots.append(Spot("count", pos, 8, key))
            n = u("Q")
            for _ in range(n):
                if it == 8:
                    string(key)
                else:
                    spots.append(Spot("array_item", pos, _SIZES[it], key, it))
                    nonlocal_pos_advance(_SIZES[it])
        else:
            spots.append(Spot("value", pos, _SIZES[t], key, t))
            if key == "general.alignment":
                alignment = int.from_bytes(buf[pos:pos + _SIZES[t]], "little")
            nonlocal_pos_advance(_SIZES[t])
    records = []
    for _ in range(n_t):
        name = string("tensor name")
        spots.append(Spot("ndims", pos, 4, name))
        nd = u("I")
        ne = []
        for _ in range(nd):
            spots.append(Spot("dim", pos, 8, name))
            ne.append(u("Q"))
        spots.append(Spot("ttype", pos, 4, name))
        qtype = u("I")
        spots.append(Spot("toffset", pos, 8, name))
        records.append((name, qtype, ne, u("Q")))
    header_end = pos
    data_start = -(-pos // alignment) * alignment
    tensors = [Tensor(name, qtype, ne, data_start + offset) for name, qtype, ne, offset in records]
    return Layout(spots, data_start, header_end, alignment, len(buf), tensors)


def _put(b: bytearray, s: Spot, v: int) -> None:
    b[s.offset:s.offset + s.size] = int(v % (1 << (8 * s.size))).to_bytes(s.size, "little")


def _get(b: bytes, s: Spot) -> int:
    return int.from_bytes(b[s.offset:s.offset + s.size], "little")


def _number(rng: np.random.Generator, old: int) -> int:
    choices = [0, 1, old - 1, old + 1, old * 2, old // 2, *_HUGE, int(rng.integers(0, 1 << 31))]
    return int(choices[int(rng.integers(len(choices)))])


def mutate(buf: bytes, lay: Layout, cls: str, rng: np.random.Generator) -> tuple[bytes, str]:
    """One damaged copy of `buf` (class `cls`) and a short description."""
    b = bytearray(buf)
    pick = lambda kinds, pred=lambda s: True: (lambda xs: xs[int(rng.integers(len(xs)))])(  # noqa: E731
        [s for s in lay.spots if s.kind in kinds and pred(s)])
    if cls in ("counts", "lengths"):
        s = pick(("count",) if cls == "counts" else ("strlen",))
        v = _number(rng, _get(buf, s))
        _put(b, s, v)
        return bytes(b), f"{s.kind} of {s.key} -> {v}"
    if cls == "value_types":
        s = pick(("vtype", "itype"))
        v = int(rng.choice([0, 1, 4, 5, 6, 7, 8, 9, 10, 12, 13, 255, 2 ** 31]))
        _put(b, s, v)
        return bytes(b), f"{s.kind} of {s.key} -> {v}"
    if cls == "tensor_dims":
        s = pick(("ndims", "dim"))
        v = int(rng.choice([0, 5, 2 ** 31])) if s.kind == "ndims" else _number(rng, _get(buf, s))
        _put(b, s, v)
        return bytes(b), f"{s.kind} of {s.key} -> {v}"
    if cls == "tensor_types":
        s = pick(("ttype",))
        v = int(rng.integers(0, 42)) if rng.random() < 0.9 else 2 ** 31
        _put(b, s, v)
        return bytes(b), f"type of {s.key} -> {v}"
    if cls == "tensor_offsets":
        s = pick(("toffset",))
        old = _get(buf, s)
        others = [_get(buf, o) for o in lay.spots if o.kind == "toffset" and o is not s]
        choices = [0, old + int(rng.integers(1, lay.alignment)), int(rng.choice(others)),
                   2 ** 64 - lay.data_start + int(rng.integers(0, 64)) * lay.alignment, 2 ** 64 - 1,
                   old + lay.alignment, old - lay.alignment, lay.size]
        v = int(choices[int(rng.integers(len(choices)))])
        _put(b, s, v)
        return bytes(b), f"offset of {s.key} -> {v}"
    if cls == "data_shift":
        k = int(rng.integers(1, 32))
        filler = bytes(k) if rng.random() < 0.5 else rng.bytes(k)
        if rng.random() < 0.5:
            return buf[:lay.data_start] + filler + buf[lay.data_start:], f"{k} bytes inserted before the data"
        return buf[:lay.data_start] + buf[lay.data_start + k:] + filler, f"data moved {k} bytes earlier"
    if cls == "truncation":
        cut = int(rng.integers(0, lay.header_end)) if rng.random() < 0.5 else int(rng.integers(lay.header_end, lay.size))
        return buf[:cut], f"cut at byte {cut}"
    if cls == "metadata_values":
        s = pick(("value", "array_item"), lambda s: s.vtype != 6 and (
            s.key == "tokenizer.ggml.token_type" or any(s.key.endswith(c) for c in _CHECKABLE)))
        old = _get(buf, s)
        if s.key == "tokenizer.ggml.token_type":
            v = int(rng.choice([7, 8, 255, 2 ** 31, 2 ** 32 - 1]))
        elif s.vtype == 7:
            v = int(rng.integers(2, 256))
        elif s.key.endswith("_token_id"):  # another id inside the vocabulary is a different valid file
            v = int(rng.choice([2 ** 31, 2 ** 32 - 1, 10 ** 6, 65_535]))
        else:
            v = _number(rng, old)
        if v == old:
            v = old + 1
        _put(b, s, v)
        if rng.random() < 0.25 and s.kind == "value":  # and sometimes the key's type too (a float id)
            vt = next(x for x in lay.spots if x.kind == "vtype" and x.key == s.key)
            _put(b, vt, 6 if s.size == 4 else 12)
        return bytes(b), f"value of {s.key} -> {v}"
    if cls == "header_bytes":
        spots = [s for s in lay.spots if s.kind not in ("value", "array_item")]
        desc = []
        for _ in range(int(rng.integers(1, 5))):
            s = spots[int(rng.integers(len(spots)))]
            i = s.offset + int(rng.integers(s.size))
            b[i] ^= 1 << int(rng.integers(8))
            desc.append(f"{s.kind}@{i}")
        return bytes(b), "bit flips in " + ", ".join(desc)
    if cls == "block_scales":  # anywhere, not only near a tensor's ends (the check once sampled those)
        t = _one(rng, [t for t in lay.tensors if t.qtype in _SCALES])
        blocks = sorted({int(x) for x in rng.integers(0, t.n_blocks, int(rng.choice([1, 8])))})
        v = int(rng.choice(_NONFINITE_F16))
        for i in blocks:
            at = t.offset + i * t.block_bytes + int(rng.choice(_SCALES[t.qtype]))
            b[at:at + 2] = v.to_bytes(2, "little")
        return bytes(b), f"scale {v:#06x} in blocks {blocks} of {t.name}"
    if cls == "float_weights":
        t = _one(rng, [t for t in lay.tensors if t.qtype == 0])  # F32
        items = sorted({int(x) for x in rng.integers(0, t.n_blocks, int(rng.choice([1, 8])))})
        v = float(rng.choice([np.inf, -np.inf, np.nan]))
        for i in items:
            b[t.offset + 4 * i:t.offset + 4 * i + 4] = struct.pack("<f", v)
        return bytes(b), f"{v} at elements {items} of {t.name}"
    if cls == "metadata_ranges":
        key = str(rng.choice(sorted(_ABSURD)))
        s = pick(("value",), lambda s: s.key.endswith("." + key))
        v = rng.choice(_ABSURD[key])
        if s.vtype == 6:
            b[s.offset:s.offset + 4] = struct.pack("<f", float(v))
        else:
            _put(b, s, int(v))
        return bytes(b), f"value of {s.key} -> {v}"
    if cls == "token_types":
        items = [s for s in lay.spots if s.kind == "array_item" and s.key == "tokenizer.ggml.token_type"]
        v = int(rng.choice(_TOKEN_TYPES))
        which = "all" if rng.random() < 0.5 else "the first 256"  # the byte tokens come first in BPE vocabularies
        for s in items if which == "all" else items[:256]:
            _put(b, s, v)
        return bytes(b), f"{which} token types -> {v}"
    raise ValueError(cls)


def _one(rng: np.random.Generator, xs: list[Any]) -> Any:
    return xs[int(rng.integers(len(xs)))]


def cases(n: int, seed: int) -> list[tuple[int, str]]:
    """(case seed, class) for n cases, classes in turn."""
    return [(seed * 1_000_003 + i, CLASSES[i % len(CLASSES)]) for i in range(n)]


def make_case(buf: bytes, lay: Layout, case_seed: int, cls: str) -> tuple[bytes, str]:
    return mutate(buf, lay, cls, np.random.default_rng(case_seed))


def fingerprint(path: Path, opener: Callable[[Path], Any]) -> str:
    """What identifies a loaded model: hyperparameters, tensor table and bytes, tokenizer, template.
    `opener(path) -> (ModelFile, Tokenizer, ChatFormat)`."""
    mf, tok, chat = opener(path)
    h = hashlib.sha1()
    h.update(repr(mf.hparams).encode())
    for name in sorted(mf.tensors):
        t = mf.tensors[name]
        h.update(repr((name, int(t.qtype), t.shape)).encode())
        h.update(memoryview(np.ascontiguousarray(mf.raw(name)).view(np.uint8)))
    h.update(repr((tok.n_vocab, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos, sorted(tok.eog_ids))).encode())
    h.update(repr([(tok.token_text(i), tok.token_type(i)) for i in range(tok.n_vocab)]).encode())
    h.update(chat.source.encode())
    return h.hexdigest()


class CaseTimeout(BaseException):
    """Raised by the caller's alarm when a case runs past its time bound (not an Exception: nothing catches it)."""


def judge(path: Path, opener: Callable[[Path], Any], valid: str, typed: type[BaseException]) -> tuple[str, str]:
    """(outcome, detail): "typed" (an error of class `typed`), "same" (the valid model), "different" (a model
    that is not the valid one: garbage loaded), "untyped" (any other exception)."""
    try:
        fp = fingerprint(path, opener)
    except typed as e:
        return "typed", str(e)
    except CaseTimeout:
        raise
    except BaseException as e:  # noqa: BLE001 (a finding, recorded with its class)
        return "untyped", f"{type(e).__name__}: {str(e)[:200]}"
    return ("same" if fp == valid else "different"), ""


def timed_judge(path: Path, opener: Callable[[Path], Any], valid: str, typed: type[BaseException],
                limit_s: int) -> tuple[str, str, float]:
    """judge() under a SIGALRM of limit_s seconds (main thread only): (outcome, detail, seconds); "hang" past it."""
    def alarm(*_: object) -> None:
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    t0 = time.perf_counter()
    signal.alarm(limit_s)
    try:
        outcome, detail = judge(path, opener, valid, typed)
    except CaseTimeout:
        outcome, detail = "hang", f"stopped after {limit_s} s"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return outcome, detail, time.perf_counter() - t0
