"""A local HTTP server in the Hugging Face Hub's layout (no network), for app.hub.HubDownloader in the tests and the
screenshots: the model search (`/api/models?search=&filter=gguf&expand=gguf`), a repo's files with their sizes and
LFS SHA-256 (`/api/models/{repo}`, `paths-info`), and a file's HEAD and GET, ranged or whole.

Faults on demand: `slow` (every chunk waits, so a download can be paused mid-way), `corrupt` (a file's bytes are
served with one flipped while its metadata keeps the true SHA-256), `cut_after(n)` (the next GET of a file stops
after n bytes of its body and every later one is answered 503 until `recover()`: an interrupted download).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.fixtures import TINY_MOE, fixture_path

CHUNK = 64 * 1024
COMMIT = "c" * 40
SLOW_CHUNK_S = 0.004  # 10 MiB (huggingface_hub's progress step) in about 0.7 s
TINY, BIG, HUGE = "Tiny-MTP-Q8_0.gguf", "Big-MTP-Q4_K_M.gguf", "Tiny-Q4_K_M.gguf"
BIG_BYTES = 25 * 2**20  # huggingface_hub reports every 10 MiB: a download of it can be paused half-way


@dataclass(frozen=True)
class Listed:
    """A repo the search finds: its id, the GGUF architecture the Hub reports, its downloads."""

    repo: str
    architecture: str
    downloads: int


class LocalHub:
    """Every repository holds the tiny fixture as an MTP Q8_0 file (TINY), 25 MiB of random bytes (BIG) and names a
    5 TiB file (HUGE: listed, never fetched); `search_index` is what the model search looks through."""

    def __init__(self, search_index: tuple[Listed, ...] = ()) -> None:
        self.data = {TINY: fixture_path(TINY_MOE).read_bytes(), BIG: os.urandom(BIG_BYTES)}
        self.sizes = {**{n: len(d) for n, d in self.data.items()}, HUGE: 5 * 2**40}
        self.sha = {n: hashlib.sha256(d).hexdigest() for n, d in self.data.items()} | {HUGE: "0" * 64}
        self.search_index = search_index
        self.listed: list[str] = []  # repos whose files were asked for
        self.searches: list[dict[str, list[str]]] = []  # each search's query
        self.ranges: list[int] = []  # where each GET of a file started (0: the whole file)
        self.slow = threading.Event()
        self.corrupt = False
        self._cut: int | None = None
        self._down = False
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.server.serve_forever, name="hub-stub", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def cut_after(self, n: int) -> None:
        self._cut = n

    def recover(self) -> None:
        self._down = False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> LocalHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _served(self, name: str) -> bytes:
        d = self.data[name]
        return d[:100] + bytes([d[100] ^ 0xFF]) + d[101:] if self.corrupt else d

    def _search(self, query: dict[str, list[str]]) -> list[dict]:
        self.searches.append(query)
        text = query.get("search", [""])[0].lower()
        return [{"id": e.repo, "modelId": e.repo, "downloads": e.downloads, "gguf": {"architecture": e.architecture}}
                for e in sorted(self.search_index, key=lambda e: -e.downloads) if text in e.repo.lower()]

    def _siblings(self) -> list[dict]:
        return [{"rfilename": n, "size": size, "lfs": {"sha256": self.sha[n], "size": size, "pointerSize": 134}}
                for n, size in self.sizes.items()] + [{"rfilename": "README.md", "size": 9}]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
                      length: int | None = None) -> None:
                self.send_response(code)
                for k, v in {"Content-Length": str(len(body) if length is None else length), **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

            def _json(self, obj: object) -> None:
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _name(self) -> str:
                return urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.rsplit("/", 1)[-1])

            def _file_headers(self) -> dict[str, str]:
                name = self._name()
                return {"X-Repo-Commit": COMMIT, "ETag": f'"{hub.sha[name]}"', "X-Linked-Etag": f'"{hub.sha[name]}"',
                        "X-Linked-Size": str(hub.sizes[name]), "Accept-Ranges": "bytes"}

            def do_HEAD(self) -> None:  # noqa: N802
                self._send(200, b"", self._file_headers(), hub.sizes[self._name()])

            def do_POST(self) -> None:  # noqa: N802 — paths-info: the files' sizes and LFS SHA-256
                form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                sib = {s["rfilename"]: s for s in hub._siblings()}
                self._json([{"type": "file", "path": p, "size": sib[p]["size"], "oid": "b" * 40,
                             "lfs": {"oid": sib[p]["lfs"]["sha256"], "size": sib[p]["size"], "pointerSize": 134}}
                            for p in form.get("paths", []) if p in sib])

            def do_GET(self) -> None:  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/api/models":
                    self._json(hub._search(urllib.parse.parse_qs(url.query)))
                elif url.path.startswith("/api/models/"):
                    repo = url.path[len("/api/models/"):].split("/revision/")[0]
                    hub.listed.append(repo)
                    self._json({"id": repo, "sha": COMMIT, "siblings": hub._siblings()})
                else:
                    self._file()

            def _file(self) -> None:
                if hub._down:
                    self._send(503, b"down")
                    return
                data = hub._served(self._name())
                start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
                hub.ranges.append(start)
                extra = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if start else {}
                self._send(206 if start else 200, b"", {**self._file_headers(), **extra}, len(data) - start)
                end, cut = len(data), hub._cut
                if cut is not None:
                    hub._cut, hub._down, end = None, True, start + cut
                try:
                    for at in range(start, end, CHUNK):
                        self.wfile.write(data[at:min(at + CHUNK, end)])
                        if hub.slow.is_set():
                            time.sleep(SLOW_CHUNK_S)
                except (BrokenPipeError, ConnectionResetError):  # a paused download hung up
                    return
                if cut is not None:
                    self.close_connection = True
                    self.wfile.flush()
                    self.connection.shutdown(2)

        return Handler
