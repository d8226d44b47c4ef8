"""Memory-service inputs the fuzz drill found or that could take it down:
refused with INVALID_ARGUMENT, cheaply, over a real server."""

from __future__ import annotations

import time

import grpc
import pytest

from kvpager.channel import make_channel
from kvpager.packed import pack_i32
from kvpager.v1 import memory_pb2, memory_pb2_grpc
from memory_service.service import MemoryConfig, MemoryServer


@pytest.fixture
async def memory():
    server = await MemoryServer(MemoryConfig(port=0)).start()
    async with make_channel(server.address) as channel:
        yield memory_pb2_grpc.MemoryServiceStub(channel)
    await server.stop(0)


def info(**kw):
    kw.setdefault("executor_id", "e")
    kw.setdefault("num_blocks", 8)
    kw.setdefault("block_size", 4)
    return memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(**kw))


@pytest.mark.parametrize("fields", [dict(num_blocks=2**32 - 1), dict(num_swap_blocks=2**32 - 1),
                                    dict(num_blocks=(1 << 22) + 1), dict(block_size=2**32 - 1)])
async def test_huge_pools_are_refused_at_once(memory, fields):
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await memory.RegisterExecutor(info(**fields), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert time.monotonic() - t0 < 1.0


async def test_score_prefix_with_negative_tokens_is_invalid_argument(memory):
    await memory.RegisterExecutor(info(), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # was INTERNAL (uint32 packing of the hash)
        await memory.ScorePrefix(memory_pb2.ScorePrefixRequest(token_ids=pack_i32([-1, 5, 6, 7, 8])), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reply = await memory.ScorePrefix(memory_pb2.ScorePrefixRequest(token_ids=pack_i32([5, 6, 7, 8, 9])), timeout=5)
    assert reply.scores[0].hit_blocks == 0
