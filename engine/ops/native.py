"""The native library (engine/native/*.c, built with the package by setup.py), loaded with ctypes.

One wrapper per exported kernel, taking the backend's choices (instruction-set level, thread count) as
arguments: nothing here decides which kernel runs, engine.ops.backend and the ops modules do. Where the library
is missing (a source install without a C compiler) `LIB` is None and only the torch backend exists.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int


class ExpertStack(ctypes.Structure):
    """moe.c's ExpertStack: one projection's experts as the products read them."""

    _fields_ = [("w", _P), ("expert_bytes", _I), ("n_rows", _I), ("k", _I), ("code", ctypes.c_int32),
                ("threads", ctypes.c_int32)]


_STACK = ctypes.POINTER(ExpertStack)


# engine/native/layer.h's structures: a decoder layer's weights (LayerW, made once), one pass's operands, and what a step
# does before and after its layers
MAX_PARTS = 4  # layer.h's MAX_PARTS: check_mirror refuses a library whose Parts has another size


class Parts(ctypes.Structure):
    """layer.h's Parts: one projection as up to MAX_PARTS matrices side by side, each in its own type."""

    _fields_ = [("part", ExpertStack * MAX_PARTS), ("n", _I)]

    @property
    def expert_bytes(self) -> int:
        """The parts' weight bytes (an ExpertStack's of one expert)."""
        return sum(self.part[i].expert_bytes for i in range(self.n))


class GdnW(ctypes.Structure):
    _fields_ = [("in_", Parts), ("out", ExpertStack), ("taps", _P), ("A", _P), ("dt_bias", _P), ("norm", _P),
                ("c", _I), ("kk", _I), ("hk", _I), ("hv", _I), ("dk", _I), ("dv", _I)]


class AttnW(ctypes.Structure):
    _fields_ = [("in_", Parts), ("out", ExpertStack), ("q_norm", _P), ("k_norm", _P), ("h", _I), ("h_kv", _I),
                ("dk", _I), ("dv", _I), ("n_rot", _I), ("scale", ctypes.c_float)]


class FfnW(ctypes.Structure):
    _fields_ = [("router", _P), ("shared_inp", _P), ("sg", ExpertStack), ("su", ExpertStack), ("sd", ExpertStack),
                ("gate", ExpertStack), ("up", ExpertStack), ("down", ExpertStack), ("gu", Parts), ("k_used", _I), ("n_expert", _I),
                ("dense", ctypes.c_int32), ("pad", ctypes.c_int32)]


class LayerW(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("post_norm", _P), ("d", _I), ("eps", ctypes.c_float), ("attention", ctypes.c_int32),
                ("gdn", GdnW), ("attn", AttnW), ("ffn", FfnW), ("next_p", _P), ("next_end", _P), ("next_credit", _I)]


class LayerPass(ctypes.Structure):
    _fields_ = [("x", _P), ("n", _I), ("pos", _I), ("threads", ctypes.c_int32), ("isa", ctypes.c_int32),
                ("conv", _P), ("window", _P), ("s_in", _P), ("s_out", _P), ("q", _P), ("k", _P), ("v", _P),
                ("beta", _P), ("decay", _P), ("kc", _P), ("vc", _P), ("cos_t", _P), ("sin_t", _P), ("logits", _P),
                ("wts", _P), ("idx", _P), ("counts", _P)]


class StepIn(ctypes.Structure):
    """layer.h's StepIn: a step's token ids, whose rows of the embedding table (a dequant_rows type) become x."""

    _fields_ = [("table", _P), ("row_bytes", _I), ("n_rows", _I), ("ids", _P), ("qtype", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


class MtpIn(ctypes.Structure):
    """layer.h's MtpIn: the MTP head's input rows, eh [RMSNorm(e; enorm) ; RMSNorm(hidden; hnorm)]."""

    _fields_ = [("enorm", _P), ("hnorm", _P), ("hidden", _P), ("eh", ExpertStack), ("eps", ctypes.c_float),
                ("pad", ctypes.c_int32)]


class StepOut(ctypes.Structure):
    """layer.h's StepOut: the output norm and LM head after a step's layers, and where their rows go."""

    _fields_ = [("norm", _P), ("eps", ctypes.c_float), ("head", _STACK), ("h", _P), ("logits", _P)]


MIRRORS = (ExpertStack, Parts, GdnW, AttnW, FfnW, LayerW, LayerPass, StepIn, MtpIn, StepOut)  # checked against the library at load


class LayoutError(RuntimeError):
    """The library and this module disagree on a structure, a failure code or a number (a library built from other
    sources than this module's: rebuild it, python setup.py build_ext --inplace)."""


class _Entry(ctypes.Structure):
    """engine/native/border.c's BorderEntry"""

    _fields_ = [("name", ctypes.c_char_p), ("value", _I), ("size", _I)]


def _border(lib: ctypes.CDLL) -> dict[str, tuple[int, int]]:
    """border.c's table: per name its value and size (a structure: 0 and its size; "S.f": f's offset and size)."""
    table = ctypes.POINTER(_Entry)()
    n = lib.border_table(ctypes.byref(table))
    return {table[i].name.decode(): (table[i].value, table[i].size) for i in range(n)}


def check_mirror(mirror: type[ctypes.Structure], border: dict[str, tuple[int, int]]) -> None:
    """Raise LayoutError, naming the structure and field, where the ctypes `mirror` of the C structure of its name
    differs from the library's table (`border`: BORDER) in size, in a field's offset or size, or in its fields."""
    s, names = mirror.__name__, [f[0] for f in mirror._fields_]
    if s not in border:
        raise LayoutError(f"the native library has no structure {s}")
    if border[s][1] != ctypes.sizeof(mirror):
        raise LayoutError(f"{s}: {border[s][1]} bytes in the native library, {ctypes.sizeof(mirror)} in its mirror")
    for name in names:
        field, c = getattr(mirror, name), border.get(f"{s}.{name}")
        if c is None:
            raise LayoutError(f"{s}.{name}: the native library's {s} has no such field")
        if c != (field.offset, field.size):
            raise LayoutError(f"{s}.{name}: at {c[0]}, {c[1]} bytes in the native library; at {field.offset}, "
                              f"{field.size} bytes in its mirror")
    for key in border:
        if key.startswith(f"{s}.") and key[len(s) + 1:] not in names:
            raise LayoutError(f"{key}: a field of the native library's {s} that its mirror lacks")


_SIGNATURES: dict[str, tuple[list, object]] = {
    "cpu_features": ([], _C),
    "quantize_q8_k": ([_P, _I, _I, _P, _P, _P, _C], None),
    "quantize_q8_0": ([_P, _I, _I, _P, _P, _C], None),
    "quantize_q8_1": ([_P, _I, _I, _P, _P, _P, _C], None),
    "round_half": ([_P, _I, _C, _P], None),
    "q8_k_to_q4_k_order": ([_P, _I, _I, _P], None),
    "quant_matmul": ([_C, _P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _P, _I, _C, _C], None),
    "quant_matmul_pairs": ([_C, _P, _I, _I, _I, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _P, _C, _C], None),
    "repack_x16": ([_C, _P, _I, _I, _P, _C], None),
    "packed_x16_bytes": ([_C], _I),
    "group_expert_pairs": ([_P, _I, _I, _I, _P, _P, _P, _P, _P], _I),
    "attention_causal": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _C, _C], _C),
    "moe_routed": ([_STACK, _STACK, _STACK, _P, _I, _P, _P, _I, _I, _P, _C], _C),
    "silu_mul": ([_P, _P, _I], None),
    "moe_route": ([_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _C], _C),
    "moe_layer": ([_P, _P, _STACK, _STACK, _STACK, _STACK, _STACK, _STACK, _P, _I, _I, _I, _P, _P, _P, _P, _C], _C),
    "gdn_recurrence": ([_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _C, _C], _C),
    "gdn_inputs": ([_P, _P, _I, _I, _I, _P, _P, _P, _P, _I, _I, _I, ctypes.c_float, ctypes.c_float, _P, _P, _P, _P,
                    _P], None),
    "rope_neox": ([_P, _I, _I, _I, _I, _P, _P], None),
    "dequant_rows": ([_C, _P, _I, _I, _P, _I, _I, _P], _C),
    "norm_rows": ([_P, _I, _I, _P, _P, ctypes.c_float, _C, ctypes.c_float, _P], None),
    "decoder_layer": ([_P, _P], _C),
    "decoder_layers": ([_P, _P, _I, _P, _I, _I, _P, _P, _P, _P, _P], _C),
    "decoder_layers_many": ([_P, _P, _P, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P], _C),
    "mtp_layers": ([_P, _P, _I, _P, _I, _I, _P, _P, _P, _P, _P, _I, _P], _C),
    "exp_rows": ([_P, _I, _P], None),
    "silu_rows": ([_P, _I, _P], None),
    "sigmoid_mul": ([_P, _P, _I], None),
    "trace_enable": ([_C], None),
    "trace_read": ([_P], _C),
    "pool_after_call": ([_I, _I, _I, _I], _I),
    "sketch_make": ([_C, _P, _I, _I, _I, _P, _P, _C], _C),
    "sketch_scores": ([_P, _P, _I, _I, _P, _P, _C, _C], _C),
    "sketch_logits": ([_P, _P, _I, _I, _P, _STACK, _I, _P, _C, _C], _C),
    "masked_argmax": ([_P, _P, _I, _C], _I),
    "mask_row": ([_P, _P, _I, _I, _C], None),
    "border_table": ([_P], _I),
}


def _load() -> tuple[ctypes.CDLL | None, dict[str, tuple[int, int]]]:
    """The library and its border table (engine/native/border.c)."""
    here = Path(__file__).resolve().parents[1] / "native"
    for path in sorted(here.glob("_native*.so")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        return lib, _border(lib)
    return None, {}


LIB, BORDER = _load()


def _number(name: str) -> int:
    """A constant of the library's (kernels.h), by its C name; 0 where the library is missing (nothing native runs)."""
    if LIB is None:
        return 0
    if name not in BORDER:
        raise LayoutError(f"the native library does not give {name}")
    return BORDER[name][0]


QK_K = GGML_QUANT_SIZES[QT.Q8_K][0]  # values per K-quant block and per Q8_K activation block (the format's, as gguf)
QK_8_0 = GGML_QUANT_SIZES[QT.Q8_0][0]  # values per Q8_0 block
# Weight types with native products, by the rows they take (engine.ops.activations.act_format): Q8_K activations in
# blocks of 256 (the K-quants, IQ4_XS and the grid-codebook IQ types of engine/native/iq_grid.c), the others in blocks
# of 32 (Q8_0, Q8_1, or F16/BF16 values in chunks of 32).
IQ_GRID_TYPES = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S, QT.IQ1_M)  # iq_grid.c
Q8_K_PRODUCTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q2_K, QT.Q3_K, QT.IQ4_XS) + IQ_GRID_TYPES
BLOCK32_PRODUCTS = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL, QT.MXFP4, QT.F16, QT.BF16)
PRODUCT_TYPES = Q8_K_PRODUCTS + BLOCK32_PRODUCTS
# the library's numbers (kernels.h)
MAX_EXPERTS = _number("MAX_EXPERTS")  # the most experts the native router (moe_route, moe_layer) takes
MAX_DV = _number("MAX_DV")  # the widest GDN value head gdn_recurrence takes
GROUP = _number("GROUP")  # rows interleaved in a packed weight
SKETCH_BLOCK = _number("SKETCH_BLOCK")  # values per block of a head sketch (sketch.c)
PACKED_CODE = {t: _number(f"T_{t.name}_PACKED")  # kernels.h's T_*_PACKED
               for t in (QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL, QT.MXFP4,
                                                                 QT.IQ4_XS)}
# cpu_features() bits
_CPU_AVX512, _CPU_VNNI, _CPU_AVX2, _CPU_AVXVNNI = (_number(f"CPU_{n}") for n in ("AVX512", "VNNI", "AVX2", "AVXVNNI"))


def _trace_sections() -> tuple[str, ...]:
    """engine/native/trace.c's sections: kernels.h's TRACE_* in their order (trace_read's), in lower case."""
    trace = sorted((v, n) for n, (v, _) in BORDER.items() if n.startswith("TRACE_"))
    return tuple(n.removeprefix("TRACE_").lower() for _, n in trace)


TRACE_SECTIONS = _trace_sections()

# What each failure code (kernels.h RC_*, by name) raises, after the words of the call that failed
_FAILURES: dict[str, tuple[type[Exception], str]] = {
    "RC_NO_MEMORY": (MemoryError, "out of memory"),
    "RC_EXPERT_ID": (ValueError, "an expert id out of range"),
    "RC_MAX_EXPERTS": (ValueError, f"more experts than the native router takes ({MAX_EXPERTS}), or top-k over them"),
    "RC_MAX_DV": (ValueError, f"GDN value heads wider than the native kernel takes ({MAX_DV})"),
    "RC_ROW_ID": (IndexError, "a row id out of range"),
    "RC_ROW_TYPE": (ValueError, "a table type dequant_rows does not read"),
}


def check_codes(border: dict[str, tuple[int, int]]) -> None:
    """Raise LayoutError where the library's failure codes (`border`: BORDER) and _FAILURES name different codes."""
    codes = {n for n in border if n.startswith("RC_")}
    odd = sorted(codes ^ _FAILURES.keys())
    if odd:
        side = "the native library" if odd[0] in codes else "engine.ops.native"
        raise LayoutError(f"{odd[0]}: a failure code only {side} knows")


if LIB is not None:  # refuse a library built from other sources than this module's
    for mirror in MIRRORS:
        check_mirror(mirror, BORDER)
    check_codes(BORDER)
_ERRORS = {_number(name): failure for name, failure in _FAILURES.items()}  # _FAILURES by code


def _check(rc: int, what: str) -> None:
    """Raise the exception a failure code (rc < 0) stands for, prefixed with `what` failed."""
    if rc < 0:
        kind, msg = _ERRORS.get(rc, (RuntimeError, f"native failure {rc}"))
        raise kind(f"{what}: {msg}")


def product_cols(qtype: QT) -> int:
    """The values a native product takes a weight row in: its rows must be a multiple of this."""
    return QK_K if qtype in Q8_K_PRODUCTS else QK_8_0


def binds(qtype: QT, n_cols: int) -> bool:
    """Whether a weight of this type and row width runs in a native product."""
    return qtype in PRODUCT_TYPES and n_cols % product_cols(qtype) == 0


def available() -> bool:
    return LIB is not None


def cpu_avx512() -> bool:
    """The stored-order K-quant products and the float kernels have AVX512 forms for this CPU."""
    return LIB is not None and bool(LIB.cpu_features() & _CPU_AVX512)


def cpu_vnni() -> bool:
    """AVX512-VNNI: the packed (16 rows interleaved) products' dpbusd form (AVX2 packs too, with maddubs/madd) and
    the stored-order Q8_0 product's dpbusd form."""
    return LIB is not None and bool(LIB.cpu_features() & _CPU_VNNI)


def cpu_avxvnni() -> bool:
    """AVX2 and the VEX AVX-VNNI (Intel desktop cores from Alder Lake on): the 256-bit packed and Q8_0 products'
    dpbusd form."""
    return LIB is not None and bool(LIB.cpu_features() & _CPU_AVXVNNI)


def cpu_avx2() -> bool:
    """AVX2 with FMA and F16C: the 256-bit products."""
    return LIB is not None and bool(LIB.cpu_features() & _CPU_AVX2)


def _ptr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def quantize_q8_k(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bsums: torch.Tensor, isa: int) -> None:
    """Rows x [M, K] float32 to Q8_K: quants q [M, K], scales d [M, K/256], sums of 16 quants bsums [M, K/16]."""
    LIB.quantize_q8_k(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr(), bsums.data_ptr(),  # type: ignore[union-attr]
                        isa)


def quantize_q8_0(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, isa: int) -> None:
    """Rows x [M, K] float32 to Q8_0: quants q [M, K], f16-rounded scales d [M, K/32]."""
    LIB.quantize_q8_0(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr(), isa)  # type: ignore[union-attr]


def quantize_q8_1(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, s: torch.Tensor, isa: int) -> None:
    """Rows x [M, K] float32 to Q8_1: Q8_0's quants q [M, K] and scales d [M, K/32], and s = fp16(d·Σq) [M, K/32]."""
    LIB.quantize_q8_1(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr(), s.data_ptr(),  # type: ignore[union-attr]
                      isa)


def q4_k_order(q: torch.Tensor) -> torch.Tensor:
    """Q8_K quants [M, K] in the order Q4_K blocks hold their values (the AVX512 stored-order Q4_K product)."""
    out = torch.empty_like(q)
    LIB.q8_k_to_q4_k_order(q.data_ptr(), q.shape[0], q.shape[1], out.data_ptr())  # type: ignore[union-attr]
    return out


def packed_bytes(qtype: QT, n_rows: int, n_blocks: int) -> int:
    return n_rows * n_blocks * LIB.packed_x16_bytes(int(qtype))  # type: ignore[union-attr]


def repack(qtype: QT, raw: torch.Tensor, n_rows: int, n_blocks: int, out: torch.Tensor, threads: int) -> None:
    """Stored blocks raw [n_rows, ·] interleaved 16 rows at a time into `out` (packed_bytes long)."""
    LIB.repack_x16(int(qtype), raw.data_ptr(), n_rows, n_blocks, out.data_ptr(), threads)  # type: ignore[union-attr]


def matmul(code: int, w: torch.Tensor, n_out: int, q: torch.Tensor, d: torch.Tensor | None,
           bsums: torch.Tensor | None, s: torch.Tensor | None, perm: torch.Tensor | None, k: int, out: torch.Tensor,
           threads: int, isa: int) -> None:
    """out [M, n_out] = activation rows (q, d, bsums, s: engine.ops.activations.QuantRows; perm: q in Q4_K order) ×
    the weight bytes w of kernel type `code` (a ggml type, or a PACKED_CODE)."""
    LIB.quant_matmul(code, w.data_ptr(), w.numel() // n_out, n_out, q.data_ptr(), _ptr(d), _ptr(bsums), _ptr(s),  # type: ignore[union-attr]
                  _ptr(perm), k, q.shape[0], out.data_ptr(), n_out, threads, isa)


def matmul_pairs(code: int, w: torch.Tensor, n_expert: int, rows: int, q: torch.Tensor, d: torch.Tensor | None,
                 bsums: torch.Tensor | None, s: torch.Tensor | None, perm: torch.Tensor | None, k: int,
                 xrow: torch.Tensor,
                 experts: torch.Tensor, starts: torch.Tensor, out: torch.Tensor, threads: int, isa: int) -> None:
    """Routed-expert products out [P, rows]: pair p (grouped by expert: group g = pairs starts[g]…starts[g+1] on
    expert experts[g]) multiplies activation row xrow[p] by that expert's matrix in the stack w (n_expert
    matrices of `rows` rows). Index tensors int64, contiguous."""
    expert_bytes = w.numel() // n_expert
    LIB.quant_matmul_pairs(code, w.data_ptr(), expert_bytes, expert_bytes // rows, rows, q.data_ptr(),  # type: ignore[union-attr]
                        _ptr(d), _ptr(bsums), _ptr(s), _ptr(perm), k, xrow.data_ptr(), experts.shape[0],
                        experts.data_ptr(), starts.data_ptr(), out.data_ptr(), threads, isa)


def expert_stack(code: int, w: torch.Tensor, n_expert: int, rows: int, k: int, threads: int) -> ExpertStack:
    """A stack of n_expert matrices [rows, k] (bytes w of kernel type `code`) for moe_routed."""
    return ExpertStack(w.data_ptr(), w.numel() // n_expert, rows, k, code, threads)


def moe_routed(stacks: tuple[ExpertStack, ExpertStack, ExpertStack], x: torch.Tensor, idx: torch.Tensor,
               w: torch.Tensor, n_expert: int, isa: int) -> torch.Tensor:
    """A pass's routed experts in one call: x [n, d] float32, idx [n, k] int64 and w [n, k] float32 (contiguous)
    → y [n, d] = Σ_s w[t, s] · down_e(silu(gate_e x_t) ⊙ up_e x_t), e = idx[t, s], in slot order."""
    gate, up, down = stacks
    y = torch.empty(x.shape[0], down.n_rows)
    rc = LIB.moe_routed(ctypes.byref(gate), ctypes.byref(up), ctypes.byref(down), x.data_ptr(), x.shape[0],  # type: ignore[union-attr]
                        idx.data_ptr(), w.data_ptr(), idx.shape[1], n_expert, y.data_ptr(), isa)
    _check(rc, f"the routed experts' pass over {n_expert} experts")
    return y


def moe_layer(router: torch.Tensor, shared_inp: torch.Tensor | None, shared: tuple[ExpertStack, ...] | None,
              stacks: tuple[ExpertStack, ExpertStack, ExpertStack], x: torch.Tensor, k: int,
              isa: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer in one call (engine/native/moe.c moe_layer): router [E, d] float32, the shared expert's gate
    input [d] and stacks (one expert each; None: no shared expert), the routed stacks, x [n, d] float32
    (contiguous). Returns y [n, d], router logits [n, E], top-k weights [n, k] and ids [n, k]."""
    n, e_n = x.shape[0], router.shape[0]
    y, logits, wts = torch.empty(n, stacks[2].n_rows), torch.empty(n, e_n), torch.empty(n, k)
    idx = torch.empty(n, k, dtype=torch.long)
    sg, su, sd = (ctypes.byref(s) for s in shared) if shared is not None else (None, None, None)
    rc = LIB.moe_layer(router.data_ptr(), _ptr(shared_inp), sg, su, sd,  # type: ignore[union-attr]
                       *(ctypes.byref(s) for s in stacks), x.data_ptr(), n, k, e_n, logits.data_ptr(),
                       wts.data_ptr(), idx.data_ptr(), y.data_ptr(), isa)
    _check(rc, f"the MoE layer ({e_n} experts, top {k})")
    return y, logits, wts, idx


def moe_route(router: torch.Tensor, shared_inp: torch.Tensor | None, x: torch.Tensor, k: int, threads: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """moe.c moe_route: router logits [n, E], top-k weights and ids [n, k], and with shared_inp [d] the shared
    expert's gate sigmoid(shared_inp · x) [n, 1]; router [E, d] and x [n, d] float32, contiguous."""
    n, e_n = x.shape[0], router.shape[0]
    logits, wts, idx = torch.empty(n, e_n), torch.empty(n, k), torch.empty(n, k, dtype=torch.long)
    sgate = torch.empty(n, 1) if shared_inp is not None else None
    rc = LIB.moe_route(router.data_ptr(), _ptr(shared_inp), x.data_ptr(), n, x.shape[1], k, e_n,  # type: ignore[union-attr]
                       logits.data_ptr(), wts.data_ptr(), idx.data_ptr(), _ptr(sgate), threads)
    _check(rc, f"the router ({e_n} experts, top {k})")
    return logits, wts, idx, sgate


@dataclass(frozen=True)
class Groups:
    """A pass's (token, slot) pairs grouped by expert, as a stable argsort of the flat top-k ids orders them."""

    order: torch.Tensor  # [P] flat pair indices t·k + s, in expert order
    tokens: torch.Tensor  # [P] the pairs' tokens (order // k)
    experts: torch.Tensor  # [G] the experts present, ascending
    counts: torch.Tensor  # [G] their pairs
    starts: torch.Tensor  # [G + 1] their first pairs, then P


def group_pairs(idx: torch.Tensor, n_expert: int) -> Groups:
    """A pass's top-k ids [n, k] (int64 on the CPU) grouped by expert, in one call."""
    idx = idx.contiguous()
    p_n, g_max = idx.numel(), min(idx.numel(), n_expert)
    buf = torch.empty(2 * p_n + 3 * g_max + 1, dtype=torch.long)
    order, tokens, experts, counts, starts = buf.split([p_n, p_n, g_max, g_max, g_max + 1])
    g = LIB.group_expert_pairs(idx.data_ptr(), idx.shape[0], idx.shape[1], n_expert, order.data_ptr(),  # type: ignore[union-attr]
                           tokens.data_ptr(), experts.data_ptr(), counts.data_ptr(), starts.data_ptr())
    _check(g, f"grouping pairs by expert, ids in [0, {n_expert})")
    return Groups(order, tokens, experts[:g], counts[:g], starts[:g + 1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float, threads: int,
              isa: int) -> torch.Tensor:
    """Causal attention of queries q [n, H, D] (query i at position pos + i) over the cache rows k [≥ pos + n, H_kv,
    D], v [·, H_kv, D_v] (float32, contiguous, on the CPU): out [n, H·D_v]."""
    n, h, dk = q.shape
    h_kv, dv = v.shape[1], v.shape[2]
    q = q.contiguous()
    out = torch.empty(n, h * dv)
    rc = LIB.attention_causal(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), n, pos, h, h_kv, dk, dv,  # type: ignore[union-attr]
                          scale, threads, isa)
    _check(rc, "attention")
    return out


def gdn_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
                   S: torch.Tensor, out: torch.Tensor, threads: int, isa: int) -> torch.Tensor:
    """The delta rule over n tokens: q, k [n, H_k, d_k] (value head h reads key head h mod H_k), v [n, H, d_v],
    β and e^g [n, H] (all contiguous); from state S [H, d_k, d_v] to the state after the last token in `out`
    (S itself: in place). Returns o [n, H, d_v]."""
    n, hk, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    o = torch.empty(n, h, dv)
    rc = LIB.gdn_recurrence(q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), decay.data_ptr(),  # type: ignore[union-attr]
                              S.data_ptr(), out.data_ptr(), o.data_ptr(), n, h, hk, dk, dv, threads, isa)
    _check(rc, f"the GDN recurrence (value heads of {dv})")
    return o


def norm_rows(x: torch.Tensor, w: torch.Tensor | None, gate: torch.Tensor | None, eps: float, l2: bool,
              post: float = 1.0) -> torch.Tensor:
    """Per-row RMS (or L2) norm of x [..., d] (float32 on the CPU), times w [d], times gate (x's shape), times
    `post`: a new tensor."""
    d = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    g = gate.contiguous() if gate is not None else None
    wc = w.contiguous() if w is not None else None
    LIB.norm_rows(x.data_ptr(), x.numel() // d, d, _ptr(wc), _ptr(g), eps, int(l2), post, y.data_ptr())  # type: ignore[union-attr]
    return y


def gdn_inputs(window: torch.Tensor, taps: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A: torch.Tensor,
               dt_bias: torch.Tensor, hk: int, dk: int, eps: float,
               q_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """engine/native/gdn.c gdn_inputs: window [K−1+n, C], taps [K, C], b and a [n, H], A and dt_bias [H] (float32,
    contiguous) → u [n, C], q and k [n, H_k, d_k], beta and g [n, H]."""
    kk, c = taps.shape
    n, h = b.shape
    u, q, k = torch.empty(n, c), torch.empty(n, hk, dk), torch.empty(n, hk, dk)
    beta, g = torch.empty(n, h), torch.empty(n, h)
    LIB.gdn_inputs(window.data_ptr(), taps.data_ptr(), n, c, kk, b.data_ptr(), a.data_ptr(), A.data_ptr(),  # type: ignore[union-attr]
                   dt_bias.data_ptr(), h, hk, dk, eps, q_scale, u.data_ptr(), q.data_ptr(), k.data_ptr(),
                   beta.data_ptr(), g.data_ptr())
    return u, q, k, beta, g


DEQUANT_ROW_TYPES = frozenset(int(t) for t in (  # what dequant_rows reads
    QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K, QT.IQ4_XS, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.IQ4_NL,
    QT.MXFP4))


def dequant_rows(raw: torch.Tensor, qtype: int, ids: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Rows `ids` (int64, CPU) of the matrix raw (uint8 [rows, row bytes], CPU, contiguous) of type qtype (one of
    DEQUANT_ROW_TYPES) as float32 [len(ids), n_cols], with the bits of QTensor.dequantize."""
    out = torch.empty(ids.numel(), n_cols)
    ids = ids.contiguous()
    rc = LIB.dequant_rows(qtype, raw.data_ptr(), raw.shape[1], raw.shape[0], ids.data_ptr(),  # type: ignore[union-attr]
                          ids.numel(), n_cols, out.data_ptr())
    _check(rc, f"rows of a type {qtype} matrix of {raw.shape[0]} rows")
    return out


def sketch_make(w: torch.Tensor, qtype: int, n_cols: int, codes: torch.Tensor, scales: torch.Tensor,
                threads: int) -> None:
    """The 2-bit sketch (sketch.c) of the matrix w: float32 rows [n, n_cols] (qtype 0) or uint8 [n, row bytes] of
    stored blocks of a type in DEQUANT_ROW_TYPES (contiguous), into codes uint8 [n, n_cols/4] and scales float32
    [n, n_cols/SKETCH_BLOCK]."""
    n = w.shape[0]
    rc = LIB.sketch_make(qtype, w.data_ptr(), w[0].numel() * w.element_size(), n, n_cols,  # type: ignore[union-attr]
                         codes.data_ptr(), scales.data_ptr(), threads)
    _check(rc, f"the sketch of a type {qtype} matrix of {n} rows")


def masked_argmax(x: torch.Tensor, bits: torch.Tensor, isa: int) -> int:
    """The first maximum of the float32 row x (contiguous, CPU) over the ids the mask `bits` (int32 words, contiguous,
    a bit per id) allows, the first NaN among them if any; -1 where it allows none."""
    n = min(x.numel(), bits.numel() * 32)
    return int(LIB.masked_argmax(x.data_ptr(), bits.data_ptr(), n, isa))  # type: ignore[union-attr]


def mask_row(x: torch.Tensor, bits: torch.Tensor, isa: int) -> None:
    """-inf in place at every id of the float32 row x (contiguous, CPU) the mask `bits` does not allow."""
    LIB.mask_row(x.data_ptr(), bits.data_ptr(), bits.numel() * 32, x.numel(), isa)  # type: ignore[union-attr]


def sketch_scores(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, threads: int, isa: int) -> torch.Tensor:
    """Every sketch row times the float row x [k] (contiguous): float32 [n]."""
    n, k = codes.shape[0], x.numel()
    out = torch.empty(n)
    rc = LIB.sketch_scores(codes.data_ptr(), scales.data_ptr(), n, k, x.data_ptr(), out.data_ptr(),  # type: ignore[union-attr]
                           threads, isa)
    _check(rc, f"a head sketch of {n} rows")
    return out


def sketch_logits(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, head: ExpertStack, m: int, threads: int,
                  isa: int) -> torch.Tensor:
    """A draft's logits of the float row x [k] (contiguous) in one call (sketch.c): every sketch row's score, and the
    groups of head.n_rows rows that hold the m best scores multiplied by the head (`head`: its groups as a stack of
    matrices, expert_stack) instead. float32 [the head's groups × rows a group]: rows past the sketch's score 0."""
    n, k = codes.shape[0], x.numel()
    out = torch.empty(-(-n // head.n_rows) * head.n_rows)
    rc = LIB.sketch_logits(codes.data_ptr(), scales.data_ptr(), n, k, x.data_ptr(), ctypes.byref(head), m,  # type: ignore[union-attr]
                           out.data_ptr(), threads, isa)
    _check(rc, f"the draft logits of a head sketch of {n} rows")
    return out


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """RoPE (NEOX pairing) of x [n, H, D] (float32, contiguous: rotated in place and returned) with cos/sin
    [n, n_rot/2] (contiguous)."""
    n, h, d = x.shape
    LIB.rope_neox(x.data_ptr(), n, h, d, n_rot, cos.data_ptr(), sin.data_ptr())  # type: ignore[union-attr]
    return x


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g ← silu(g) · u in place (float32, contiguous, same shape), as moe.c's passes compute it; returns g."""
    LIB.silu_mul(g.data_ptr(), u.data_ptr(), g.numel())  # type: ignore[union-attr]
    return g


def exp_rows(x: torch.Tensor) -> torch.Tensor:
    """e^x element by element (float32, contiguous), as layer.c computes a GDN layer's decays: a new tensor."""
    y = torch.empty_like(x)
    LIB.exp_rows(x.data_ptr(), x.numel(), y.data_ptr())  # type: ignore[union-attr]
    return y


def silu(x: torch.Tensor) -> torch.Tensor:
    """silu(x) element by element (float32, contiguous; kernels.h silu_f): a new tensor."""
    y = torch.empty_like(x)
    LIB.silu_rows(x.data_ptr(), x.numel(), y.data_ptr())  # type: ignore[union-attr]
    return y


def sigmoid_mul(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x ← x · sigmoid(g) in place (float32, contiguous, same shape; kernels.h sigmoid_f); returns x."""
    LIB.sigmoid_mul(x.data_ptr(), g.data_ptr(), x.numel())  # type: ignore[union-attr]
    return x


def decoder_layer(w: LayerW, p: LayerPass) -> None:
    """engine/native/layer.c decoder_layer: the layer w over the pass p (p.x replaced by the layer's output)."""
    _check(LIB.decoder_layer(ctypes.byref(w), ctypes.byref(p)), "the native layer")  # type: ignore[union-attr]


def decoder_layers(ws: ctypes.Array, ps: ctypes.Array, x: torch.Tensor, pos: int, cos_t: int, sin_t: int,
                   out: StepOut | None = None, inp: StepIn | None = None) -> None:
    """engine/native/layer.c decoder_layers: the layers ws (pointers to LayerW) over their passes ps, in one call; x
    (float32 [n, d], contiguous) replaced by the last layer's output; cos_t/sin_t the addresses of the RoPE rows;
    then `out` (the final norm and head) where given. With `inp`, x's rows are first the embeddings of its ids."""
    failed = ctypes.c_int64(-1)
    rc = LIB.decoder_layers(ws, ps, len(ws), x.data_ptr(), x.shape[0], pos, cos_t, sin_t,  # type: ignore[union-attr]
                            ctypes.byref(inp) if inp is not None else None,
                            ctypes.byref(out) if out is not None else None, ctypes.byref(failed))
    _check(rc, "the embedding table" if failed.value == -1 else f"layer {failed.value}")


def mtp_layers(ws: ctypes.Array, ps: ctypes.Array, x: torch.Tensor, pos: int, cos_t: int, sin_t: int, inp: StepIn,
               mtp: MtpIn, out: StepOut, skip: int = 0) -> None:
    """engine/native/layer.c mtp_layers: decoder_layers for the MTP head, its input rows made from the embeddings of
    inp's ids and mtp's hidden rows first; the outputs of the rows from `skip` on only (the rows before leave their
    keys and values in the cache, and out's rows for them are not written)."""
    failed = ctypes.c_int64(-1)
    rc = LIB.mtp_layers(ws, ps, len(ws), x.data_ptr(), x.shape[0], pos, cos_t, sin_t,  # type: ignore[union-attr]
                        ctypes.byref(inp), ctypes.byref(mtp), ctypes.byref(out), skip, ctypes.byref(failed))
    _check(rc, "the embedding table or the head's input" if failed.value == -1 else f"layer {failed.value}")


def decoder_layers_many(ws: ctypes.Array, ps: ctypes.Array, seqs: ctypes.Array, n_seq: int, x: torch.Tensor,
                        pos: ctypes.Array, cos_t: ctypes.Array, sin_t: ctypes.Array, out: StepOut | None = None,
                        inp: StepIn | None = None) -> None:
    """engine/native/layer.c decoder_layers_many: decoder_layers over the rows of n_seq sequences (x's rows in their
    order): ps the passes for all rows (threads, routing), seqs [layers · n_seq] pointers to each sequence's pass in
    each layer (its state and row count), pos / cos_t / sin_t (int64, addresses) per sequence."""
    failed = ctypes.c_int64(-1)
    rc = LIB.decoder_layers_many(ws, ps, seqs, n_seq, len(ws), x.data_ptr(), x.shape[0],  # type: ignore[union-attr]
                                 pos, cos_t, sin_t, ctypes.byref(inp) if inp is not None else None,
                                 ctypes.byref(out) if out is not None else None, ctypes.byref(failed))
    _check(rc, "the embedding table" if failed.value == -1 else f"layer {failed.value}")


@dataclass(frozen=True)
class TraceSection:
    seconds: float
    marks: int
    weight_bytes: int


def pool_after_call(t0: int, t1: int, t2: int, lost: int) -> int:
    """pool.c's solo-mode rule fed one call's timings (ns: start, the caller's own items done, end; the caller's time
    off its core): when solo mode ends after it, 0 where it is off (tests/test_pool.py)."""
    return int(LIB.pool_after_call(t0, t1, t2, lost))  # type: ignore[union-attr]


def trace_start() -> None:
    """Zero the native layer's section clock and start it (bench/step_profile.py: where a fused step's time goes)."""
    LIB.trace_enable(1)  # type: ignore[union-attr]


def trace_stop() -> dict[str, TraceSection]:
    """Stop the section clock; per section the seconds, marks and weight bytes summed since trace_start. pool_wait
    (callers waiting for other threads' items) lies inside the other sections' time; prefetch counts the ranges
    handed to the pool's workers between products (jobs and bytes, no time)."""
    LIB.trace_enable(0)  # type: ignore[union-attr]
    n = len(TRACE_SECTIONS)
    out = (ctypes.c_int64 * (3 * n))()
    if LIB.trace_read(out) != n:  # type: ignore[union-attr]
        raise RuntimeError("native library and engine.ops.native disagree on the trace sections")
    return {name: TraceSection(out[i] / 1e9, out[n + i], out[2 * n + i]) for i, name in enumerate(TRACE_SECTIONS)}
