"""kvpager.asgi.AsgiServer (the HTTP API's and the block map's server) over
a real socket on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket

from kvpager.asgi import AsgiServer


async def _stream_app(scope, receive, send):
    """As the SSE responses: the status line, then the first event in a second write."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _one_request(reader, writer) -> bytes:
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    got = b""
    while not got.endswith(b"0\r\n\r\n"):  # the chunked body's end
        got += await asyncio.wait_for(reader.read(65536), 10)
    return got


async def test_accepted_connections_have_nagle_off():
    """Each accepted connection has TCP_NODELAY, so a stream's events leave
    as they are written (with Nagle on, the first event after the status line
    waited for the client's delayed ACK: 40 ms on a reused connection)."""
    server = await AsgiServer("127.0.0.1", 0, _stream_app, name="test").start()
    try:
        host, port = server.address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for _ in range(2):  # a fresh connection, then the same one reused
                assert b"data: 1" in await _one_request(reader, writer)
            connections = server._server.server_state.connections
            assert len(connections) == 1
            [conn] = connections
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        await server.stop(grace_s=1)
