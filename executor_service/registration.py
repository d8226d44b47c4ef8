"""Keeps this executor registered with the memory service.

Register (retrying with capped exponential backoff while the memory service
is not up yet), then heartbeat every ``lease_s / 3``. A NOT_FOUND or
FAILED_PRECONDITION heartbeat means the memory service forgot us (it
restarted, or our lease expired): register again. Other failures are retried
on the same schedule; the executor keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import grpc

from kvpager.channel import ClientTls, make_channel
from kvpager.telemetry import get_logger
from kvpager.v1 import memory_pb2, memory_pb2_grpc

log = get_logger(__name__)

_REREGISTER = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


class MemoryRegistration:
    """A background task: register, heartbeat, re-register when forgotten.

    Args:
        memory_address: MemoryService host:port.
        pool_info: builds the current ExecutorPoolInfo (called per registration).
        on_registered: called after every successful registration.
        backoff_max_s: ceiling of the retry delay.
        rpc_timeout_s: deadline of each call.
        tls: TLS to the memory service (None = insecure).
        token: the admin token the memory service requires (None = none).
    """

    def __init__(
        self,
        memory_address: str,
        pool_info: Callable[[], memory_pb2.ExecutorPoolInfo],
        *,
        on_registered: Callable[[], None] | None = None,
        backoff_max_s: float = 5.0,
        rpc_timeout_s: float = 5.0,
        tls: ClientTls | None = None,
        token: str | None = None,
    ) -> None:
        self.memory_address = memory_address
        self.pool_info = pool_info
        self.on_registered = on_registered
        self.backoff_max_s = backoff_max_s
        self.rpc_timeout_s = rpc_timeout_s
        self._tls = tls
        self._token = token
        self.lease_s: float | None = None
        self.num_registrations = 0
        self.registered = asyncio.Event()
        self._channel = None
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self._channel = make_channel(self.memory_address, tls=self._tls, token=self._token)
        self._stub = memory_pb2_grpc.MemoryServiceStub(self._channel)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="memory-registration")
        return self._task

    async def stop(self, *, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if deregister and self.registered.is_set() and self._channel is not None:
            info = self.pool_info()
            try:
                await self._stub.DeregisterExecutor(
                    memory_pb2.DeregisterExecutorRequest(executor_id=info.executor_id, incarnation=info.incarnation),
                    timeout=1.0,
                )
            except grpc.aio.AioRpcError as err:  # best effort: the lease expires anyway
                log.info("deregister failed", code=err.code().name)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def _register(self) -> None:
        delay = 0.05
        while True:
            info = self.pool_info()
            try:
                reply = await self._stub.RegisterExecutor(
                    memory_pb2.RegisterExecutorRequest(info=info), timeout=self.rpc_timeout_s
                )
            except grpc.aio.AioRpcError as err:
                log.info("register failed; retrying", code=err.code().name, retry_in_s=round(delay, 3),
                         memory=self.memory_address)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.backoff_max_s)
                continue
            self.lease_s = reply.lease_s if reply.lease_s > 0 else 10.0
            self.num_registrations += 1
            log.info("registered with memory service", memory=self.memory_address, executor_id=info.executor_id,
                     incarnation=info.incarnation, lease_s=self.lease_s, replaced=reply.replaced_previous)
            self.registered.set()
            if self.on_registered is not None:
                self.on_registered()
            return

    async def _run(self) -> None:
        await self._register()
        while True:
            await asyncio.sleep(self.lease_s / 3)
            info = self.pool_info()
            try:
                reply = await self._stub.Heartbeat(
                    memory_pb2.HeartbeatRequest(executor_id=info.executor_id, incarnation=info.incarnation,
                                                costs=info.costs),  # its newest measurements
                    timeout=self.rpc_timeout_s,
                )
                if reply.lease_s > 0:
                    self.lease_s = reply.lease_s
            except grpc.aio.AioRpcError as err:
                if err.code() in _REREGISTER:
                    log.warning("memory service forgot this executor; re-registering", code=err.code().name)
                    await self._register()
                else:
                    log.info("heartbeat failed", code=err.code().name)
