"""The wire under a remote engine: JSON GETs, a streamed POST read as server-sent events, and every transport
failure turned into one typed `RemoteError` with a message a user can act on.

The standard library's `http.client`, not a client package: the engine API is a plain iterator consumed on a
worker thread, so one blocking connection per request with a connect timeout, a read timeout and a socket that
another thread can shut down (stop) is the whole need — and the frozen app stays free of an HTTP stack.
"""
from __future__ import annotations

import errno
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from engine.remote.errors import (RemoteAuthError, RemoteError, RemoteModelError, RemoteProtocolError,
                                  RemoteTimeoutError, RemoteUnreachableError)

MAX_BODY = 16 * 2**20  # a JSON answer (model list, /metrics) larger than this is not what we asked for


class Reply:
    """One open response: its status, and its body read whole, or line by line while streaming."""

    def __init__(self, wire: "Wire", conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self.wire, self.conn, self.resp = wire, conn, resp
        self.status = resp.status

    def body(self) -> bytes:
        try:
            return self.resp.read(MAX_BODY)
        except (OSError, http.client.HTTPException) as e:
            raise self.wire.failure(e, reading=True) from None
        finally:
            self.close()

    def lines(self) -> Iterator[bytes]:
        """Lines of a streamed body until it ends; a read failure (timeout, cut) raises a RemoteError."""
        while True:
            try:
                line = self.resp.readline(MAX_BODY)
            except (OSError, http.client.HTTPException) as e:
                raise self.wire.failure(e, reading=True) from None
            if not line:
                return
            yield line

    def shutdown(self) -> None:
        """From another thread: wake a blocked read now (closing alone does not interrupt a recv)."""
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.conn.close()


class Wire:
    """One server: its base URL (…/v1), key and timeouts. A connection per request: requests are seconds
    apart and a long-lived one would only add its own failure modes."""

    def __init__(self, base_url: str, api_key: str | None, connect_timeout_s: float, read_timeout_s: float):
        self.base = normalize_url(base_url)
        parts = urlsplit(self.base)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.path = parts.path  # …/v1; /metrics and /server_info live beside it
        self.api_key = api_key or None
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.where = parts.netloc

    def get_json(self, path: str, *, root: bool = False) -> Any:
        r = self.send("GET", path, root=root)
        data = r.body()
        if r.status >= 400:
            raise status_error(r.status, data, self.where)
        try:
            return json.loads(data)
        except ValueError:
            raise RemoteProtocolError(f"{self.where}{path} did not answer JSON (is this an OpenAI-compatible "
                                      "server?)") from None

    def get_text(self, path: str, *, root: bool = False) -> str | None:
        """The body of an optional endpoint (/metrics): None when the server does not have it or fails."""
        try:
            r = self.send("GET", path, root=root)
            data = r.body()
        except RemoteError:
            return None
        return data.decode("utf-8", "replace") if r.status == 200 else None

    def stream(self, path: str, body: dict[str, Any]) -> Reply:
        r = self.send("POST", path, body=body)
        if r.status >= 400:
            raise status_error(r.status, r.body(), self.where)
        return r

    def send(self, method: str, path: str, *, root: bool = False, body: dict[str, Any] | None = None) -> Reply:
        cls = http.client.HTTPSConnection if self.tls else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout[0])
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self.failure(e, reading=False) from None
        conn.sock.settimeout(self.timeout[1])  # connected: from now on the read timeout applies
        headers = {"Accept": "application/json, text/event-stream", "User-Agent": "foretell"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        url = (self.path[: -len("/v1")] if root else self.path) + path
        try:
            conn.request(method, url, body=data, headers=headers)
            return Reply(self, conn, conn.getresponse())
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise self.failure(e, reading=True) from None

    def failure(self, e: BaseException, *, reading: bool) -> RemoteError:
        """The cause of a failed connection or read, in words: refused, unresolved, unreachable, timed out, cut."""
        where = self.where
        if isinstance(e, TimeoutError):  # socket.timeout is TimeoutError
            if not reading:
                return RemoteUnreachableError(f"{where} did not answer within {self.timeout[0]:g} s (host down, "
                                              "wrong address, or a firewall)")
            return RemoteTimeoutError(f"{where} sent nothing for {self.timeout[1]:g} s (server overloaded or stuck)")
        if isinstance(e, ConnectionRefusedError):
            return RemoteUnreachableError(f"{where} refused the connection (no server listening on that port)")
        if isinstance(e, socket.gaierror):
            return RemoteUnreachableError(f"cannot resolve the host name of {where}")
        if isinstance(e, ssl.SSLError):
            return RemoteUnreachableError(f"the TLS handshake with {where} failed ({e.reason or e})")
        if isinstance(e, OSError) and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return RemoteUnreachableError(f"{where} is unreachable from this machine (no route to host)")
        if not reading:
            return RemoteUnreachableError(f"cannot connect to {where} ({_short(e)})")
        return RemoteProtocolError(f"the connection to {where} was cut ({_short(e)})")


def normalize_url(url: str) -> str:
    """`host:port`, `http://host:port`, `…/v1` and `…/v1/` all mean the same base: `http://host:port/v1`."""
    url = url.strip().rstrip("/")
    if not url:
        raise RemoteError("no server URL given (for example http://gpu-box:8000/v1)")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        raise RemoteError(f"{url!r} has a port that is not a number") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"{url!r} is not an http(s) URL (for example http://gpu-box:8000/v1)")
    return url if url.endswith("/v1") else url + "/v1"


def sse_events(r: Reply) -> Iterator[dict[str, Any] | None]:
    """The JSON payloads of a server-sent event stream; None for `[DONE]`. Comments and keep-alives skipped."""
    for raw in r.lines():
        raw = raw.strip()
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            yield None
            return
        try:
            obj = json.loads(data)
        except ValueError:
            raise RemoteProtocolError(f"the server sent an event that is not JSON: {data[:80]!r}") from None
        if isinstance(obj, dict):
            yield obj


def status_error(status: int, body: bytes, where: str) -> RemoteError:
    msg, code = _error_fields(body)
    if status in (401, 403):
        return RemoteAuthError(f"{where} refused the API key (HTTP {status}): {msg or 'check the key'}")
    if status == 404 and ("model" in code or "model" in msg.lower()):
        return RemoteModelError(f"{where} does not serve that model: {msg}")
    return RemoteProtocolError(f"{where} answered HTTP {status}: {msg or http.client.responses.get(status, '')}")


def _error_fields(body: bytes) -> tuple[str, str]:
    """(message, code) of an OpenAI-shaped error body, or its first line of text."""
    try:
        obj = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return (text.splitlines()[0][:200] if text else ""), ""
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or "")[:300], str(err.get("code") or err.get("type") or "")
    return str(err)[:300], ""


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__
