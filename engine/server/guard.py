"""What a request must be before its body is read: a POST's body is JSON (`application/json`, UTF-8), sent as is
(no Content-Encoding: nothing here decompresses), and no request comes from a web page that is not allowed.

Why: any page the user visits can make the browser send a "simple" request (text/plain or a form, no
preflight) to a server on 127.0.0.1. Taking only JSON makes a browser ask first (a CORS preflight), which fails
unless `--cors` allows the page; refusing an `Origin` that is not allowed, and what the browser marks
`Sec-Fetch-Site: cross-site`, stops the rest. Programs (SDKs, curl) send neither header and are not affected.
"""
from __future__ import annotations

from typing import Mapping

from engine.server.protocol import APIError

JSON = "application/json"
_UTF8 = ("utf-8", "utf8")
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_SAME_SITE = (None, "none", "same-origin")  # no header (not a browser), typed by the user, the server's own page


def allowed_origins(cors_origins: tuple[str, ...], port: int) -> frozenset[str]:
    """The `--cors` origins and the server's own local addresses (http://127.0.0.1:PORT, http://localhost:PORT)."""
    return frozenset(cors_origins) | {f"http://{host}:{port}" for host in _LOCAL_HOSTS}


def check_origin(headers: Mapping[str, str], allowed: frozenset[str]) -> None:
    """403 for a browser request from a page whose origin is not allowed."""
    origin = headers.get("origin")
    if origin is not None:
        if origin not in allowed:
            raise APIError(403, f"requests from web pages at {origin[:100]} are not allowed; start the server with "
                           "--cors ORIGIN to allow an origin", code="origin_not_allowed")
        return
    if headers.get("sec-fetch-site") not in _SAME_SITE:
        raise APIError(403, "requests from another site's web pages are not allowed; start the server with "
                       "--cors ORIGIN to allow an origin", code="origin_not_allowed")


def check_json_body(headers: Mapping[str, str]) -> None:
    """415 unless the body is declared `application/json` (charset UTF-8 if one is named) and not encoded."""
    media, _, params = headers.get("content-type", "").partition(";")
    if media.strip().lower() != JSON:
        raise APIError(415, f"send the body as 'Content-Type: {JSON}', not {media.strip()[:100]!r}",
                       code="unsupported_media_type")
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in _UTF8:
            raise APIError(415, f"JSON bodies are UTF-8, not {value.strip()[:40]!r}", code="unsupported_media_type")
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"send the body uncompressed: Content-Encoding {encoding[:40]!r} is not decoded here",
                       code="unsupported_media_type")
