"""The border between the native library and engine/ops/native.py (engine/native/border.c): the ctypes mirrors of the
library's structures match the built library field by field, a wrong mirror is refused with the structure and field
named, every failure code the library returns maps to one exception, and the limits Python reads are the ones the
kernels enforce."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from engine.ops import native

_P, _I, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


def test_the_mirrors_match_the_built_library() -> None:
    """Every structure the library describes is mirrored, and every mirror agrees with it; so do the failure codes."""
    assert native.available()
    described = {name for name, (_, size) in native.BORDER.items() if "." not in name and size}
    assert described == {m.__name__ for m in native.MIRRORS}
    for mirror in native.MIRRORS:
        native.check_mirror(mirror, native.BORDER)
    native.check_codes(native.BORDER)


def test_a_mirror_with_a_wrong_size_is_refused() -> None:
    class ExpertStack(ctypes.Structure):  # code as int64: 8 bytes more
        _fields_ = [("w", _P), ("expert_bytes", _I), ("n_rows", _I), ("k", _I), ("code", _I), ("threads", _I32)]

    with pytest.raises(native.LayoutError, match=r"ExpertStack: 40 bytes in the native library, 48 in its mirror"):
        native.check_mirror(ExpertStack, native.BORDER)


def test_a_mirror_with_fields_swapped_or_resized_is_refused_naming_the_field() -> None:
    class ExpertStack(ctypes.Structure):  # the same size, threads before code
        _fields_ = [("w", _P), ("expert_bytes", _I), ("n_rows", _I), ("k", _I), ("threads", _I32), ("code", _I32)]

    class StepIn(ctypes.Structure):  # qtype as int64 over qtype and pad: the same size
        _fields_ = [("table", _P), ("row_bytes", _I), ("n_rows", _I), ("ids", _P), ("qtype", _I)]

    assert ctypes.sizeof(ExpertStack) == native.BORDER["ExpertStack"][1]
    assert ctypes.sizeof(StepIn) == native.BORDER["StepIn"][1]
    with pytest.raises(native.LayoutError, match=r"ExpertStack\.threads: at 36, 4 bytes in the native library; at 32"):
        native.check_mirror(ExpertStack, native.BORDER)
    with pytest.raises(native.LayoutError, match=r"StepIn\.qtype: at 32, 4 bytes in the native library; at 32, 8"):
        native.check_mirror(StepIn, native.BORDER)


def test_a_mirror_missing_a_field_or_with_one_too_many_is_refused() -> None:
    class StepIn(ctypes.Structure):  # no pad: the same size (alignment), one field short
        _fields_ = [("table", _P), ("row_bytes", _I), ("n_rows", _I), ("ids", _P), ("qtype", _I32)]

    class StepOut(ctypes.Structure):  # eps renamed: a field the library does not have
        _fields_ = [("norm", _P), ("epsilon", ctypes.c_float), ("head", _P), ("h", _P), ("logits", _P)]

    class Nothing(ctypes.Structure):
        _fields_ = [("x", _P)]

    with pytest.raises(native.LayoutError, match=r"StepIn\.pad: a field of the native library's StepIn that"):
        native.check_mirror(StepIn, native.BORDER)
    with pytest.raises(native.LayoutError, match=r"StepOut\.epsilon: the native library's StepOut has no such field"):
        native.check_mirror(StepOut, native.BORDER)
    with pytest.raises(native.LayoutError, match="no structure Nothing"):
        native.check_mirror(Nothing, native.BORDER)


def test_failure_codes_are_one_table() -> None:
    """Distinct negative codes, each named on both sides; a code only one side knows is refused."""
    codes = [value for name, (value, _) in native.BORDER.items() if name.startswith("RC_")]
    assert len(set(codes)) == len(codes) and all(c < 0 for c in codes)
    with pytest.raises(native.LayoutError, match="RC_NEW: a failure code only the native library knows"):
        native.check_codes({**native.BORDER, "RC_NEW": (min(codes) - 1, 0)})
    fewer = {name: entry for name, entry in native.BORDER.items() if name != "RC_MAX_DV"}
    with pytest.raises(native.LayoutError, match=r"RC_MAX_DV: a failure code only engine\.ops\.native knows"):
        native.check_codes(fewer)


def test_the_router_takes_max_experts_and_refuses_more() -> None:
    """MAX_EXPERTS, read from the library, is the limit moe_route enforces; over it, RC_MAX_EXPERTS's exception."""
    x = torch.randn(1, 8)
    logits, _, idx, _ = native.moe_route(torch.randn(native.MAX_EXPERTS, 8), None, x, 2, 1)
    assert logits.shape == (1, native.MAX_EXPERTS) and idx.shape == (1, 2)
    with pytest.raises(ValueError, match=rf"router \({native.MAX_EXPERTS + 1} experts, top 2\): more experts than the "
                                         rf"native router takes \({native.MAX_EXPERTS}\)"):
        native.moe_route(torch.randn(native.MAX_EXPERTS + 1, 8), None, x, 2, 1)


@pytest.mark.parametrize("n_expert,d", [(64, 1024), (7, 1000)])
def test_router_logits_are_each_tokens_own_eight_lane_sums(n_expert: int, d: int) -> None:
    """moe.c's router products (four at a time, an item's tokens sharing its rows): every token's logits, in a pass of
    any size and on any threads, are the 8-lane float32 sums (lane i % 8, multiply then add, lanes summed pairwise)
    of that token alone; so is the shared expert's gate."""
    g = torch.Generator().manual_seed(7)
    router, x = torch.randn(n_expert, d, generator=g), torch.randn(33, d, generator=g)
    a, b = router.numpy(), x.numpy()
    acc = np.zeros((33, n_expert, 8), dtype=np.float32)
    whole = d - d % 8
    for i in range(0, whole, 8):
        acc += b[:, None, i:i + 8] * a[None, :, i:i + 8]
    for i in range(whole, d):
        acc[:, :, i % 8] += b[:, None, i] * a[None, :, i]
    want = ((acc[..., 0] + acc[..., 1]) + (acc[..., 2] + acc[..., 3])) + \
        ((acc[..., 4] + acc[..., 5]) + (acc[..., 6] + acc[..., 7]))
    shared = torch.randn(d, generator=g)
    alone = torch.cat([native.moe_route(router, shared, x[t:t + 1].contiguous(), 2, 1)[3] for t in range(33)])
    for n in (1, 3, 4, 5, 16, 17, 33):
        for threads in (1, 2):
            logits, _, _, gate = native.moe_route(router, shared, x[:n].contiguous(), 2, threads)
            assert np.array_equal(logits.numpy(), want[:n]), (n, threads)
            assert torch.equal(gate, alone[:n]), (n, threads)  # the shared expert's gate: each token's own



@pytest.mark.parametrize("n_expert,k", [(16, 4), (64, 8), (256, 8), (9, 1)])
def test_routing_takes_the_k_best_probabilities_lower_expert_first_on_a_tie(n_expert: int, k: int) -> None:
    """moe.c's top-k against a plain sort: softmax (float32 terms, their sum in double) of each token's logits, the k
    largest probabilities in descending order with the lower expert first among equals, divided by their sum (in
    double; expf against numpy's exp: to float rounding). Router rows repeated make exact ties, at the cut too."""
    g = torch.Generator().manual_seed(11)
    router = torch.randn(n_expert, 16, generator=g)
    router[1::3] = router[0]  # every third row from 1 on equals row 0: equal logits
    router[n_expert // 2] = router[n_expert // 2 - 1]
    x = torch.randn(20, 16, generator=g)
    logits, wts, idx, _ = native.moe_route(router, None, x, k, 1)
    for t in range(20):
        lg = logits[t].numpy()
        e = np.exp(lg - lg.max()).astype(np.float32)
        p = e * np.float32(1.0 / e.astype(np.float64).sum())
        order = sorted(range(n_expert), key=lambda i: (-p[i], i))[:k]
        assert idx[t].tolist() == order, t
        top = p[order]
        assert np.allclose(wts[t].numpy(), top / np.float32(top.astype(np.float64).sum()), rtol=1e-5, atol=0), t

def test_the_recurrence_takes_max_dv_and_refuses_more() -> None:
    """MAX_DV, read from the library, is the widest value head gdn_recurrence takes; wider, RC_MAX_DV's exception."""
    q, k, beta, decay = torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.rand(1, 1), torch.rand(1, 1)

    def run(dv: int) -> torch.Tensor:
        s = torch.zeros(1, 4, dv)
        return native.gdn_recurrence(q, k, torch.randn(1, 1, dv), beta, decay, s, s, 1, 0)

    assert run(native.MAX_DV).shape == (1, 1, native.MAX_DV)
    with pytest.raises(ValueError, match=rf"GDN value heads wider than the native kernel takes \({native.MAX_DV}\)"):
        run(native.MAX_DV + 1)


def test_dequant_rows_failures_raise_their_codes_exceptions() -> None:
    raw = torch.zeros(4, 34, dtype=torch.uint8)  # 4 Q8_0 rows of 32 values
    with pytest.raises(IndexError, match="of 4 rows: a row id out of range"):
        native.dequant_rows(raw, 8, torch.tensor([4]), 32)
    with pytest.raises(ValueError, match="a table type dequant_rows does not read"):
        native.dequant_rows(raw, 16, torch.tensor([0]), 32)  # IQ2_XXS: no row form


def test_the_instruction_set_levels_are_the_library_s() -> None:
    """engine.ops.backend's ISA_LEVEL (what each native backend asks for) is kernels.h's ISA_* numbering, in its order."""
    from engine.ops.backend import ISA_LEVEL, NATIVE_ISAS

    names = {"portable": "ISA_PORTABLE", "avx2": "ISA_AVX2", "avxvnni": "ISA_AVXVNNI", "avx512": "ISA_AVX512",
             "avx512vnni": "ISA_VNNI"}
    assert set(names) == set(NATIVE_ISAS) == set(ISA_LEVEL)
    assert {isa: native.BORDER[c][0] for isa, c in names.items()} == ISA_LEVEL
