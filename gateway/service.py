"""Start and stop the gateway in-process (the CLI, `kvpager up` and tests):
the engine, the gRPC server and, unless turned off, the OpenAI-compatible
HTTP server (gateway/http), all on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpager.channel import ClientTls
from kvpager.security import token_auth
from kvpager.server import ServiceRuntime, TlsConfig
from kvpager.telemetry import get_logger
from kvpager.v1 import gateway_pb2_grpc
from gateway.clients import MemoryClient
from gateway.engine import Engine
from gateway.engine_config import EngineConfig
from gateway.http.server import HttpConfig
from gateway.router import make_router
from gateway.servicer import GatewayServicer
from gateway.tenants import Tenants

log = get_logger("gateway")

SERVICE_NAME = "kvpager.v1.Gateway"


@dataclass
class GatewayConfig:
    model: str                                  # checkpoint directory: the tokenizer is read from it
    memory_address: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 50050
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    stats_interval_s: float = 10.0              # the periodic "engine stats" log line; 0 = none
    grace_s: float = 5.0
    max_message_bytes: int = 16 * 2**20
    redis_url: str | None = None                # route by the Redis mirror instead of ScorePrefix RPCs
    routing: str = "prefix"                     # "prefix" (prefix-aware, load-balanced) | "round-robin"
    tls: TlsConfig | None = None                # serve TLS (mTLS with require_client_auth); None = insecure
    client_tls: ClientTls | None = None         # TLS to the memory service and executors
    auth_token: str | None = field(default=None, repr=False)   # required from clients (bearer)
    # token -> tenant (gateway.tenants; each tenant's token is accepted as a bearer credential too)
    tenant_tokens: dict[str, str] = field(default_factory=dict, repr=False)
    prefix_sharing: str = "isolated"            # between tenants: "isolated" | "shared"
    admin_token: str | None = field(default=None, repr=False)  # sent to the memory service and executors
    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpConfig | None = field(default_factory=HttpConfig)  # None: no HTTP API


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


class GatewayServer:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.memory = MemoryClient(config.memory_address, tls=config.client_tls, token=config.admin_token)
        self.engine = Engine(config.engine, self.memory, self.tokenizer, executor_tls=config.client_tls,
                             executor_token=config.admin_token)
        self.router = make_router(config.routing, self.engine, config.engine.load_weight_tokens, config.redis_url)
        self.runtime = ServiceRuntime("gateway", host=config.host, port=config.port,
                                      metrics_port=config.metrics_port, metrics_host=config.metrics_host,
                                      grace_s=config.grace_s,
                                      max_message_bytes=config.max_message_bytes, tls=config.tls,
                                      auth=token_auth(config.auth_token, also=tuple(config.tenant_tokens)))
        self.tenants = Tenants(dict(config.tenant_tokens), config.prefix_sharing)
        servicer = GatewayServicer(self.engine, self.router, self.tokenizer,
                                   token_required=bool(config.auth_token or config.tenant_tokens),
                                   tenants=self.tenants)
        self.runtime.add(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, SERVICE_NAME)
        self.frontend = servicer.frontend
        self.http_context = None  # the HTTP routes' view of the gateway (gateway.http.app.HttpContext)
        self.http = self._http_server(servicer.frontend) if config.http is not None else None
        self._watch: asyncio.Task | None = None
        self._stats: asyncio.Task | None = None

    def _http_server(self, frontend):
        from gateway.http.app import HttpContext, make_app
        from gateway.http.chat import ChatTemplate
        from gateway.http.server import HttpServer

        cfg = self.config
        http = cfg.http
        keys = tuple(k for k in (http.api_key, cfg.auth_token, *cfg.tenant_tokens) if k)
        ctx = HttpContext(frontend=frontend, chat=ChatTemplate(self.tokenizer, http.chat_template),
                          served_model_name=http.served_model_name or Path(cfg.model).resolve().name,
                          model_dir=str(cfg.model), version=_version(), api_keys=keys,
                          max_body_bytes=cfg.max_message_bytes, created=int(time.time()))
        server = HttpServer(http, make_app(ctx), tls=cfg.tls, grace_s=cfg.grace_s)
        ctx.serving = lambda: not server.stopping
        self.http_context = ctx
        return server

    @property
    def address(self) -> str:
        return self.runtime.address

    @property
    def http_url(self) -> str | None:
        """The HTTP API's base URL ("http://host:port"; the OpenAI one is it + "/v1"), None without one."""
        return self.http.url if self.http is not None else None

    async def start(self) -> GatewayServer:
        await self.runtime.start_with(self.http)
        await self.engine.start()
        loop = asyncio.get_running_loop()
        self._watch = loop.create_task(self._track_readiness())
        if self.config.stats_interval_s > 0:
            from gateway.request_stats import StatsLine

            line = StatsLine(self.engine.stats, self.memory.accounting, self.config.stats_interval_s)
            self._stats = loop.create_task(line.run(), name="engine-stats")
        log.info("gateway serving", address=self.address, http=self.http_url,
                 metrics_port=self.runtime.metrics_port)
        return self

    async def _track_readiness(self) -> None:
        """SERVING exactly while at least one executor is serving."""
        serving = None
        while True:
            ready = self.engine.ready
            if ready != serving:
                await self.runtime.set_serving(ready)
                log.info("gateway readiness", serving=ready, executors=len(self.engine.executors))
                serving = ready
            await asyncio.sleep(0.1)

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        async def ready() -> None:
            while not self.engine.ready:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(ready(), timeout_s)

    async def stop(self, grace_s: float | None = None) -> None:
        for task in (self._watch, self._stats):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._watch = self._stats = None
        stops = [self.runtime.stop(grace_s)]
        if self.http is not None:  # both let requests in flight finish while the engine still runs
            stops.append(self.http.stop(grace_s))
        await asyncio.gather(*stops)
        await self.engine.stop()
        self.frontend.close()
        await self.memory.close()

    async def serve_until_signal(self) -> None:
        try:
            await self.runtime.serve_until_signal(also_stop=self.http.stop if self.http is not None else None)
        finally:
            await self.stop()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpager")
    except PackageNotFoundError:
        return "0.1.0"
