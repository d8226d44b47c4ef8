"""make_channel(token=...) sends the token on every kind of call. It used to
reach unary calls only: grpc.aio files an interceptor under the first call
kind it implements, so a streaming Generate with a token was UNAUTHENTICATED."""

from __future__ import annotations

import grpc

from kvpager.auth import TokenAuth
from kvpager.channel import make_channel
from kvpager.server import ServiceRuntime
from kvpager.v1 import memory_pb2, memory_pb2_grpc
from memory_service.service_state import MemoryState
from memory_service.servicer import MemoryServicer


async def test_token_reaches_unary_and_streaming_calls():
    state = MemoryState()
    runtime = ServiceRuntime("memory", auth=TokenAuth("t0ken"))
    runtime.add(memory_pb2_grpc.add_MemoryServiceServicer_to_server, MemoryServicer(state), "kvpager.v1.MemoryService")
    await runtime.start()
    try:
        async with make_channel(runtime.address, token="t0ken") as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            await stub.GetAccounting(memory_pb2.AccountingRequest(), timeout=5)
            async for snapshot in stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=100), timeout=5):
                assert snapshot.time_s > 0
                break
        async with make_channel(runtime.address) as channel:  # and without it: refused
            try:
                async for _ in memory_pb2_grpc.MemoryServiceStub(channel).WatchAccounting(
                        memory_pb2.WatchAccountingRequest(interval_ms=100), timeout=5):
                    break
                raise AssertionError("a stream without the token was served")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await runtime.stop(0)
        state.close()
