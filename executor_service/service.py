"""Starting an executor's gRPC server from Python (the CLI uses this too).

    server = await start_executor_server(ExecutorConfig(model=path, num_blocks=256))
    stub = executor_pb2_grpc.ExecutorServiceStub(make_channel(server.address))
    ...
    await server.stop()

The server listens (health NOT_SERVING) while the model loads on a worker
thread; it turns SERVING once the model and pool are ready and, when a memory
address is configured, the executor is registered there.
"""

from __future__ import annotations

import asyncio

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.servicer import ExecutorServicer
from kvpager.server import ServiceRuntime
from kvpager.telemetry import get_logger
from kvpager.v1 import executor_pb2_grpc, memory_pb2

SERVICE_NAME = "kvpager.v1.ExecutorService"
log = get_logger(__name__)


class ExecutorServer:
    """One running executor: its ServiceRuntime, Executor and registration.

    Unpacks as ``runtime, executor = server``.
    """

    def __init__(self, config: ExecutorConfig, runtime: ServiceRuntime, servicer: ExecutorServicer) -> None:
        self.config = config
        self.runtime = runtime
        self.servicer = servicer
        self.executor: Executor | None = None
        self.registration = None  # MemoryRegistration when memory_address is set
        self._ready_task: asyncio.Task | None = None

    def __iter__(self):
        return iter((self.runtime, self.executor))

    @property
    def address(self) -> str:
        return self.runtime.address

    @property
    def advertise_address(self) -> str:
        return self.config.advertise_address or self.runtime.address

    def pool_info(self) -> memory_pb2.ExecutorPoolInfo:
        ex = self.executor
        info = ex.info()
        return memory_pb2.ExecutorPoolInfo(
            executor_id=info.executor_id,
            address=self.advertise_address,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            num_swap_blocks=info.num_swap_blocks,
            model_id=info.model_id,
            dtype=info.dtype,
            incarnation=info.incarnation,
            pool_generation=info.pool_generation,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            costs=self.costs(),
            # A table per KV group: the memory service keeps each group's tables (window frees).
            kv_group_windows=[w for w, _ in info.kv_groups] if info.kv_layout == "hybrid" else [],
        )

    def costs(self) -> memory_pb2.ExecutorCosts:
        """What the executor measured so far (registration and every heartbeat)."""
        c = self.executor.costs.snapshot()
        return memory_pb2.ExecutorCosts(prefill_batch_tokens=c.prefill_batch_tokens,
                                        prefill_tokens_per_s=c.prefill_tokens_per_s,
                                        swap_bytes_per_s=c.swap_bytes_per_s, block_bytes=c.block_bytes)

    async def _become_ready(self, executor: Executor | None) -> None:
        if executor is None:
            executor = await asyncio.to_thread(Executor, self.config)
        self.executor = executor
        self.servicer.attach(executor)
        log.info("executor ready", **_ready_fields(executor))
        if self.config.memory_address:
            from executor_service.registration import MemoryRegistration

            self.registration = MemoryRegistration(
                self.config.memory_address,
                self.pool_info,
                on_registered=lambda: self.runtime.set_serving(True),
                backoff_max_s=self.config.register_backoff_max_s,
                tls=self.config.client_tls,
                token=self.config.admin_token,
            )
            self.registration.start()
            await self.registration.registered.wait()
        else:
            await self.runtime.set_serving(True)

    async def wait_ready(self) -> None:
        await asyncio.shield(self._ready_task)

    async def stop(self, grace_s: float | None = None) -> None:
        if self._ready_task is not None and not self._ready_task.done():
            self._ready_task.cancel()
        if self.registration is not None:
            await self.registration.stop(deregister=True)
        await self.runtime.stop(grace_s)
        self.servicer.close()

    async def serve_until_signal(self) -> None:
        await self.runtime.serve_until_signal()


def _ready_fields(executor: Executor) -> dict:
    info = executor.info()
    return {
        "executor_id": info.executor_id,
        "model_id": info.model_id,
        "device": info.device,
        "dtype": info.dtype,
        "backend": info.attention_backend,
        "model_impl": info.model_impl,
        "num_blocks": info.num_blocks,
        "num_swap_blocks": info.num_swap_blocks,
        "kv_pool_bytes": info.kv_pool_bytes,
        "kv_pool_huge_page_bytes": executor.kv_pool_huge_bytes,
        "incarnation": info.incarnation,
    }


async def start_executor_server(
    config: ExecutorConfig, *, executor: Executor | None = None, wait_ready: bool = True
) -> ExecutorServer:
    """Bind and start the gRPC server, then load the model (unless an
    ``executor`` is passed) and register with the memory service if
    configured. Returns once ready when ``wait_ready`` (the default)."""
    from kvpager.security import token_auth

    runtime = ServiceRuntime(
        "executor",
        host=config.host,
        port=config.port,
        metrics_port=config.metrics_port,
        metrics_host=config.metrics_host,
        grace_s=config.grace_s,
        tls=config.tls,
        auth=token_auth(config.admin_token),
    )
    servicer = ExecutorServicer()
    runtime.add(executor_pb2_grpc.add_ExecutorServiceServicer_to_server, servicer, SERVICE_NAME)
    server = ExecutorServer(config, runtime, servicer)
    await runtime.start()
    server._ready_task = asyncio.get_running_loop().create_task(server._become_ready(executor))
    if wait_ready:
        try:
            await server.wait_ready()
        except BaseException:
            await server.stop(0)
            raise
    return server
