"""Several executors: prefix-aware routing, and an executor killed mid-stream."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from kvpager.prefix_index.hashing import PromptChain
from gateway_harness import generate, spawn_executor, start_stack, wait_port_serving

from kvpager.v1 import gateway_pb2, memory_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_repeated_prefix_goes_to_the_executor_that_holds_it(model):
    stack = await start_stack(model, executors=2, num_blocks=64, block_size=4)
    try:
        engine = stack.gateway.engine
        shared = list(range(40, 72))  # 8 full blocks
        first = await generate(stack.gw, shared + [1], max_tokens=2, ignore_eos=True)
        assert first[0][3].cached_prompt_tokens == 0
        scores = await stack.mem.ScorePrefix(memory_pb2.ScorePrefixRequest(
            token_ids=memoryview(bytes(__import__("array").array("i", shared + [2]))).tobytes()))
        holder = max(scores.scores, key=lambda s: s.hit_blocks).executor_id
        for i in range(4):
            res = await generate(stack.gw, shared + [2 + i], max_tokens=2, ignore_eos=True)
            assert res[0][3].cached_prompt_tokens == len(shared), f"request {i} missed the prefix"
        acc = await stack.mem.GetAccounting(memory_pb2.AccountingRequest(executor_id=holder))
        assert acc.total.prefix_hit_tokens == 4 * len(shared)
        # an unrelated prompt goes to the idle executor when the holder is busy
        assert len(engine.executors) == 2
        await stack.wait_idle()
    finally:
        await stack.stop()


async def test_routing_by_the_redis_mirror(model):
    from kvpager_tools.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    redis = RedisServer().start()
    stack = await start_stack(model, executors=2, num_blocks=64, block_size=4, redis_url=redis.url)
    try:
        shared = list(range(80, 112))  # 8 full blocks
        await generate(stack.gw, shared + [1], max_tokens=2, ignore_eos=True)
        router = stack.gateway.router
        deadline = time.monotonic() + 10
        while True:  # the mirror is write-behind: wait until it shows the prefix
            hits = await router._hits(PromptChain(shared + [2], ""), 5.0)
            if max(hits.values(), default=0) == len(shared):
                break
            assert time.monotonic() < deadline, hits
            await asyncio.sleep(0.05)
        assert router.prefix_reader is not None  # scored by Redis, not by the memory service
        for i in range(3):
            res = await generate(stack.gw, shared + [2 + i], max_tokens=2, ignore_eos=True)
            assert res[0][3].cached_prompt_tokens == len(shared), f"request {i} missed the prefix"
        await stack.wait_idle()
    finally:
        await stack.stop()
        redis.close()


async def test_executor_killed_mid_stream_moves_its_streams_to_the_survivor(model):
    """Its sequences are admitted again on the other executor (recompute): each
    stream pauses and ends with the tokens of an undisturbed run."""
    stack = await start_stack(model, executors=1, num_blocks=64, block_size=4)
    proc, address = spawn_executor(model, stack.memory.address, "victim", num_blocks=64, block_size=4)
    try:
        await wait_port_serving(address, 90)
        engine = stack.gateway.engine
        while "victim" not in engine.executors:
            await asyncio.sleep(0.05)
        router = stack.gateway.router
        prefix = list(range(200, 232))
        requests = [gateway_pb2.GenerateRequest(prompt_token_ids=prefix + [i],
                                                sampling_params=dict(max_tokens=120, ignore_eos=True,
                                                                     temperature=0.8 * (i % 2), seed=7 + i))
                    for i in range(3)]
        engine_choose = router.choose

        def steer(executor_id):
            async def choose(prompt_ids, cache_salt, deadline=None, chain=None):
                return executor_id
            router.choose = choose

        steer("executor-0")  # the undisturbed run, on the survivor
        want = [[t async for r in stack.gw.Generate(q) for t in r.token_ids] for q in requests]
        steer("victim")
        calls = [stack.gw.Generate(q) for q in requests]
        got = [list((await call.read()).token_ids) for call in calls]
        assert all(got)
        router.choose = engine_choose
        proc.send_signal(signal.SIGKILL)
        for call, tokens in zip(calls, got):
            while (r := await call.read()) is not grpc.aio.EOF:
                tokens += r.token_ids
        assert got == want
        assert engine.recovery.pending is False
        # its blocks are released and new requests go to the survivor
        deadline = time.monotonic() + 10
        while True:
            acc = await stack.mem.GetAccounting(memory_pb2.AccountingRequest())
            if acc.total.used_blocks == 0 and all(e.executor_id != "victim" for e in acc.executors):
                break
            assert time.monotonic() < deadline, acc
            await asyncio.sleep(0.05)
        res = await generate(stack.gw, [5, 6, 7], max_tokens=4, ignore_eos=True)
        assert len(res[0][0]) == 4
        assert list(engine.executors) == ["executor-0"]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        await stack.stop()


async def test_an_executor_that_refuses_a_step_ends_its_requests_only(model):
    """An executor refusing a step (not UNAVAILABLE: it did not die) is dropped
    and its requests end; the other executor's streams go on untouched (the
    loss's log line once raised and reset the whole engine)."""
    from kvpager.errors import FailedPrecondition

    stack = await start_stack(model, executors=2, num_blocks=64, block_size=4)
    try:
        engine, router = stack.gateway.engine, stack.gateway.router
        real_choose = router.choose

        def steer(executor_id):
            async def choose(prompt_ids, cache_salt, deadline=None, chain=None):
                return executor_id
            router.choose = choose

        def request(i):
            return gateway_pb2.GenerateRequest(prompt_token_ids=[40 + i, 41, 42],
                                               sampling_params=dict(max_tokens=60, ignore_eos=True))

        steer("executor-0")
        want = [t async for r in stack.gw.Generate(request(0)) for t in r.token_ids]
        survivor = stack.gw.Generate(request(0))
        got = list((await survivor.read()).token_ids)
        steer("executor-1")
        victim = stack.gw.Generate(request(1))
        assert (await victim.read()).token_ids
        router.choose = real_choose

        async def refuse(request, timeout_s=None, on_part=None):
            raise FailedPrecondition("executor executor-1: table of sequence 7 differs")

        refusing = engine.executors["executor-1"]
        refusing.execute = refuse
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await victim.read() is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.INTERNAL
        while (r := await survivor.read()) is not grpc.aio.EOF:
            got += r.token_ids
        assert got == want
        # The refusing client is dropped; the executor itself lives on, so its
        # lease may re-register it and a fresh client join at once.
        assert engine.executors.get("executor-1") is not refusing
        assert "executor-0" in engine.executors
    finally:
        await stack.stop()
