"""Responses that run the generation themselves and stop when the client goes.

Both kinds are ASGI responses whose body is produced while a second task
waits for ``http.disconnect``: when the client disconnects (mid-stream, or
while a non-streaming request is still generating) the producer is
cancelled and ``on_close`` aborts the engine requests, so their blocks are
back in the next step, as a gRPC cancel does. The status line waits for the
first event: an error before any token (a rejection, no executor) is a real
HTTP status, one after it an SSE ``error`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from gateway.http.errors import HttpError, from_domain
from kvpager.errors import KvpagerError

DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


def dumps(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def event(body: dict) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


def as_http_error(exc: Exception) -> HttpError:
    return exc if isinstance(exc, HttpError) else from_domain(exc)


async def send_error(send, err: HttpError) -> None:
    body = dumps(err.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def until_disconnect(work: Awaitable, receive) -> tuple[bool, object]:
    """Run ``work`` unless the client disconnects first: (finished, its result)."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False, None
    finally:
        listener.cancel()
        task.cancel()


class EventStream(Response):
    """Server-sent events from ``events`` (each item one framed event)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(media_type="text/event-stream")
        self.events = events
        self.on_close = on_close

    async def _pump(self, send) -> None:
        started = False
        try:
            async for data in self.events:
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                    started = True
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except (KvpagerError, HttpError) as exc:
            err = as_http_error(exc)
            if not started:
                await send_error(send, err)
                return
            await send({"type": "http.response.body", "body": event(err.body()) + DONE, "more_body": True})
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await until_disconnect(self._pump(send), receive)
        finally:
            self.on_close()
            with contextlib.suppress(Exception):
                await self.events.aclose()


class Deferred(Response):
    """A JSON body produced by ``produce()`` (a dict, or an error raised)."""

    def __init__(self, produce: Callable[[], Awaitable[dict]], on_close: Callable[[], None]) -> None:
        super().__init__(media_type="application/json")
        self.produce = produce
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            finished, body = await until_disconnect(self.produce(), receive)
        except (KvpagerError, HttpError) as exc:
            await send_error(send, as_http_error(exc))
            return
        finally:
            self.on_close()
        if not finished:
            return  # the client is gone: nobody to answer
        data = dumps(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(stream index, item) from several streams as items arrive; an error in one ends all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, end))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
