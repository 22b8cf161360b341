"""Test-wide set-up. Qt runs offscreen: the variable must exist before any QApplication. Without a CUDA GPU the
Triton kernels (engine.ops.triton_q) run in Triton's interpreter on CPU tensors: the variable must exist before
they are defined. The user's cache folder (where the CLI and the app keep auto draft depth's memory of each model)
is a fresh one for the session, so no test starts from what an earlier run learned."""
from __future__ import annotations

import os
import tempfile

import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="foretell-test-cache-")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def backend_params(native_only: bool = False, simd_only: bool = False, simd_from: str = "avx512") -> list:
    """pytest params over the engine backends this machine runs (engine.ops.available_backends), ids by name.
    simd_only: the native backends whose float kernels have register forms — from `simd_from` up (AVX512: attention
    and the delta rule; AVX2: the delta rule). A selection this CPU has none of becomes one param skipped with the
    reason."""
    import pytest

    from engine import ops
    from engine.ops.backend import ISA_LEVEL

    bs = [b for b in ops.available_backends()
          if (b.native or not native_only) and not (simd_only and b.level < ISA_LEVEL[simd_from])]
    if not bs:
        why = f"this CPU has no {simd_from}: the float kernels' register forms do not run here" if simd_only \
            else "the native library is not built"
        return [pytest.param(None, marks=pytest.mark.skip(reason=why), id="none")]
    return [pytest.param(b, id=b.name) for b in bs]
