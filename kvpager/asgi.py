"""An ASGI app on uvicorn, on the service's own event loop (the gateway's
OpenAI-compatible API, the memory service's block map).

The service's engine, gRPC server and this server share one asyncio loop
(as vLLM runs its API server beside the engine client): a request goes from
the socket to the service without crossing a thread or a process.
uvicorn runs without its signal handlers and logging setup (the service
owns both); the listening socket is bound here, so port 0 means any free
one and ``address`` tells which. TLS, when the service serves it, is the
same certificate (HTTPS; client certificates required with mTLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

from kvpager.telemetry import get_logger

log = get_logger("kvpager.http")


class AsgiServer:
    """An ASGI app served by uvicorn on the running event loop (see the module docstring)."""

    def __init__(self, host: str, port: int, app, *, tls=None, grace_s: float = 5.0, keep_alive_s: float = 30.0,
                 name: str = "http") -> None:
        self.host, self.port, self.keep_alive_s, self.name = host, port, keep_alive_s, name
        self.app = app
        self.tls = tls            # kvpager.server.TlsConfig or None
        self.grace_s = grace_s
        self.stopping = False
        self._server = None
        self._socket: socket.socket | None = None
        self._main: asyncio.Task | None = None

    @property
    def address(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    def _bind(self) -> socket.socket:
        host = self.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on
        # connections whose socket says so, and accepted ones inherit the listener's.
        # With Nagle on, an SSE stream's first event (written right after the status
        # line) waited for the client's delayed ACK on a reused keep-alive
        # connection: 40 ms more time to first token.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), self.port))
        sock.set_inheritable(True)
        return sock

    async def start(self) -> AsgiServer:
        import uvicorn

        self._socket = self._bind()
        tls = self.tls
        config = uvicorn.Config(
            self.app, lifespan="off", log_config=None, log_level="warning", access_log=False,
            timeout_keep_alive=int(self.keep_alive_s), timeout_graceful_shutdown=int(self.grace_s),
            backlog=4096, ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=tls.ca_file if tls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.require_client_auth else ssl.CERT_NONE)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._socket])
        self._server = server
        self._main = asyncio.get_running_loop().create_task(server.main_loop(), name=f"{self.name}-main")
        log.info("http server started", server=self.name, url=self.url)
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let streams in flight finish for the grace period, then cancel them."""
        self.stopping = True
        server = self._server
        if server is None:
            return
        self._server = None
        if grace_s is not None:
            server.config.timeout_graceful_shutdown = int(grace_s)
        server.should_exit = True
        if self._main is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._main
        await server.shutdown(sockets=[self._socket])
        log.info("http server stopped", server=self.name)
