"""Foretell inference engine: GGUF Qwen3.5/3.6 models on CPU (and CUDA), no Qt."""
from __future__ import annotations

import os
import sys

# The kernels run in their own thread pool (engine/native/pool.c); torch's OpenMP threads, after any torch op that
# ran in parallel, spin for a while by default, and on a 2-core desktop a spinning torch thread takes the core a pool
# worker needs (bench/step_profile.py, mid fixture: decode step median 16.6 -> 12.3 ms, time spent waiting for a core
# 18% -> 0%). libgomp reads the policy once, when torch loads it; the variable is removed again so that processes
# started from here (llama.cpp in the benchmarks) get the environment they were given. A policy set by the user stays.
if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["OMP_WAIT_POLICY"]

from engine.errors import (
    ChatTemplateError,
    ContextOverflowError,
    EngineError,
    ModelFormatError,
    OutOfMemoryError,
    TokenizerError,
    UnsupportedModelError,
)

__all__ = [
    "ChatTemplateError",
    "ContextOverflowError",
    "EngineError",
    "ModelFormatError",
    "OutOfMemoryError",
    "TokenizerError",
    "UnsupportedModelError",
]
