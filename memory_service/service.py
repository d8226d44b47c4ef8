"""Start and stop the memory service in-process (the CLI, `kvpager up` and
tests all go through here)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from kvpager.channel import ClientTls
from kvpager.server import ServiceRuntime, TlsConfig
from kvpager.telemetry import get_logger
from kvpager.v1 import memory_pb2_grpc
from memory_service.events import EventQueue
from memory_service.limits import MemoryLimits
from memory_service.manager import MemoryManager
from memory_service.policy import VICTIM_POLICIES, TenantQuota, make_mode_policy
from memory_service.retention import PinBudget
from memory_service.service_state import MemoryState
from memory_service.servicer import MemoryServicer

log = get_logger("memory_service")

SERVICE_NAME = "kvpager.v1.MemoryService"


@dataclass
class MemoryConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    http_port: int | None = None           # the block map over HTTP (memory_service/blockmap); None = off
    http_host: str = "127.0.0.1"
    lease_s: float = 5.0
    preemption_mode: str = "cost"          # memory_service.policy.MODE_POLICIES
    swap_min_tokens: int = 256             # the threshold policy's (and the cost policy's fallback) length
    victim_policy: str = "newest"          # memory_service.policy.VICTIM_POLICIES
    tenant_max_blocks: float = 0.0         # per-tenant quota per pool: < 1 a fraction, else blocks; 0 = none
    tenant_max_pinned_blocks: float = 0.25  # per-tenant budget of retained blocks per pool (same units); 0 = no pins
    grace_s: float = 5.0
    # The Redis mirror (docs/mirror.md): None keeps the embedded default, no Redis.
    redis_url: str | None = None           # redis://[user:pass@]host:port/db
    redis_username: str | None = None      # else from the URL or KVPAGER_REDIS_USERNAME
    redis_password: str | None = None      # else from the URL or KVPAGER_REDIS_PASSWORD
    mirror_lease_s: float | None = None    # executor record lease; default lease_s * 3
    recovery_timeout_s: float = 30.0       # bound on restart recovery before serving cold
    confirm_timeout_s: float = 1.0         # deadline of each ConfirmPool during recovery
    # Security (docs/security.md): TLS on the server and on ConfirmPool calls
    # to executors; the admin token is required (for the mutating RPCs only
    # with open_read_only) and sent to executors.
    tls: TlsConfig | None = None
    client_tls: ClientTls | None = None
    admin_token: str | None = field(default=None, repr=False)
    read_only_token: str | None = field(default=None, repr=False)  # accepted on the read-only RPCs only
    open_read_only: bool = False
    limits: MemoryLimits = field(default_factory=MemoryLimits)  # what one RPC may ask (docs/security.md)


class MemoryServer:
    """A running memory service: its gRPC runtime, state and lease reaper."""

    def __init__(self, config: MemoryConfig) -> None:
        self.config = config
        if config.victim_policy not in VICTIM_POLICIES:
            raise ValueError(f"victim policy must be one of {sorted(VICTIM_POLICIES)}, got {config.victim_policy!r}")
        manager = MemoryManager(mode_policy=make_mode_policy(config.preemption_mode, config.swap_min_tokens),
                                victim_policy=VICTIM_POLICIES[config.victim_policy](),
                                quota=TenantQuota(config.tenant_max_blocks) if config.tenant_max_blocks else None,
                retention=PinBudget(TenantQuota(config.tenant_max_pinned_blocks)
                                    if config.tenant_max_pinned_blocks else None),
                                events=EventQueue(enabled=bool(config.redis_url)), limits=config.limits)
        self.state = MemoryState(manager, lease_s=config.lease_s)
        self.mirror = None
        if config.redis_url:
            from memory_service.mirror.writer import MirrorWriter

            self.mirror = MirrorWriter(self.state, config.redis_url, username=config.redis_username,
                                       password=config.redis_password, lease_s=config.mirror_lease_s)
        from kvpager.security import memory_auth

        self.runtime = ServiceRuntime("memory", host=config.host, port=config.port,
                                      metrics_port=config.metrics_port, metrics_host=config.metrics_host,
                                      grace_s=config.grace_s, tls=config.tls,
                                      auth=memory_auth(config.admin_token, config.open_read_only,
                                                       config.read_only_token))
        self.runtime.add(memory_pb2_grpc.add_MemoryServiceServicer_to_server,
                         MemoryServicer(self.state), SERVICE_NAME)
        self._reaper: asyncio.Task | None = None
        self.http = None
        if config.http_port is not None:  # the block map (docs/blockmap.md)
            from kvpager.asgi import AsgiServer
            from memory_service.blockmap.app import make_app

            open_map = config.open_read_only or not config.admin_token
            app = make_app(self.state, tokens=() if open_map else (config.admin_token, config.read_only_token),
                           serving=lambda: self.runtime.serving)
            self.http = AsgiServer(config.http_host, config.http_port, app, tls=config.tls, grace_s=config.grace_s,
                                   name="blockmap")

    @property
    def address(self) -> str:
        return self.runtime.address

    @property
    def blockmap_url(self) -> str | None:
        """The block map page ("http://host:port/"), None without one."""
        return self.http.url + "/" if self.http is not None else None

    async def start(self) -> MemoryServer:
        """Serve; with a mirror, health stays NOT_SERVING until recovery is done."""
        # Recovering from before the first RPC can arrive: a registration let
        # through while the mirror connects would reset the record recovery reads.
        self.state.recovering = self.mirror is not None
        try:
            await self.runtime.start_with(self.http)
            if self.mirror is not None:
                await self.mirror.start()
                await self._recover()
        finally:
            self.state.recovering = False
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        await self.runtime.set_serving(True)
        return self

    async def _recover(self) -> None:
        from memory_service.mirror.recovery import recover

        if not self.mirror.connected:
            log.warning("mirror unreachable at start: no recovery, starting cold", url=self.mirror.url)
            return
        try:
            report = await asyncio.wait_for(
                recover(self.state, self.mirror, confirm=self._confirm_pool,
                        confirm_timeout_s=self.config.confirm_timeout_s),
                self.config.recovery_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed recovery starts cold, never fails the service
            log.warning("mirror recovery failed: starting cold", error=repr(exc))
            return
        log.info("mirror recovery done", restored=report.restored, dropped=report.dropped,
                 blocks=report.num_blocks)

    async def _confirm_pool(self, address: str, incarnation: int, pool_generation: int, timeout_s: float,
                            written_since_step: int = 0):
        """ExecutorService.ConfirmPool over this service's TLS and admin token (recovery.ConfirmFn):
        a ConfirmAnswer, None when not confirmed."""
        import grpc

        from kvpager.channel import make_channel
        from kvpager.v1 import executor_pb2, executor_pb2_grpc
        from memory_service.mirror.recovery import answer_from_reply

        async with make_channel(address, tls=self.config.client_tls, token=self.config.admin_token) as channel:
            try:
                reply = await executor_pb2_grpc.ExecutorServiceStub(channel).ConfirmPool(
                    executor_pb2.ConfirmPoolRequest(incarnation=incarnation, pool_generation=pool_generation,
                                                    written_since_step=written_since_step),
                    timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.info("ConfirmPool failed", address=address, code=exc.code().name)
                return None
        return answer_from_reply(reply, incarnation, pool_generation)

    async def _reap(self) -> None:
        """Every half lease: drop the executors silent for too long. Time this
        loop overslept is time the service itself was stalled (heartbeats
        waiting unread behind a long call): it is credited to every lease
        before reaping, so a stall never expires a healthy executor."""
        interval_s = max(0.05, self.config.lease_s / 2)
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(interval_s)
            try:
                self.state.excuse_stall(time.monotonic() - t0 - interval_s)
                self.state.reap_expired()
            except Exception:  # a reaper crash must not take the service down
                log.exception("lease reaper failed")

    async def stop(self, grace_s: float | None = None) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await self.runtime.stop(grace_s)
        if self.http is not None:
            self.http.app.state.closing.set()  # the block map's streams end at their next tick
            await self.http.stop(1.0)
        if self.mirror is not None:
            await self.mirror.stop()
        self.state.close()

    async def serve_until_signal(self) -> None:
        try:
            await self.runtime.serve_until_signal()
        finally:
            await self.stop()


async def start_memory_service(config: MemoryConfig | None = None) -> MemoryServer:
    return await MemoryServer(config or MemoryConfig()).start()
