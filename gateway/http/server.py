"""The HTTP API's server: uvicorn on the gateway's own event loop.

The gateway's engine, gRPC server and this server share one asyncio loop
(as vLLM runs its API server beside the engine client): a request goes from
the socket to ``Engine.submit`` without crossing a thread or a process.
uvicorn runs without its signal handlers and logging setup (the gateway
owns both); the listening socket is bound here, so port 0 means any free
one and ``address`` tells which. TLS, when the gateway serves it, is the
same certificate (HTTPS; client certificates required with mTLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from dataclasses import dataclass, field

from kvpager.telemetry import get_logger

log = get_logger("gateway.http")


@dataclass
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000                        # 0: any free port
    served_model_name: str = ""             # default: the checkpoint directory's name
    chat_template: str | None = None        # a Jinja file overriding the tokenizer's template
    api_key: str | None = field(default=None, repr=False)  # required bearer token (besides the gateway token)
    keep_alive_s: float = 30.0


class HttpServer:
    def __init__(self, config: HttpConfig, app, *, tls=None, grace_s: float = 5.0) -> None:
        self.config = config
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
        host = self.config.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), self.config.port))
        sock.set_inheritable(True)
        return sock

    async def start(self) -> HttpServer:
        import uvicorn

        self._socket = self._bind()
        tls = self.tls
        config = uvicorn.Config(
            self.app, lifespan="off", log_config=None, log_level="warning", access_log=False,
            timeout_keep_alive=int(self.config.keep_alive_s), timeout_graceful_shutdown=int(self.grace_s),
            backlog=4096, ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
            ssl_ca_certs=tls.ca_file if tls else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.require_client_auth else ssl.CERT_NONE)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._socket])
        self._server = server
        self._main = asyncio.get_running_loop().create_task(server.main_loop(), name="http-main")
        log.info("http server started", url=self.url)
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
        log.info("http server stopped")
