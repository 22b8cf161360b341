"""Remote engines: OpenAI-compatible servers behind the engine event API (see engine.remote.engine)."""
from __future__ import annotations

from engine.remote.engine import RemoteConfig, RemoteEngine, connect, list_models
from engine.remote.errors import (RemoteAuthError, RemoteError, RemoteModelError, RemoteProtocolError,
                                  RemoteTimeoutError, RemoteUnreachableError)

__all__ = ["RemoteAuthError", "RemoteConfig", "RemoteEngine", "RemoteError", "RemoteModelError",
           "RemoteProtocolError", "RemoteTimeoutError", "RemoteUnreachableError", "connect", "list_models"]
