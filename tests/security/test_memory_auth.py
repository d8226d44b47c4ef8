"""The memory service's admin token: every RPC needs it by default; with
open_read_only only the mutating ones (Register/Deregister/Heartbeat/Step/Fork/Free)."""

from __future__ import annotations

import grpc
import pytest

from kvpager.channel import auth_metadata, make_channel
from kvpager.v1 import common_pb2, memory_pb2, memory_pb2_grpc
from memory_service.service import MemoryConfig, MemoryServer

READ_ONLY = {
    "GetAccounting": memory_pb2.AccountingRequest(),
    "ListExecutors": memory_pb2.ListExecutorsRequest(),
    "ScorePrefix": memory_pb2.ScorePrefixRequest(),
}
MUTATING = {
    "RegisterExecutor": memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
        executor_id="e", num_blocks=8, block_size=4)),
    "Heartbeat": memory_pb2.HeartbeatRequest(executor_id="e"),
    "Step": memory_pb2.StepRequest(),
    "Fork": memory_pb2.ForkRequest(fork=common_pb2.ForkOp(parent_seq_id=1, child_seq_ids=[2])),
    "Free": memory_pb2.FreeRequest(seq_ids=[1]),
    "DeregisterExecutor": memory_pb2.DeregisterExecutorRequest(executor_id="e"),
}


async def code(stub, method, request, metadata):
    try:
        if method == "WatchAccounting":
            async for _ in stub.WatchAccounting(request, metadata=metadata, timeout=5):
                break
        else:
            await getattr(stub, method)(request, metadata=metadata, timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as err:
        return err.code()


@pytest.mark.parametrize("open_read_only", [False, True])
async def test_admin_token(open_read_only):
    server = await MemoryServer(MemoryConfig(port=0, admin_token="adm1n", open_read_only=open_read_only)).start()
    try:
        async with make_channel(server.address) as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            calls = {**READ_ONLY, "WatchAccounting": memory_pb2.WatchAccountingRequest(interval_ms=100)}
            for method, request in calls.items():
                got = await code(stub, method, request, None)
                want = grpc.StatusCode.OK if open_read_only else grpc.StatusCode.UNAUTHENTICATED
                assert got == want, method
            for method, request in MUTATING.items():
                for metadata in (None, auth_metadata("wrong")):
                    assert await code(stub, method, request, metadata) == grpc.StatusCode.UNAUTHENTICATED, method
                assert await code(stub, method, request, auth_metadata("adm1n")) != grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


async def test_read_only_token_opens_only_the_read_only_rpcs():
    server = await MemoryServer(MemoryConfig(port=0, admin_token="adm1n", read_only_token="v1ewer")).start()
    try:
        async with make_channel(server.address) as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            calls = {**READ_ONLY, "WatchAccounting": memory_pb2.WatchAccountingRequest(interval_ms=100)}
            for method, request in calls.items():
                assert await code(stub, method, request, None) == grpc.StatusCode.UNAUTHENTICATED, method
                assert await code(stub, method, request, auth_metadata("v1ewer")) == grpc.StatusCode.OK, method
                assert await code(stub, method, request, auth_metadata("adm1n")) == grpc.StatusCode.OK, method
            for method, request in MUTATING.items():
                assert await code(stub, method, request, auth_metadata("v1ewer")) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


def test_a_read_only_token_needs_an_admin_token_and_differs_from_it():
    from kvpager.security import memory_auth

    with pytest.raises(ValueError, match="needs an admin token"):
        memory_auth(None, False, "v1ewer")
    with pytest.raises(ValueError, match="differ from the admin token"):
        memory_auth("same", False, "same")
