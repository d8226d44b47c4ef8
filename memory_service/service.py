"""Start and stop the memory service in-process (the CLI, `kvpager up` and
tests all go through here)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from kvpager.server import ServiceRuntime
from kvpager.telemetry import get_logger
from kvpager.v1 import memory_pb2_grpc
from memory_service.manager import MemoryManager
from memory_service.policy import ModePolicy
from memory_service.service_state import MemoryState
from memory_service.servicer import MemoryServicer

log = get_logger("memory_service")

SERVICE_NAME = "kvpager.v1.MemoryService"


@dataclass
class MemoryConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    lease_s: float = 5.0
    swap_min_tokens: int = 256
    grace_s: float = 5.0


class MemoryServer:
    """A running memory service: its gRPC runtime, state and lease reaper."""

    def __init__(self, config: MemoryConfig) -> None:
        self.config = config
        manager = MemoryManager(mode_policy=ModePolicy(swap_min_tokens=config.swap_min_tokens))
        self.state = MemoryState(manager, lease_s=config.lease_s)
        self.runtime = ServiceRuntime("memory", host=config.host, port=config.port,
                                      metrics_port=config.metrics_port, grace_s=config.grace_s)
        self.runtime.add(memory_pb2_grpc.add_MemoryServiceServicer_to_server, MemoryServicer(self.state),
                         SERVICE_NAME)
        self._reaper: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return self.runtime.address

    async def start(self) -> MemoryServer:
        await self.runtime.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        await self.runtime.set_serving(True)
        return self

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.config.lease_s / 2))
            try:
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
        self.state.close()

    async def serve_until_signal(self) -> None:
        try:
            await self.runtime.serve_until_signal()
        finally:
            await self.stop()


async def start_memory_service(config: MemoryConfig | None = None) -> MemoryServer:
    return await MemoryServer(config or MemoryConfig()).start()
