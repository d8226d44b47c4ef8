"""gRPC clients of the memory service and the executors, as the engine sees
them: awaitable calls that raise kvpager domain errors, never grpc ones."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpager.channel import BoundedCalls, ClientTls, make_channel
from kvpager.errors import KvpagerError, Unavailable, error_for_status
from kvpager.prefix_index.hashing import namespace_digest
from kvpager.v1 import executor_pb2, executor_pb2_grpc, memory_pb2, memory_pb2_grpc


def _domain(exc: grpc.aio.AioRpcError, who: str) -> KvpagerError:
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNKNOWN):
        return Unavailable(f"{who}: {code.name}: {exc.details()}")
    return error_for_status(code.name, f"{who}: {exc.details()}")


class MemoryClient:
    def __init__(self, address: str, *, tls: ClientTls | None = None, token: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.channel = make_channel(address, tls=tls, token=token)
        self.stub = memory_pb2_grpc.MemoryServiceStub(self.channel)
        self._bound = BoundedCalls(64)

    async def _call(self, method, request, timeout_s: float | None = None):
        try:
            async with self._bound:
                return await method(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _domain(exc, f"memory service {self.address}") from None

    async def step(self, request: memory_pb2.StepRequest, timeout_s: float | None = None) -> memory_pb2.StepPlan:
        return await self._call(self.stub.Step, request, timeout_s)

    async def list_executors(self) -> list[memory_pb2.ExecutorPoolInfo]:
        return list((await self.registry()).executors)

    async def registry(self) -> memory_pb2.ListExecutorsResponse:
        """The executors registered, and the last Step applied."""
        return await self._call(self.stub.ListExecutors, memory_pb2.ListExecutorsRequest(), 5.0)

    async def score_prefix_hashes(self, block_hashes: bytes, namespace: bytes) -> list[memory_pb2.ExecutorScore]:
        """Scores of the executors of `namespace` for a prompt chain (packed 32-byte hashes)."""
        resp = await self._call(self.stub.ScorePrefix,
                                memory_pb2.ScorePrefixRequest(block_hashes=block_hashes, namespace=namespace), 5.0)
        return list(resp.scores)

    async def register(self, info: memory_pb2.ExecutorPoolInfo) -> None:
        await self._call(self.stub.RegisterExecutor, memory_pb2.RegisterExecutorRequest(info=info), 5.0)

    async def deregister(self, executor_id: str, incarnation: int) -> None:
        await self._call(self.stub.DeregisterExecutor,
                         memory_pb2.DeregisterExecutorRequest(executor_id=executor_id, incarnation=incarnation), 5.0)

    async def free(self, seq_ids: list[int], abort: bool) -> None:
        await self._call(self.stub.Free, memory_pb2.FreeRequest(seq_ids=seq_ids, abort=abort), 5.0)

    async def accounting(self) -> memory_pb2.AccountingSnapshot:
        return await self._call(self.stub.GetAccounting, memory_pb2.AccountingRequest(), 5.0)

    async def close(self) -> None:
        await self.channel.close()


class ExecutorClient:
    """One executor: its address, what it serves, and its Execute call."""

    def __init__(self, pool: memory_pb2.ExecutorPoolInfo, *, tls: ClientTls | None = None,
                 token: str | None = None, timeout_s: float = 120.0) -> None:
        self.pool = pool  # as registered: model id, dtype, adapter name the prefix-hash namespace
        self.executor_id = pool.executor_id
        self.address = pool.address
        self.incarnation = pool.incarnation
        self.block_size = pool.block_size
        self.num_blocks = pool.num_blocks
        # the prefix-hash namespace its blocks are indexed in (kvpager.prefix_index)
        self.namespace = namespace_digest(pool.model_id, pool.block_size, pool.dtype, pool.adapter)
        self.timeout_s = timeout_s
        self.channel = make_channel(pool.address, tls=tls, token=token)
        self.stub = executor_pb2_grpc.ExecutorServiceStub(self.channel)
        self.info: executor_pb2.ExecutorInfo | None = None
        self.alive = True

    async def load_info(self, timeout_s: float = 2.0) -> executor_pb2.ExecutorInfo:
        try:
            self.info = await self.stub.GetInfo(executor_pb2.GetInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _domain(exc, f"executor {self.executor_id} at {self.address}") from None
        return self.info

    async def serving(self, timeout_s: float = 2.0) -> bool:
        """Its health says SERVING (a draining or stopping executor does not)."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(),
                                                                          timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def execute(self, request: executor_pb2.ExecuteRequest, timeout_s: float | None = None,
                      on_part: Callable[[executor_pb2.ExecuteResponse], None] | None = None
                      ) -> executor_pb2.ExecuteResponse:
        """Execute; with ``on_part``, ExecuteStream (``execute_stream``)."""
        if on_part is not None:
            return await self.execute_stream(request, on_part, timeout_s)
        try:
            return await self.stub.Execute(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _domain(exc, f"executor {self.executor_id} at {self.address}") from None

    async def execute_stream(self, request: executor_pb2.ExecuteRequest,
                             on_part: Callable[[executor_pb2.ExecuteResponse], None],
                             timeout_s: float | None = None) -> executor_pb2.ExecuteResponse:
        """ExecuteStream: ``on_part`` gets each partial message (a burst's
        sub-step) as it comes; returns the whole response."""
        call = self.stub.ExecuteStream(request, timeout=timeout_s or self.timeout_s)
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                if not msg.partial:
                    return msg
                on_part(msg)
        except grpc.aio.AioRpcError as exc:
            raise _domain(exc, f"executor {self.executor_id} at {self.address}") from None
        except BaseException:  # cancelled (the gateway stops): the call goes too
            call.cancel()
            raise
        raise Unavailable(f"executor {self.executor_id} at {self.address}: the stream ended without its response")

    async def close(self) -> None:
        await self.channel.close()
