"""The executor with the real memory service: registration with retry while
memory is not up, health gating, re-registration after a memory restart,
deregistration on stop, and a greedy run planned by the memory service that
matches transformers' generate (prefix hit included)."""

from __future__ import annotations

import asyncio

import pytest

from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_harness import prompts
from executor_service.config import ExecutorConfig
from executor_service.service import start_executor_server
from kvpager import packed
from kvpager_tools.ports import free_port
from kvpager.channel import make_channel
from kvpager.v1 import executor_pb2, executor_pb2_grpc, memory_pb2, memory_pb2_grpc
from memory_service.service import MemoryConfig, MemoryServer

CKPT = "llama_gqa"
BS = 4


async def _health(address: str) -> int:
    async with make_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def _until(pred, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _executors(address: str) -> list:
    async with make_channel(address) as ch:
        return list((await memory_pb2_grpc.MemoryServiceStub(ch).ListExecutors(
            memory_pb2.ListExecutorsRequest(), timeout=5)).executors)


async def test_registers_when_memory_comes_up_and_after_it_restarts(checkpoints):
    port = free_port()
    memory_address = f"127.0.0.1:{port}"
    cfg = ExecutorConfig(model=checkpoints(CKPT), executor_id="reg-test", num_blocks=32, block_size=BS,
                         swap_blocks=8, device="cpu", dtype="float32", memory_address=memory_address,
                         register_backoff_max_s=0.2)
    server = await start_executor_server(cfg, wait_ready=False)
    memory = None
    try:
        await asyncio.sleep(1.0)  # memory is not up: still loading or retrying, never SERVING
        assert await _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        memory = await MemoryServer(MemoryConfig(port=port, lease_s=0.6)).start()
        await asyncio.wait_for(server.wait_ready(), 30)
        await _until(lambda: _is_serving(server.address))
        (info,) = await _executors(memory_address)
        ex = server.executor
        assert (info.executor_id, info.address) == ("reg-test", server.address)
        assert (info.num_blocks, info.block_size, info.num_swap_blocks) == (32, BS, 8)
        assert (info.incarnation, info.pool_generation) == (ex.incarnation, 1)
        # the model allows 256 positions; the 32-block pool holds 128 tokens: the limit is what fits
        assert (info.max_model_len, info.vocab_size, info.dtype) == (32 * BS, 320, "float32")
        assert info.model_id == CKPT
        # it registered with its start-up probe's copy bandwidth; what it measures later comes with heartbeats
        costs = memory.state.manager.costs["reg-test"]
        assert costs.swap_bytes_per_s > 0 and costs.block_bytes == ex.pool.block_bytes
        ex.costs.record_forward(64, 0.5)
        await _until(lambda: _has_point(memory, "reg-test", 64))
        assert memory.state.manager.costs["reg-test"].prefill_s(64) == pytest.approx(0.5)

        # Memory restarts empty: the next heartbeat gets NOT_FOUND -> re-register.
        registrations = server.registration.num_registrations
        await memory.stop(0)
        memory = await MemoryServer(MemoryConfig(port=port, lease_s=0.6)).start()

        async def reregistered():
            return server.registration.num_registrations > registrations and len(await _executors(memory_address)) == 1

        await _until(reregistered)
        assert await _health(server.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
        if memory is not None:
            assert await _executors(memory_address) == []  # deregistered on stop
            await memory.stop(0)


async def _has_point(memory, executor_id: str, batch_tokens: int) -> bool:
    return batch_tokens in memory.state.manager.costs[executor_id].prefill_batch_tokens


async def _is_serving(address: str) -> bool:
    return await _health(address) == health_pb2.HealthCheckResponse.SERVING


async def test_memory_planned_greedy_run_matches_generate(checkpoints, oracle):
    memory = await MemoryServer(MemoryConfig(port=0, lease_s=30)).start()
    cfg = ExecutorConfig(model=checkpoints(CKPT), executor_id="e2e", num_blocks=48, block_size=BS,
                         swap_blocks=8, device="cpu", dtype="float32", memory_address=memory.address)
    server = await start_executor_server(cfg)
    try:
        async with make_channel(memory.address) as mch, make_channel(server.address) as ech:
            mem = memory_pb2_grpc.MemoryServiceStub(mch)
            exe = executor_pb2_grpc.ExecutorServiceStub(ech)
            [prefix] = prompts(1, [3 * BS], seed=41)
            tokens = {1: prefix + [10, 11], 2: prefix + [20, 21, 22]}
            plen = {k: len(v) for k, v in tokens.items()}
            computed: dict[int, int] = {}  # what the executor holds for each sequence, as the plans say
            step_id = 0

            async def step(new=(), schedule=(), appended=None):
                nonlocal step_id
                step_id += 1
                ids = [s for s, _ in schedule]
                nums = [n for _, n in schedule]
                req = memory_pb2.StepRequest(
                    step_id=step_id,
                    new_sequences=[memory_pb2.NewSequence(seq_id=s, executor_id="e2e",
                                                          prompt_token_ids=packed.pack_i32(tokens[s])) for s in new],
                    schedule_seq_ids=packed.pack_i64(ids), schedule_num_tokens=packed.pack_i32(nums))
                if appended:
                    req.appended.seq_ids = packed.pack_i64(list(appended))
                    req.appended.offsets = packed.pack_i32(range(len(appended) + 1))
                    req.appended.token_ids = packed.pack_i32(list(appended.values()))
                plan = await mem.Step(req, timeout=10)
                (ep,) = plan.executor_plans
                seq_ids = list(packed.unpack_i64(ep.seq_ids))
                starts = dict(zip(packed.unpack_i64(ep.tables.started_seq_ids),
                                  packed.unpack_i32(ep.tables.started_context_lens)))
                ctx = [starts.get(s, computed.get(s, 0)) for s in seq_ids]
                q = list(packed.unpack_i32(ep.query_lens))
                toks = [t for s, c, n in zip(seq_ids, ctx, q) for t in tokens[s][c:c + n]]
                resp = await exe.Execute(executor_pb2.ExecuteRequest(
                    step_id=step_id, incarnation=ep.incarnation, plan=ep, context_lens=packed.pack_i32(ctx),
                    token_ids=packed.pack_i32(toks)), timeout=30)
                for s, c, n in zip(seq_ids, ctx, q):
                    computed[s] = c + n
                sampled = dict(zip(seq_ids, packed.unpack_i32(resp.sampled_token_ids)))
                for s, t in sampled.items():
                    tokens[s].append(t)
                return ctx, sampled

            _, out = await step(new=[1], schedule=[(1, plen[1])])
            ctx, out = await step(new=[2], schedule=[(1, 1), (2, plen[2])], appended=out)
            assert ctx[1] == 3 * BS  # the prefix blocks were a cache hit
            for _ in range(4):
                _, out = await step(schedule=[(1, 1), (2, 1)], appended=out)
            assert tokens[1][plen[1]:] == oracle(CKPT).greedy(tokens[1][:plen[1]], 6)
            # every forward was timed: the decode steps (2 tokens) and the prefills have their buckets
            assert {2, 8} <= set(server.executor.costs.snapshot().prefill_batch_tokens)
            assert tokens[2][plen[2]:] == oracle(CKPT).greedy(tokens[2][:plen[2]], 5)
    finally:
        await server.stop(0)
        await memory.stop(0)
