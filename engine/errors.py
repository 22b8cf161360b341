"""Typed engine errors: every failure a user can hit carries a message they can act on."""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelFormatError(EngineError):
    """The file is not a valid GGUF, is truncated, or holds a tensor/key of the wrong shape or type."""


class NonFiniteLogitsError(ModelFormatError):
    """A pass's logits were not finite (NaN or infinite): what damaged weights that still load give. The sampler
    raises it without a file name; the engine names the file and, where it can tell, the first layer that went
    non-finite."""


class UnsupportedModelError(EngineError):
    """A valid GGUF whose architecture, quant type or feature this engine does not run."""


class TokenizerError(EngineError):
    """The GGUF's tokenizer metadata is missing or inconsistent."""


class ChatTemplateError(EngineError):
    """The chat template failed to render (syntax error, forbidden operation, bad message list)."""


class OutOfMemoryError(EngineError):
    """A requested allocation (context, cache, weights on a device) does not fit."""


class ContextOverflowError(EngineError):
    """The prompt alone does not fit into the context window."""


class EngineBusyError(EngineError):
    """The engine is already generating (another thread, or another unfinished generator of this engine)."""


class InvalidParameterError(EngineError, ValueError):
    """A generation or engine parameter is out of range or of the wrong kind (the message names it)."""


class LoadCancelled(EngineError):
    """Loading a model was cancelled by the caller (nothing of it is kept)."""
