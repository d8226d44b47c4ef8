"""The three services in this process, on one event loop and loopback gRPC,
for tests that look inside them (the engine, the manager). ``Stack``
(kvpager_tools.stack) runs them as child processes instead."""

from __future__ import annotations

import asyncio
import dataclasses


@dataclasses.dataclass
class InProcessStack:
    """The three services in this process, on one event loop and loopback gRPC:
    for tests that look inside them (the engine, the manager). ``Stack`` runs
    them as child processes instead."""

    memory: object      # memory_service.service.MemoryServer
    executors: list     # executor_service.service.ExecutorServer each
    gateway: object     # gateway.service.GatewayServer
    channels: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        from kvpager.channel import make_channel
        from kvpager.v1 import gateway_pb2_grpc, memory_pb2_grpc

        gch = make_channel(self.gateway.address)
        mch = make_channel(self.memory.address)
        self.channels = [gch, mch]
        self.gw = gateway_pb2_grpc.GatewayStub(gch)
        self.mem = memory_pb2_grpc.MemoryServiceStub(mch)

    async def accounting(self):
        from kvpager.v1 import memory_pb2

        return (await self.mem.GetAccounting(memory_pb2.AccountingRequest())).total

    async def wait_idle(self, timeout_s: float = 10.0):
        """Until every block is free (finished/aborted sequences are released
        in the step after they end)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            t = await self.accounting()
            if t.used_blocks == 0 and t.num_sequences == 0 and t.num_swapped_sequences == 0:
                return t
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"blocks not released: {t}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        for ch in self.channels:
            await ch.close()
        await self.gateway.stop(0)
        for ex in self.executors:
            await ex.stop(0)
        await self.memory.stop(0)


async def start_in_process(model: str, *, executors: int = 1, num_blocks: int = 96, block_size: int = 4,
                           swap_blocks: int = 64, swap_min_tokens: int = 256, preemption_mode: str = "cost",
                           redis_url: str | None = None, http: dict | None = None, gateway_kw: dict | None = None,
                           metrics: bool = False, memory_kw: dict | None = None,
                           executor_kw: dict | None = None, **engine_kw) -> InProcessStack:
    """Memory service, ``executors`` executors and a gateway (EngineConfig ``engine_kw``) in this
    process; returns once the gateway routes to every executor. ``http``: serve the HTTP API
    on a free port (HttpConfig fields; ``gateway.http_url``), else none; ``gateway_kw``,
    ``memory_kw``, ``executor_kw``: more GatewayConfig / MemoryConfig / ExecutorConfig fields; ``metrics``: every service serves
    /metrics on a free port (``<server>.runtime.metrics_port``)."""
    import asyncio

    from executor_service.config import ExecutorConfig
    from executor_service.service import start_executor_server
    from gateway.engine_config import EngineConfig
    from gateway.http.server import HttpConfig
    from gateway.service import GatewayConfig, GatewayServer
    from memory_service.service import MemoryConfig, MemoryServer

    mport = 0 if metrics else None
    memory = await MemoryServer(MemoryConfig(port=0, swap_min_tokens=swap_min_tokens,
                                             preemption_mode=preemption_mode, redis_url=redis_url,
                                             metrics_port=mport, **(memory_kw or {}))).start()
    exs = []
    for i in range(executors):
        exs.append(await start_executor_server(ExecutorConfig(
            model=model, executor_id=f"executor-{i}", memory_address=memory.address, num_blocks=num_blocks,
            block_size=block_size, swap_blocks=swap_blocks, metrics_port=mport,
            **{"kv_layout": "auto", **(executor_kw or {})})))  # auto: as `kvpager up` serves (the CLI's default)
    engine_kw.setdefault("executor_refresh_s", 0.2)
    http_config = HttpConfig(**{"port": 0, **http}) if http is not None else None
    gateway = await GatewayServer(GatewayConfig(model=model, memory_address=memory.address, port=0,
                                                redis_url=redis_url, engine=EngineConfig(**engine_kw),
                                                http=http_config, metrics_port=mport,
                                                **(gateway_kw or {}))).start()
    await gateway.wait_ready(30)
    while len(gateway.engine.executors) < executors:
        await asyncio.sleep(0.05)
    return InProcessStack(memory, exs, gateway)
