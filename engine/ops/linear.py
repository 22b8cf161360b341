"""Projections: a weight bound to the product that multiplies by it, chosen once when the model is built.

Every product is batch-invariant: row i of a multi-token pass gets exactly the bits of a one-token pass, which
speculative verify and prefill rely on to be token-identical to plain decoding. The kinds of product:
  - NativeLinear: the native products (native.PRODUCT_TYPES: K-quants, IQ4_XS, the 32-value legacy types, MXFP4,
    F16/BF16; activations quantized or rounded as llama.cpp does, exact integer block sums, each output's float work
    in a fixed order whatever the rows or threads); the K-quants, Q8_0, IQ4_XS and the 32-value nibble types (Q4_0,
    Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) packed 16 rows interleaved on first use where the backend packs;
  - TritonLinear: Q4_K/Q5_K/Q6_K/Q8_0/IQ4_XS on CUDA in engine.ops.triton_q's kernels over the stored blocks
    (float32 activations): up to GEMV_ROWS rows a GEMV whose rows are independent programs, more rows (prefill
    chunks) as bfloat16 tiles of the weight fed to torch.matmul;
  - Int8Linear: Q8_0 in torch integer GEMMs (the torch backend; exact block sums, the same float epilogue);
  - DequantLinear: any stored type dequantized one tile of rows at a time, x rounded as llama.cpp rounds it, one
    independent [1, in] × [in, out] product per row (a plain mm picks kernels by N: rows of a 4-row mm differ
    from the 1-row result in the last bits);
  - FloatLinear: a float parameter being trained (plain F.linear: differentiable, not batch-invariant).
Derived forms of a weight (packed bytes, int8 planes, stacks of several weights) are kept by the Linear that
made them, never by the stored tensor.
"""
from __future__ import annotations

import math
import time

import torch
from gguf import GGMLQuantizationType as QT

from engine.ops import indices, native, torch_int8
from engine.ops.activations import act_format, quantize, round_for
from engine.ops.backend import ISA_LEVEL, Backend, OpEvent
from engine.ops.elementwise import silu_mul
from engine.storage.pages import huge_empty, release_pages
from engine.storage.qtensor import TILE_ELEMENTS, QTensor

Weight = QTensor | torch.Tensor  # a GGUF tensor, or a float parameter while training

# Weights stacked for `linear_many` up to this many bytes in all: the stacked copy is new memory, and on larger
# weights a product's call overhead is a negligible share of its arithmetic.
FUSE_MAX_BYTES = 16 << 20


class Linear:
    """A weight and the kernel that multiplies by it: y = x @ W.T for x [..., in] and W [out, in]."""

    kind = ""

    def __init__(self, weight: Weight, backend: Backend):
        self.weight = weight
        self.backend = backend
        self.stacks: dict[tuple[int, ...], Linear | None] = {}  # linear_many: this and other weights stacked
        self.forms: dict[object, torch.Tensor] = {}  # other kernels' forms of this weight (with others'), by use

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def n_cols(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        w = self.weight
        return w.nbytes if isinstance(w, QTensor) else w.numel() * w.element_size()

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.weight!r}, {self.backend.name})"


PACK_CHUNK_BYTES = 64 << 20  # stored bytes packed, and their file pages dropped, at a time (NativeLinear.pack)


class NativeLinear(Linear):
    kind = "native"

    def __init__(self, weight: QTensor, backend: Backend):
        super().__init__(weight, backend)
        self.fmt = act_format(weight.qtype.name)
        self.packed: torch.Tensor | None = None
        self.packed_full: torch.Tensor | None = None  # packed, with the zero rows of a last partial group

    def pack(self, chunk_bytes: int = PACK_CHUNK_BYTES) -> None:
        """Interleave the weight's blocks 16 rows at a time for the packed products (the same bytes in number, Q6_K with
        1 % of padding), for the products to read instead of the stored ones. A matrix whose rows are not whole groups
        of 16 (a 50,259-token output head) ends in a group padded with zero rows: `packed` is a view of its real rows'
        bytes, `packed_full` the whole (the products read the last group whole and keep its real rows' outputs); an
        expert stack is packed only where each expert's rows are whole groups. Where the stored bytes are a view of the
        model file their resident pages are dropped (engine.storage.pages.release_pages) as each chunk of about
        chunk_bytes is packed: the file keeps them, and other readers (an embedding lookup, a copy to an
        accelerator) still find them there."""
        w = self.weight
        if self.packed is not None or not self.backend.packs or w.qtype not in native.PACKED_CODE \
                or len(w.shape) < 2 or (w.shape[-2] % native.GROUP and len(w.shape) != 2):
            return
        raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
        nb = w.n_cols // (native.QK_K if self.fmt == "Q8_K" else native.QK_8_0)
        n, whole = w.n_rows, w.n_rows // native.GROUP
        groups = -(-n // native.GROUP)
        packed = huge_empty(native.packed_bytes(w.qtype, groups * native.GROUP, nb))  # streamed every step: huge pages
        # Chunk by chunk, each chunk's file pages dropped as soon as it is packed: packing a big matrix whole held
        # both copies at once (a 9B model's 0.8 GB output head raised the peak RSS by as much).
        flat = raw.reshape(-1)
        src_g, dst_g = flat.numel() // n * native.GROUP, packed.numel() // groups  # one 16-row group, each layout
        per = max(1, chunk_bytes // src_g)
        for g0 in range(0, whole, per):
            g1 = min(whole, g0 + per)
            src = flat[g0 * src_g:g1 * src_g]
            native.repack(w.qtype, src, (g1 - g0) * native.GROUP, nb, packed[g0 * dst_g:g1 * dst_g],
                          torch.get_num_threads())
            release_pages(src)
        if whole < groups:  # the last rows, with zero rows (zero scales: zero values) to a whole group
            tail = torch.zeros(src_g, dtype=torch.uint8)
            tail[:flat.numel() - whole * src_g] = flat[whole * src_g:]
            native.repack(w.qtype, tail, native.GROUP, nb, packed[whole * dst_g:], 1)
        self.packed_full = packed
        self.packed = packed[:native.packed_bytes(w.qtype, n, nb)]
        release_pages(w.raw)

    def kernel_bytes(self) -> tuple[torch.Tensor, int]:
        """The bytes the products read and their kernel type code: packed where the backend packs and the weight
        does (made on first use), else the stored blocks."""
        self.pack()
        if self.packed is not None:
            return self.packed, native.PACKED_CODE[self.weight.qtype]
        raw = self.weight.raw
        return (raw if raw.is_contiguous() else raw.contiguous()), int(self.weight.qtype)

    def perm(self, xr, code: int) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
        """Q8_K quants in Q4_K value order, for the AVX512 stored-order Q4_K product."""
        avx512 = self.backend.level >= ISA_LEVEL["avx512"] and native.cpu_avx512()
        return xr.q4k_order() if code == QT.Q4_K and avx512 else None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.backend
        xr = quantize(x, self.fmt, on_native=True, level=b.level)
        n_out = w.n_rows
        raw, code = self.kernel_bytes()
        y = torch.empty(xr.rows, n_out)
        native.matmul(code, raw, n_out, xr.q, xr.d, xr.bsums, xr.s, self.perm(xr, code), w.n_cols, y,
                      b.n_threads(n_out * w.n_cols), b.level)
        return y.reshape(*x.shape[:-1], n_out)


# TritonLinear: passes of up to this many rows run the batch-invariant GEMV: every decode step and verify pass (up to
# MAX_DRAFT + 1 = 9 rows: a verify at depth 8 in bfloat16 would not have a decode step's bits)
GEMV_ROWS = 16
BF16_TILE_ELEMENTS = 1 << 24  # TritonLinear, longer passes: weight values dequantized to bfloat16 at a time


class TritonLinear(Linear):
    kind = "triton"

    def product(self, x: torch.Tensor) -> torch.Tensor:
        from engine.ops import triton_q

        w: QTensor = self.weight  # type: ignore[assignment]
        k, n_out = w.n_cols, w.n_rows
        x2 = x.reshape(-1, k)
        n = x2.shape[0]
        raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
        if n <= GEMV_ROWS:
            y = triton_q.gemv_pairs(raw, w.qtype, n_out, k, x2, indices.zeros(n, x2.device), indices.arange(n, x2.device))
            return y.reshape(*x.shape[:-1], n_out)
        step = tile_rows(w, BF16_TILE_ELEMENTS)  # fixed by the weight alone: results do not depend on the tiling
        rows = raw.reshape(n_out, -1)
        xb = x2.to(torch.bfloat16)
        y = torch.empty(n, n_out, dtype=torch.float32, device=x2.device)
        for r0 in range(0, n_out, step):
            r1 = min(n_out, r0 + step)
            y[:, r0:r1] = torch.matmul(xb, triton_q.dequantize_bf16(rows[r0:r1], w.qtype, r1 - r0, k).T).float()
        return y.reshape(*x.shape[:-1], n_out)

    def glu(self, up: "TritonLinear", x: torch.Tensor) -> torch.Tensor | None:
        """silu(self x) ⊙ (up x) in one launch where both are GEMV passes over weights of one type and shape (each
        product with gemv_pairs' bits); else None."""
        g, u = self.weight, up.weight
        x2 = x.reshape(-1, g.n_cols)  # type: ignore[union-attr]
        n = x2.shape[0]
        if n > GEMV_ROWS or g.qtype != u.qtype or g.shape != u.shape or not (  # type: ignore[union-attr]
                g.raw.is_contiguous() and u.raw.is_contiguous()):  # type: ignore[union-attr]
            return None
        from engine.ops import triton_q

        y = triton_q.gemv_glu_pairs(g.raw, u.raw, g.qtype, g.n_rows, g.n_cols, x2,  # type: ignore[union-attr]
                                    indices.zeros(n, x2.device), indices.arange(n, x2.device))
        return y.reshape(*x.shape[:-1], g.n_rows)  # type: ignore[union-attr]


class Int8Linear(Linear):
    kind = "int8"

    def __init__(self, weight: QTensor, backend: Backend):
        super().__init__(weight, backend)
        self._planes: torch_int8.Planes | None = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self._planes is None:  # the int8 copy of the quants (1 byte per weight), made once
            self._planes = torch_int8.planes(self.weight)  # type: ignore[arg-type]
        return torch_int8.matmul(x, self._planes, self.backend.int8)


def _rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in], w [out, in] float32 → [N, out], one independent product per row."""
    n = x.shape[0]
    return torch.bmm(x.unsqueeze(1), w.t().unsqueeze(0).expand(n, -1, -1)).squeeze(1)


def tile_rows(w: QTensor, tile_elements: int = TILE_ELEMENTS) -> int:
    """Rows per dequantized tile: fixed per weight (never by N), so tiling cannot change results."""
    return max(1, min(w.n_rows, tile_elements // max(w.n_cols, 1)))


class DequantLinear(Linear):
    kind = "dequant"

    def __init__(self, weight: QTensor, backend: Backend, tile_elements: int = TILE_ELEMENTS):
        super().__init__(weight, backend)
        self.tile_elements = tile_elements  # values dequantized at a time (bench/quant.py's tile sweep)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        w: QTensor = self.weight  # type: ignore[assignment]
        k, n_out = w.n_cols, w.n_rows
        x2 = round_for(x, w.qtype.name).reshape(-1, k)
        if w.qtype == QT.F32 and w.raw.device == x2.device:
            return _rowwise(x2, w.raw.view(torch.float32).view(n_out, k)).reshape(*x.shape[:-1], n_out)
        step = tile_rows(w, self.tile_elements)
        if step >= n_out:
            return _rowwise(x2, w.dequantize(slice(0, n_out), device=x2.device)).reshape(*x.shape[:-1], n_out)
        y = torch.empty(x2.shape[0], n_out, dtype=torch.float32, device=x2.device)
        for r0 in range(0, n_out, step):
            r1 = min(n_out, r0 + step)
            y[:, r0:r1] = _rowwise(x2, w.dequantize(slice(r0, r1), device=x2.device))
        return y.reshape(*x.shape[:-1], n_out)


class FloatLinear(Linear):
    kind = "float"

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)  # type: ignore[arg-type]


def bind(w: Weight, backend: Backend) -> Linear:
    """The weight with the product `backend` runs it in on the weight's device."""
    if isinstance(w, torch.Tensor):
        return FloatLinear(w, backend)
    b = backend.on(w.device)
    if b.native and native.binds(w.qtype, w.n_cols):
        return NativeLinear(w, b)
    if b.kind == "triton":
        from engine.ops import triton_q

        if triton_q.binds(w.qtype, w.n_cols):
            return TritonLinear(w, b)
    if w.raw.device.type == "cpu" and torch_int8.usable(w, b.int8):
        return Int8Linear(w, b)
    return DequantLinear(w, b)


def _observed(w: Linear, op: str, nbytes: int, x: torch.Tensor, run):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    y = run()
    w.backend.observer(OpEvent(op, nbytes, x.reshape(-1, x.shape[-1]).shape[0], time.perf_counter() - t0))  # type: ignore[misc]
    return y


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    """y = x @ W.T."""
    if x.shape[-1] != w.n_cols:
        raise ValueError(f"x has {x.shape[-1]} features, weight {w.shape} expects {w.n_cols}")
    xf = x if w.kind == "float" else x.float()  # x itself when already float32, so the activation memo knows it
    if w.backend.observer is None:
        return w.product(xf)
    return _observed(w, "linear", w.nbytes, x, lambda: w.product(xf))


def linear_many(x: torch.Tensor, ws: tuple[Linear, ...]) -> list[torch.Tensor]:
    """Several weights applied to the same x: one product over their rows stacked when they are small, of one
    quantized type and width on the integer paths (each product's calls cost more than its arithmetic on small
    models; rows are independent, so the bits are those of separate products). The stack is made on first use
    and kept with the first weight (the set belongs to one layer, so it lives and dies with it); where the parts
    are views of the model file, their resident pages are dropped once copied."""
    first = ws[0]
    stacked = stack_of(ws)
    if stacked is None:
        return [linear(x, w) for w in ws]
    xf = x.float()
    if first.backend.observer is None:
        y = stacked.product(xf)
    else:
        y = _observed(first, "linear_many", sum(w.nbytes for w in ws), x, lambda: stacked.product(xf))
    return list(torch.split(y, [w.n_rows for w in ws], dim=-1))


def swiglu(x: torch.Tensor, gate: Linear, up: Linear) -> torch.Tensor:
    """silu(gate x) ⊙ (up x), a feed-forward's first half: one fused launch on the Triton GEMV (TritonLinear.glu),
    else the two products (`linear_many`) and `silu_mul`."""
    if isinstance(gate, TritonLinear) and isinstance(up, TritonLinear) and gate.backend.observer is None:
        h = gate.glu(up, x)
        if h is not None:
            return h
    g, u = linear_many(x, (gate, up))
    return silu_mul(g, u, gate.backend)


def stack_of(ws: tuple[Linear, ...]) -> Linear | None:
    """The weights stacked into one product (made on first use, kept with the first), or None where linear_many runs
    them apart."""
    key = tuple(id(w) for w in ws[1:])
    first = ws[0]
    if key not in first.stacks:
        first.stacks[key] = _stack(ws)
    return first.stacks[key]


def _stack(ws: tuple[Linear, ...]) -> Linear | None:
    kinds = {type(w) for w in ws}
    if len(ws) < 2 or len(kinds) != 1 or ws[0].kind not in ("native", "int8") or not ws[0].backend.copies \
            or len({(w.weight.qtype, w.n_cols) for w in ws}) != 1 or sum(w.nbytes for w in ws) > FUSE_MAX_BYTES:  # type: ignore[union-attr]
        return None
    parts: list[QTensor] = [w.weight for w in ws]  # type: ignore[misc]
    raw = torch.cat([p.raw.reshape(p.n_rows, -1) for p in parts])
    for p in parts:  # the products read the stack: the parts' file pages it was copied from can go
        release_pages(p.raw)
    return type(ws[0])(QTensor(raw, parts[0].qtype, (raw.shape[0], parts[0].n_cols)), ws[0].backend)


def native_rows(w: Linear | Weight) -> QTensor | None:
    """The table whose rows dequant_rows (engine/native/kquant.c) reads, or None: a 2-D CPU matrix of a type it
    reads, with the bits of QTensor.dequantize."""
    t = w.weight if isinstance(w, Linear) else w
    if isinstance(t, QTensor) and int(t.qtype) in native.DEQUANT_ROW_TYPES and native.available() and t.raw.is_cpu \
            and t.raw.dim() == 2 and t.raw.is_contiguous() and len(t.shape) == 2:
        return t
    return None


def embedding(w: Linear | Weight, ids: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Rows `ids` of w (token embeddings) as float32, without touching the rest of the tensor."""
    t = w.weight if isinstance(w, Linear) else w
    if isinstance(t, torch.Tensor):
        return torch.nn.functional.embedding(ids.reshape(-1).to(t.device), t)
    idx = ids.reshape(-1).to(t.raw.device)
    if idx.dtype == torch.long and native_rows(t) is not None:
        # natively: a step's one row in microseconds, where the torch form's ~20 small ops cost a decode step ~0.3 ms
        rows = native.dequant_rows(t.raw, int(t.qtype), idx, t.n_cols)
        return rows if device is None else rows.to(device)
    return QTensor(t.raw[idx], t.qtype, (idx.numel(), t.n_cols)).dequantize(device=device)
