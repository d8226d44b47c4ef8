"""gRPC server lifecycle shared by the three services.

``ServiceRuntime`` owns one ``grpc.aio`` server: health (NOT_SERVING until the
service says it is ready, and again as soon as a stop begins), reflection,
TLS or an insecure port, optional bearer-token auth, Prometheus metrics and
the one interceptor that maps domain errors to status codes::

    runtime = ServiceRuntime("memory", port=50051, metrics_port=9100)
    runtime.add(memory_pb2_grpc.add_MemoryServiceServicer_to_server, servicer,
                "kvpager.v1.MemoryService")
    await runtime.start()
    await runtime.set_serving(True)
    await runtime.serve_until_signal()   # SIGTERM: NOT_SERVING, then stop(grace)
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvpager.auth import TokenAuth
from kvpager.interceptor import INTERNAL_DETAILS, REQUEST_ID_KEY, RETRY_AFTER_KEY, ErrorMappingInterceptor
from kvpager.preflight import BindError
from kvpager.telemetry import MetricsServer, get_logger, registry

__all__ = ["ErrorMappingInterceptor", "INTERNAL_DETAILS", "REQUEST_ID_KEY", "RETRY_AFTER_KEY", "ServiceRuntime",
           "TlsConfig", "TokenAuth", "server_options"]

log = get_logger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Clients ping every 30 s; allow it (the default minimum is 5 minutes).
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # A second process binding the same port must fail, not share it.
        ("grpc.so_reuseport", 0),
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class TlsConfig:
    """Server TLS from PEM files; mTLS when ``require_client_auth`` (needs ``ca_file``)."""

    cert_file: str
    key_file: str
    ca_file: str | None = None
    require_client_auth: bool = False

    def credentials(self) -> grpc.ServerCredentials:
        if self.require_client_auth and not self.ca_file:
            raise ValueError("require_client_auth needs ca_file")
        key = pathlib.Path(self.key_file).read_bytes()
        cert = pathlib.Path(self.cert_file).read_bytes()
        ca = pathlib.Path(self.ca_file).read_bytes() if self.ca_file else None
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=self.require_client_auth
        )


class ServiceRuntime:
    """One grpc.aio server with health, reflection, metrics and graceful stop.

    Args:
        name: the service name in logs and metric labels ("memory", "executor").
        host, port: where to listen; ``port=0`` picks a free port.
        metrics_port: Prometheus port (0 = any free one; None = no endpoint).
        grace_s: how long a stop lets in-flight RPCs finish.
        max_message_bytes: send and receive limit.
        tls: serve TLS (mTLS with ``require_client_auth``); insecure when None.
        auth: bearer-token check (health and reflection stay open).
        interceptors: extra interceptors, run inside error mapping and auth.

    A servicer may name its per-step methods (``PER_STEP_METHODS``, method
    names): those answer the request id in trailing metadata (see
    ``kvpager.interceptor.ErrorMappingInterceptor``).
    """

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        grace_s: float = 5.0,
        max_message_bytes: int = 64 * 2**20,
        tls: TlsConfig | None = None,
        auth: TokenAuth | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.grace_s = grace_s
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self.auth = auth
        self.interceptors = tuple(interceptors)
        self.health = health_aio.HealthServicer()
        self._services: list[tuple[Callable, object, str]] = []
        self._server: grpc.aio.Server | None = None
        self._metrics: MetricsServer | None = None
        self._stopping: asyncio.Task | None = None
        self._serving = False
        self._stop_requested = asyncio.Event()
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    @property
    def per_step_methods(self) -> frozenset[str]:
        """Full method names ("/pkg.Service/Method") the registered servicers call per-step."""
        return frozenset(f"/{full_name}/{m}" for _, servicer, full_name in self._services
                         for m in getattr(servicer, "PER_STEP_METHODS", ()))

    @property
    def service_names(self) -> list[str]:
        return [full_name for _, _, full_name in self._services]

    def add(self, add_fn: Callable, servicer: object, service_full_name: str) -> None:
        """Registers a servicer, e.g. ``(add_MemoryServiceServicer_to_server, s,
        "kvpager.v1.MemoryService")``; only before ``start``."""
        if self._server is not None:
            raise RuntimeError("add() after start()")
        self._services.append((add_fn, servicer, service_full_name))

    async def start(self) -> int:
        """Binds and starts; every service reports NOT_SERVING until
        ``set_serving(True)``. Returns the bound port."""
        if self._server is not None:
            raise RuntimeError("already started")
        server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor(self.name, self.per_step_methods),
                          *([self.auth] if self.auth else []), *self.interceptors],
            options=server_options(self.max_message_bytes),
        )
        for add_fn, servicer, _ in self._services:
            add_fn(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], server
        )
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

        target = self.address
        try:
            if self.tls:
                bound = server.add_secure_port(target, self.tls.credentials())
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError as exc:  # newer grpc raises; older returned 0
            raise BindError(f"{self.name}: cannot bind {target} (--port {self.port}): in use or not "
                            "a local address") from exc
        if not bound:
            raise BindError(f"{self.name}: cannot bind {target} (--port {self.port}): in use or not "
                            "a local address")
        self.port = bound
        await server.start()
        self._server = server
        if self.metrics_port is not None:
            self._metrics = MetricsServer(self.metrics_port, self.metrics_host, registry(self.name),
                                          serving=lambda: self.serving)
            self.metrics_port = self._metrics.port
        log.info(
            "server started",
            service=self.name,
            address=self.address,
            tls=self.tls is not None,
            auth=self.auth is not None,
            metrics_port=self.metrics_port,
        )
        return bound

    def set_serving(self, serving: bool) -> asyncio.Task:
        """Flips health for "" and every added service. Takes effect on the next
        loop turn; await the returned task to be sure it has. Ignored once a
        stop has begun."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return asyncio.get_running_loop().create_task(self._set_all(status))

    @property
    def serving(self) -> bool:
        """Whether health reports SERVING now (the metrics server's ``/health`` answers by it)."""
        return self._serving and not self._stop_requested.is_set() and self._stopping is None

    async def _set_all(self, status) -> None:
        self._serving = status == health_pb2.HealthCheckResponse.SERVING
        for service in ("", *self.service_names):
            await self.health.set(service, status)

    async def start_with(self, http=None) -> None:
        """Starts the gRPC server, then ``http`` beside it (an
        ``kvpager.asgi.AsgiServer``, or None); when the HTTP port cannot be
        bound the gRPC server is stopped again and the OSError raised."""
        await self.start()
        if http is not None:
            try:
                await http.start()
            except OSError:
                await self.stop(0)
                raise

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING for everything, then a graceful stop: in-flight RPCs get
        ``grace_s`` to finish, new ones are refused. Safe to call twice."""
        if self._server is None:
            return
        self._stop_requested.set()
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(grace_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace_s: float | None) -> None:
        grace = self.grace_s if grace_s is None else grace_s
        log.info("server stopping", service=self.name, grace_s=grace)
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._stopped.set()
        log.info("server stopped", service=self.name)

    async def wait_for_termination(self) -> None:
        """Returns once a stop has finished (whoever started it)."""
        await self._stopped.wait()

    async def serve_until_signal(self, also_stop: Callable[[], Awaitable] | None = None) -> None:
        """Starts if needed and serves until SIGTERM or SIGINT (or until someone
        else calls ``stop``), then stops gracefully, NOT_SERVING first
        (``also_stop()``, e.g. another server of the process, stops at the
        same time, within the same grace period). Returns once stopped."""
        if self._server is None:
            await self.start()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)

        def on_signal(sig: signal.Signals) -> None:
            log.info("signal received", service=self.name, signal=sig.name)
            self._stop_requested.set()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            # Not grpc's Server.wait_for_termination: cancelling that wait
            # cancels the server's own shutdown future, and a later stop()
            # then raises CancelledError.
            await self._stop_requested.wait()
            await asyncio.gather(self.stop(), *([also_stop()] if also_stop is not None else []))
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
