"""The wire under a remote engine: JSON GETs, a streamed POST read as server-sent events, and every transport
failure turned into one typed `RemoteError` with a message a user can act on.

`requests` (already installed with `gguf`) rather than an async client: the engine API is a plain iterator
consumed on a worker thread, so a blocking read with a timeout is the whole need.
"""
from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import requests
from urllib3.exceptions import ReadTimeoutError

from engine.remote.errors import (RemoteAuthError, RemoteError, RemoteModelError, RemoteProtocolError,
                                  RemoteTimeoutError, RemoteUnreachableError)


class Wire:
    """One server: its base URL (…/v1), key and timeouts; a `requests.Session` keeps connections alive."""

    def __init__(self, base_url: str, api_key: str | None, connect_timeout_s: float, read_timeout_s: float):
        self.base = normalize_url(base_url)
        self.root = self.base[: -len("/v1")]  # /metrics, /server_info live beside /v1
        self.api_key = api_key or None
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.session = requests.Session()
        self.session.trust_env = False  # a proxy from the environment must not see a cluster's key
        netloc = urlsplit(self.base).netloc
        self.where = netloc or self.base

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get_json(self, path: str, *, root: bool = False) -> Any:
        r = self._send("GET", path, root=root)
        try:
            return r.json()
        except ValueError:
            raise RemoteProtocolError(f"{self.where}{path} did not answer JSON (is this an OpenAI-compatible "
                                      "server?)") from None

    def get_text(self, path: str, *, root: bool = False) -> str | None:
        """The body of an optional endpoint (/metrics): None when the server does not have it."""
        try:
            r = self.session.get((self.root if root else self.base) + path, headers=self._headers(),
                                 timeout=self.timeout)
        except requests.RequestException:
            return None
        return r.text if r.status_code == 200 else None

    def stream(self, path: str, body: dict[str, Any]) -> requests.Response:
        return self._send("POST", path, json_body=body, stream=True)

    def _send(self, method: str, path: str, *, root: bool = False, json_body: dict | None = None,
              stream: bool = False) -> requests.Response:
        url = (self.root if root else self.base) + path
        try:
            r = self.session.request(method, url, json=json_body, headers=self._headers(), timeout=self.timeout,
                                     stream=stream)
        except requests.RequestException as e:
            raise transport_error(e, self.where, self.timeout) from None
        if r.status_code >= 400:
            raise status_error(r, self.where)
        return r

    def close(self) -> None:
        self.session.close()


def normalize_url(url: str) -> str:
    """`host:port`, `http://host:port`, `…/v1` and `…/v1/` all mean the same base: `http://host:port/v1`."""
    url = url.strip().rstrip("/")
    if not url:
        raise RemoteError("no server URL given (for example http://gpu-box:8000/v1)")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteError(f"{url!r} is not an http(s) URL (for example http://gpu-box:8000/v1)")
    return url if url.endswith("/v1") else url + "/v1"


def sse_events(r: requests.Response) -> Iterator[dict[str, Any] | None]:
    """The JSON payloads of a server-sent event stream; None for `[DONE]`. Comments and keep-alives skipped."""
    for raw in r.iter_lines(decode_unicode=False):
        if not raw or not raw.startswith(b"data:"):
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


def transport_error(e: requests.RequestException, where: str, timeout: tuple[float, float]) -> RemoteError:
    """The cause of a failed connection or read, in words: refused, unresolved, unreachable, timed out, cut."""
    if isinstance(e, requests.ConnectTimeout):
        return RemoteUnreachableError(f"{where} did not answer within {timeout[0]:g} s (host down, wrong address, "
                                      "or a firewall)")
    if isinstance(e, requests.ReadTimeout):
        return RemoteTimeoutError(f"{where} sent nothing for {timeout[1]:g} s (server overloaded or stuck)")
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, (TimeoutError, ReadTimeoutError)):  # a read timeout in mid-stream
            return RemoteTimeoutError(f"{where} sent nothing for {timeout[1]:g} s (server overloaded or stuck)")
        if isinstance(cause, ConnectionRefusedError):
            return RemoteUnreachableError(f"{where} refused the connection (no server listening on that port)")
        if isinstance(cause, socket.gaierror):
            return RemoteUnreachableError(f"cannot resolve the host name of {where}")
        if isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return RemoteUnreachableError(f"{where} is unreachable from this machine (no route to host)")
        nxt = cause.__cause__ or cause.__context__
        if nxt is None and cause.args and isinstance(cause.args[-1], BaseException):
            nxt = cause.args[-1]  # urllib3 keeps the socket error as an argument, not a cause
        cause = nxt if nxt is not cause else None
    if isinstance(e, (requests.exceptions.ChunkedEncodingError, requests.ConnectionError)):
        return RemoteProtocolError(f"the connection to {where} was cut ({_short(e)})")
    return RemoteError(f"request to {where} failed: {_short(e)}")


def status_error(r: requests.Response, where: str) -> RemoteError:
    msg = _error_message(r)
    if r.status_code in (401, 403):
        return RemoteAuthError(f"{where} refused the API key (HTTP {r.status_code}): {msg or 'check the key'}")
    code = ""
    try:
        err = r.json().get("error")
        code = str(err.get("code") or err.get("type") or "") if isinstance(err, dict) else ""
    except (ValueError, AttributeError):
        pass
    if r.status_code == 404 and ("model" in code or "model" in msg.lower()):
        return RemoteModelError(f"{where} does not serve that model: {msg}")
    return RemoteProtocolError(f"{where} answered HTTP {r.status_code}: {msg or r.reason}")


def _error_message(r: requests.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip().splitlines()[0][:200] if r.text.strip() else ""
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or "")[:300]
    return str(err)[:300]


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__
