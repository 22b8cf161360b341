"""Typed failures of a remote engine: each names the server and what the user can do about it."""
from __future__ import annotations

from engine.errors import EngineError


class RemoteError(EngineError):
    """A remote OpenAI-compatible server could not be used."""


class RemoteUnreachableError(RemoteError):
    """No connection: the host name does not resolve, the host does not answer, or the port refuses."""


class RemoteAuthError(RemoteError):
    """The server refused the API key (401/403)."""


class RemoteModelError(RemoteError):
    """The server does not serve the model asked for."""


class RemoteTimeoutError(RemoteError):
    """The server accepted the connection but sent nothing for longer than the read timeout."""


class RemoteProtocolError(RemoteError):
    """The server answered with an error status, or with something that is not the OpenAI shape."""
