"""A small asyncio HTTP/1.1 client for load generation against OpenAI-compatible servers.

The benchmark and the load drill measure the *server*; on a shared 2-core
machine the load generator's own CPU is taken from the server, so it must
cost less than the server per event. This one parses only what a load
generator needs (status, a few headers, Content-Length or chunked bodies,
server-sent events) over keep-alive connections, with no per-chunk object
churn: measured at a fraction of httpx's client CPU per streamed event
(docs/benchmarks.md). TLS with ``https://`` URLs. It is not a general HTTP
client (no redirects, no compression, no proxies).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class HttpClientError(Exception):
    """The connection failed or the response was malformed."""


@dataclass(slots=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes = b""

    def json(self):
        return json.loads(self.body)


@dataclass(slots=True)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


@dataclass
class HttpClient:
    """Keep-alive connections to one server (``base_url``: "http://host:port")."""

    base_url: str
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 600.0
    _idle: list[_Conn] = field(default_factory=list)

    def __post_init__(self) -> None:
        url = urlsplit(self.base_url)
        if url.scheme not in ("http", "https"):
            raise ValueError(f"base_url must be http:// or https://, got {self.base_url!r}")
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._host_header = url.netloc

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.writer.close()

    async def _connect(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof():
                return conn
            conn.writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20)
        return _Conn(reader, writer)

    def _request(self, method: str, path: str, body: bytes | None) -> bytes:
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self._host_header}",
                 *(f"{k}: {v}" for k, v in self.headers.items())]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")

    async def _head(self, conn: _Conn) -> tuple[int, dict[str, str]]:
        status_line = await conn.reader.readline()
        if not status_line:
            raise HttpClientError("connection closed before a response")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise HttpClientError(f"malformed status line {status_line[:80]!r}")
        headers = {}
        while True:
            line = await conn.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        return int(parts[1]), headers

    async def _body(self, conn: _Conn, headers: dict[str, str]) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (chunked, sized, or to the end of the connection)."""
        reader = conn.reader
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left:
                data = await reader.read(min(left, 1 << 16))
                if not data:
                    raise HttpClientError("connection closed inside a body")
                left -= len(data)
                yield data
        else:
            while data := await reader.read(1 << 16):
                yield data

    def _release(self, conn: _Conn, headers: dict[str, str], complete: bool) -> None:
        """Back to the pool after a whole response that keeps the connection, else closed."""
        framed = "content-length" in headers or headers.get("transfer-encoding", "").lower() == "chunked"
        if complete and framed and headers.get("connection", "").lower() != "close":
            self._idle.append(conn)
        else:
            conn.writer.close()

    async def request(self, method: str, path: str, body: dict | None = None) -> Response:
        data = json.dumps(body).encode() if body is not None else None
        conn = await self._connect()
        complete = False
        headers: dict[str, str] = {}
        try:
            conn.writer.write(self._request(method, path, data))
            status, headers = await asyncio.wait_for(self._head(conn), self.timeout_s)
            pieces = [p async for p in self._body(conn, headers)]
            complete = True
            return Response(status, headers, b"".join(pieces))
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise HttpClientError(f"{type(exc).__name__}: {exc}") from None
        finally:
            self._release(conn, headers, complete)

    async def stream_events(self, path: str, body: dict) -> AsyncIterator[tuple[float, bytes] | Response]:
        """POST, then each server-sent event's data as (perf_counter on arrival, bytes);
        a non-200 answer is yielded once as a Response (its body read)."""
        conn = await self._connect()
        complete = False
        headers: dict[str, str] = {}
        try:
            conn.writer.write(self._request("POST", path, json.dumps(body).encode()))
            status, headers = await asyncio.wait_for(self._head(conn), self.timeout_s)
            if status != 200:
                pieces = [p async for p in self._body(conn, headers)]
                complete = True
                yield Response(status, headers, b"".join(pieces))
                return
            pending = b""
            async for piece in self._body(conn, headers):
                now = time.perf_counter()
                pending += piece
                while (end := pending.find(b"\n\n")) >= 0:
                    block, pending = pending[:end], pending[end + 2:]
                    for line in block.split(b"\n"):
                        if line.startswith(b"data:"):
                            yield now, line[5:].strip()
            complete = True
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise HttpClientError(f"{type(exc).__name__}: {exc}") from None
        finally:
            self._release(conn, headers, complete)
