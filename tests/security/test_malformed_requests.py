"""Bytes that do not parse as the method's request are INVALID_ARGUMENT on
every kind of method (grpc alone answers UNKNOWN), and auth still comes first."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

from kvpager.auth import TokenAuth
from kvpager.server import ServiceRuntime
from kvpager.v1 import memory_pb2_grpc
from memory_service.service_state import MemoryState
from memory_service.servicer import MemoryServicer

GARBAGE = b"\xff\xff\xff\x0f\x12"  # a truncated varint: never a valid message
S = grpc.StatusCode


async def _call(channel, method: str, kind: str):
    try:
        if kind == "unary_unary":
            await channel.unary_unary(method)(GARBAGE, timeout=5)
        elif kind == "unary_stream":
            async for _ in channel.unary_stream(method)(GARBAGE, timeout=5):
                pass
        else:
            async for _ in channel.stream_stream(method)(iter([GARBAGE]), timeout=5):
                pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return S.OK


METHODS = [
    ("/kvpager.v1.MemoryService/Step", "unary_unary"),
    ("/kvpager.v1.MemoryService/WatchAccounting", "unary_stream"),
    ("/grpc.health.v1.Health/Check", "unary_unary"),
    ("/grpc.health.v1.Health/Watch", "unary_stream"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream_stream"),
]


@pytest.mark.parametrize("auth", [None, "token"])
async def test_garbage_is_invalid_argument_or_unauthenticated(auth):
    state = MemoryState()
    runtime = ServiceRuntime("memory", auth=TokenAuth(auth) if auth else None)
    runtime.add(memory_pb2_grpc.add_MemoryServiceServicer_to_server, MemoryServicer(state), "kvpager.v1.MemoryService")
    await runtime.start()
    try:
        async with grpc.aio.insecure_channel(runtime.address) as channel:
            for method, kind in METHODS:
                code = await _call(channel, method, kind)
                open_method = not method.startswith("/kvpager.")
                want = S.UNAUTHENTICATED if auth and not open_method else S.INVALID_ARGUMENT
                assert code == want, (method, code)
            assert await _call(channel, "/kvpager.v1.MemoryService/Nope", "unary_unary") == S.UNIMPLEMENTED
    finally:
        await runtime.stop(0)
        state.close()
