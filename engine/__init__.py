"""Foretell inference engine: GGUF Qwen3.5/3.6 models on CPU (and CUDA), no Qt."""
from __future__ import annotations

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
