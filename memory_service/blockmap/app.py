"""The block map's HTTP routes (Starlette, on the memory service's loop).

* ``/`` the page (``static/index.html``: everything inline, no external asset);
* ``/api/frame`` one full state as JSON; ``/api/stream?interval_ms=N`` the
  same, then the changes every N ms (server-sent events; 100 <= N <= 5000,
  default 250, so 4 updates/s); ``/api/sequences/{seq_id}`` one block table;
* ``/metrics`` the memory registry, ``/health`` 200 while serving, else 503.

Read-only. The ``/api`` routes want ``Authorization: Bearer <admin or read-only token>``
exactly when the read-only RPCs do (an admin token set and no
``--open-read-only``); the page itself holds no data and asks for the token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Callable
from importlib.resources import files

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from memory_service.blockmap.frames import FrameCache, Subscriber, sequence_table
from memory_service.metrics import BLOCKMAP_UPDATE_BYTES, BLOCKMAP_VIEWERS, REGISTRY

MIN_INTERVAL_MS, MAX_INTERVAL_MS, DEFAULT_INTERVAL_MS = 100, 5000, 250


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "status": status}}, status_code=status)


def _dumps(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def make_app(state, *, tokens: tuple[str | None, ...], serving: Callable[[], bool]) -> Starlette:
    """``state``: the MemoryState; ``tokens``: one of them is required on /api
    (the admin and the read-only token; none given: open).
    ``app.state.closing.set()`` ends every stream at its next tick (a stop)."""
    page = files("memory_service.blockmap").joinpath("static/index.html").read_bytes()
    expected = [f"Bearer {token}".encode() for token in tokens if token]
    cache = FrameCache()
    closing = asyncio.Event()

    def denied(request: Request) -> JSONResponse | None:
        if not expected:
            return None
        given = request.headers.get("authorization", "").encode()
        if any(hmac.compare_digest(given, token) for token in expected):
            return None
        return _error(401, "missing or invalid admin token (send Authorization: Bearer <token>)")

    def update(sub: Subscriber) -> bytes:
        manager = state.manager
        body = _dumps(sub.update(manager, manager.last_step_id, cache.frames(manager)))
        BLOCKMAP_UPDATE_BYTES.observe(len(body))
        return body

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-store", "content-security-policy":
                                 "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                 "img-src 'self' data:"})

    async def frame(request: Request) -> Response:
        return denied(request) or Response(update(Subscriber()), media_type="application/json")

    async def stream(request: Request) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        raw = request.query_params.get("interval_ms", str(DEFAULT_INTERVAL_MS))
        if not raw.isdigit() or not MIN_INTERVAL_MS <= int(raw) <= MAX_INTERVAL_MS:
            return _error(400, f"interval_ms must be an integer in [{MIN_INTERVAL_MS}, {MAX_INTERVAL_MS}]")
        interval_s = int(raw) / 1000.0

        async def events():
            sub = Subscriber()
            BLOCKMAP_VIEWERS.inc()
            try:
                while not closing.is_set():
                    t0 = time.perf_counter()
                    yield b"data: " + update(sub) + b"\n\n"
                    try:
                        await asyncio.wait_for(closing.wait(), max(0.0, interval_s - (time.perf_counter() - t0)))
                    except TimeoutError:
                        pass
            finally:
                BLOCKMAP_VIEWERS.dec()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    async def sequence(request: Request) -> Response:
        if (refused := denied(request)) is not None:
            return refused
        raw = request.path_params["seq_id"]
        if not raw.lstrip("-").isdigit():
            return _error(400, f"sequence id must be an integer, got {raw!r}")
        table = sequence_table(state.manager, int(raw))
        if table is None:
            return _error(404, f"no sequence {raw}")
        return JSONResponse(table)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> Response:
        ok = serving()
        return Response(b"ok\n" if ok else b"not serving\n", status_code=200 if ok else 503,
                        media_type="text/plain")

    async def not_found(request: Request, exc) -> Response:
        return _error(404, f"no such path {request.url.path!r}: /, /api/frame, /api/stream, "
                           "/api/sequences/ID, /metrics, /health")

    async def not_allowed(request: Request, exc) -> Response:
        return _error(405, "read-only: only GET")

    routes = [Route("/", index), Route("/api/frame", frame), Route("/api/stream", stream),
              Route("/api/sequences/{seq_id}", sequence), Route("/metrics", metrics), Route("/health", health)]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
    app.state.closing = closing
    return app
