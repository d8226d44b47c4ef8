"""The memory service with its mirror on, over real gRPC and a real
redis-server: Redis killed or hung mid-run never fails serving, restart
recovery of confirmed executors only (NOT_SERVING until rebuilt), AUTH/ACL
credentials, the reader agreeing with ScorePrefix, and off by default."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mirror_helpers import BS, Stepper, make_state, mirror_problems, spec, start_writer, sync_client

from kvpager.channel import make_channel
from kvpager.packed import pack_i32, pack_i64, unpack_i32
from kvpager.v1 import executor_pb2, executor_pb2_grpc, memory_pb2, memory_pb2_grpc
from memory_service import cli as memory_cli
from kvpager.prefix_index.reader import PrefixReader
from kvpager_tools.ports import free_port
from memory_service.service import MemoryConfig, MemoryServer

PROMPT = list(range(1, 14))  # 3 full blocks of 4 (+1 token that is always recomputed)


class FakeExecutor(executor_pb2_grpc.ExecutorServiceServicer):
    """Stands in for an executor: answers ConfirmPool only (`last_step_id`: the last Execute it "applied")."""

    def __init__(self, incarnation: int, pool_generation: int, *, confirm: bool = True,
                 last_step_id: int = 0) -> None:
        self.incarnation, self.pool_generation, self.confirm = incarnation, pool_generation, confirm
        self.last_step_id = last_step_id
        self.gate = asyncio.Event()
        self.gate.set()
        self.calls = 0

    async def ConfirmPool(self, request, context):
        self.calls += 1
        await self.gate.wait()
        ok = self.confirm and (request.incarnation, request.pool_generation) == (self.incarnation,
                                                                                 self.pool_generation)
        return executor_pb2.ConfirmPoolResponse(confirmed=ok, incarnation=self.incarnation,
                                                pool_generation=self.pool_generation,
                                                last_step_id=self.last_step_id)


async def serve_fake(fake: FakeExecutor) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    executor_pb2_grpc.add_ExecutorServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def pool_info(executor_id, incarnation=1, address="", pool_generation=1, num_blocks=32):
    return memory_pb2.ExecutorPoolInfo(executor_id=executor_id, address=address, num_blocks=num_blocks, block_size=BS,
                                       num_swap_blocks=4, model_id="m", dtype="float32", incarnation=incarnation,
                                       pool_generation=pool_generation, max_model_len=120, vocab_size=1000)


class Client:
    """A gRPC client of one memory service, with step/sequence ids."""

    def __init__(self, address: str) -> None:
        self.channel = make_channel(address)
        self.stub = memory_pb2_grpc.MemoryServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.step_id = 0
        self.seq_id = 0

    async def register(self, info) -> None:
        await self.stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=info))

    async def prefill(self, executor_id: str, tokens, free: bool = False) -> memory_pb2.StepPlan:
        self.step_id += 1
        self.seq_id += 1
        plan = await self.stub.Step(memory_pb2.StepRequest(
            step_id=self.step_id, schedule_seq_ids=pack_i64([self.seq_id]), schedule_num_tokens=pack_i32([len(tokens)]),
            new_sequences=[memory_pb2.NewSequence(seq_id=self.seq_id, executor_id=executor_id,
                                                  prompt_token_ids=pack_i32(tokens))]), timeout=2)
        if free:
            await self.stub.Free(memory_pb2.FreeRequest(seq_ids=[self.seq_id]), timeout=2)
        return plan

    async def scores(self, tokens) -> dict[str, int]:
        reply = await self.stub.ScorePrefix(memory_pb2.ScorePrefixRequest(token_ids=pack_i32(tokens)))
        return {s.executor_id: s.hit_blocks for s in reply.scores}

    async def snapshot(self) -> memory_pb2.AccountingSnapshot:
        return await self.stub.GetAccounting(memory_pb2.AccountingRequest(), timeout=2)

    async def wait_mirror(self, stale: bool, timeout_s: float = 10.0) -> memory_pb2.AccountingSnapshot:
        deadline = time.monotonic() + timeout_s
        while True:
            snap = await self.snapshot()
            if snap.mirror_stale == stale and (stale or snap.mirror_lag_events == 0):
                return snap
            assert time.monotonic() < deadline, f"mirror_stale never became {stale}"
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.channel.close()


def reader_for(url: str) -> PrefixReader:
    return PrefixReader(url, model_id="m", block_size=BS, dtype="float32")


async def test_redis_killed_mid_run_serving_never_fails_and_mirror_converges(redis_proc):
    server = await MemoryServer(MemoryConfig(port=0, redis_url=redis_proc.url)).start()
    c = Client(server.address)
    try:
        await c.register(pool_info("e0", num_blocks=256))
        await c.register(pool_info("e1", num_blocks=256))
        snap = await c.snapshot()
        assert snap.mirror_enabled
        for i in range(4):
            await c.prefill(f"e{i % 2}", [i] * 8 + PROMPT, free=i % 2 == 0)
        await c.wait_mirror(stale=False)
        await server.mirror.sync()
        assert mirror_problems(sync_client(redis_proc.url), server.state) == []
        known = [0] * 8 + PROMPT
        assert await c.scores(known) == {"e0": 5, "e1": 0}

        redis_proc.kill()
        for i in range(30):  # serving goes on while Redis is gone; no Step waits for it
            t0 = time.perf_counter()
            await c.prefill(f"e{i % 2}", [100 + i] * 5 + PROMPT, free=True)
            assert time.perf_counter() - t0 < 0.5
            await asyncio.sleep(0.01)
        snap = await c.wait_mirror(stale=True)
        assert snap.mirror_lag_events > 0
        assert await c.scores(known) == {"e0": 5, "e1": 0}  # from memory, unaffected

        redis_proc.start()  # an empty server on the same port: everything must be rebuilt
        await c.wait_mirror(stale=False, timeout_s=15)
        await server.mirror.sync()
        assert mirror_problems(sync_client(redis_proc.url), server.state) == []
        reader = reader_for(redis_proc.url)
        for tokens in (PROMPT, [3] * 8 + PROMPT, [105] * 5 + PROMPT):
            assert reader.score(tokens) == await c.scores(tokens)
        reader.close()
    finally:
        await c.close()
        await server.stop(0)


async def test_hung_redis_marks_the_mirror_stale_and_steps_keep_their_pace(redis_proc):
    state = make_state()
    writer = await start_writer(state, redis_proc.url, socket_timeout_s=0.2)
    state.register_executor(spec("e0", num_blocks=64, max_model_len=200))
    steps = Stepper(state)
    steps.prefill("e0", PROMPT)
    await writer.sync()
    os.kill(redis_proc.pid, signal.SIGSTOP)  # alive but answering nothing
    try:
        t_end = time.monotonic() + 1.5
        worst = 0.0
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            steps.prefill("e0", [steps.seq_id] * 6 + PROMPT)
            worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.005)
        assert writer.status().stale and writer.status().lag_events > 0
        assert worst < 0.05
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
    await writer.sync(timeout_s=15)
    assert mirror_problems(sync_client(redis_proc.url), state) == []
    await writer.stop()
    state.close()


async def test_restart_recovery_rebuilds_confirmed_executors_only(redis_proc):
    good = FakeExecutor(11, 3)
    refuses = FakeExecutor(21, 1, confirm=False)
    fakes = [await serve_fake(good), await serve_fake(refuses)]
    (_, good_addr), (_, refuses_addr) = fakes
    dead_addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    config = MemoryConfig(port=free_port(), redis_url=redis_proc.url, confirm_timeout_s=0.5)

    first = await MemoryServer(config).start()
    c = Client(first.address)
    await c.register(pool_info("e0", 11, good_addr, pool_generation=3))
    await c.register(pool_info("e1", 21, refuses_addr))
    await c.register(pool_info("e2", 31, dead_addr))
    for eid in ("e0", "e1", "e2"):
        await c.prefill(eid, PROMPT, free=True)
        await c.prefill(eid, [9] * 9, free=True)
    before = (await c.snapshot()).executors[0]
    assert before.executor_id == "e0" and before.cached_blocks == 5
    await first.mirror.sync()
    await c.close()
    await first.stop(0)

    good.last_step_id = 2  # e0 executed steps 1 and 2, all flushed: the step fence passes
    good.gate.clear()  # hold e0's confirmation: the new service must not serve yet
    second = MemoryServer(config)
    starting = asyncio.create_task(second.start())
    c = Client(second.address)
    try:
        while good.calls == 0:
            await asyncio.sleep(0.01)
        health = await c.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        good.gate.set()
        await starting
        health = await c.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        assert health.status == health_pb2.HealthCheckResponse.SERVING

        listed = (await c.stub.ListExecutors(memory_pb2.ListExecutorsRequest())).executors
        assert [(e.executor_id, e.incarnation, e.pool_generation, e.address, e.num_blocks) for e in listed] == [
            ("e0", 11, 3, good_addr, 32)]
        after = (await c.snapshot()).executors[0]
        assert (after.cached_blocks, after.used_blocks, after.free_blocks) == (5, 0, 32)
        assert await c.scores(PROMPT) == {"e0": 3}
        plan = await c.prefill("e0", PROMPT)  # a real prefix hit on the rebuilt index
        assert list(unpack_i32(plan.executor_plans[0].started_cached_tokens)) == [12]
        assert not second.state.manager.check_invariants()

        await second.mirror.sync()
        r = sync_client(redis_proc.url)
        assert mirror_problems(r, second.state) == []  # e1 and e2 are gone from the mirror
        reader = reader_for(redis_proc.url)
        assert reader.score(PROMPT) == {"e0": 3} == await c.scores(PROMPT)
        reader.close()
    finally:
        await c.close()
        await second.stop(0)
        for server, _ in fakes:
            await server.stop(0)


async def test_an_executor_registering_during_recovery_waits_and_its_cache_is_rebuilt(redis_proc):
    """The executor re-registers (its heartbeat found the old service gone)
    while the new service still connects its mirror, or confirms the pool.
    Registered at once, its empty pool would make the writer reset the
    executor's record, reverse index included, before recovery read it: a
    restart under load then rebuilt nothing (the memory-restart drill failed
    that way, now and then, in both windows)."""
    good = FakeExecutor(11, 3)
    server, addr = await serve_fake(good)
    config = MemoryConfig(port=free_port(), redis_url=redis_proc.url, confirm_timeout_s=2.0)
    first = await MemoryServer(config).start()
    c = Client(first.address)
    await c.register(pool_info("e0", 11, addr, pool_generation=3))
    await c.prefill("e0", PROMPT, free=True)
    await c.prefill("e0", [9] * 9, free=True)
    await first.mirror.sync()
    await c.close()
    await first.stop(0)

    good.last_step_id = 2
    good.gate.clear()
    second = MemoryServer(config)
    c = Client(second.address)
    os.kill(redis_proc.pid, signal.SIGSTOP)  # the new service's mirror connects slowly: its first window
    starting = asyncio.create_task(second.start())
    registering = None
    try:
        while True:  # serving RPCs (health NOT_SERVING) while the mirror still connects
            try:
                await c.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.2)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.01)
        registering = asyncio.ensure_future(c.register(pool_info("e0", 11, addr, pool_generation=3)))
        await asyncio.sleep(0.3)  # ample for a registration, were it let through
        assert not registering.done()
        os.kill(redis_proc.pid, signal.SIGCONT)
        while good.calls == 0:  # recovery asks the executor: the second window
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # ample for a registration and a mirror flush, were either let through
        assert not registering.done()
        assert second.state.manager.executors == {}
        good.gate.set()
        await starting
        await asyncio.wait_for(registering, 5)
        after = (await c.snapshot()).executors[0]
        assert (after.executor_id, after.cached_blocks, after.used_blocks) == ("e0", 5, 0)
        assert await c.scores(PROMPT) == {"e0": 3}
        await second.mirror.sync()
        assert mirror_problems(sync_client(redis_proc.url), second.state) == []
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
        if registering is not None:
            registering.cancel()
        await c.close()
        await second.stop(0)
        await server.stop(0)


async def test_password_and_acl_user_credentials(redis_factory, monkeypatch):
    protected = redis_factory(("--requirepass", "s3cret"), url_auth=":s3cret@")
    acl = redis_factory(("--user", "alice", "on", ">pw", "~kvp:*", "+@all", "-@dangerous",
                         "--user", "default", "off"),
                        url_auth="alice:pw@")
    bare_acl_url = acl.url.replace("alice:pw@", "")
    cases = [(protected.url, {}), (acl.url, {}),
             (bare_acl_url, {"KVPAGER_REDIS_USERNAME": "alice", "KVPAGER_REDIS_PASSWORD": "pw"})]
    for url, env in cases:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        server = await MemoryServer(MemoryConfig(port=0, redis_url=url)).start()
        c = Client(server.address)
        try:
            await c.register(pool_info("e0"))
            await c.prefill("e0", PROMPT, free=True)
            await c.wait_mirror(stale=False)
            reader = reader_for(url)
            assert reader.score(PROMPT) == {"e0": 3}
            reader.close()
        finally:
            await c.close()
            await server.stop(0)
        for k in env:
            monkeypatch.delenv(k)

    # wrong credentials: the mirror is stale, serving is not affected
    server = await MemoryServer(MemoryConfig(port=0, redis_url=protected.url.replace("s3cret", "nope"))).start()
    c = Client(server.address)
    try:
        await c.register(pool_info("e0"))
        await c.prefill("e0", PROMPT, free=True)
        assert (await c.wait_mirror(stale=True)).mirror_enabled
        assert await c.scores(PROMPT) == {"e0": 3}
    finally:
        await c.close()
        await server.stop(0)


async def test_mirror_is_off_by_default_and_the_cli_turns_it_on(monkeypatch):
    server = await MemoryServer(MemoryConfig(port=0)).start()
    try:
        assert server.mirror is None and not server.state.manager.events.enabled
        c = Client(server.address)
        snap = await c.snapshot()
        assert not snap.mirror_enabled and not snap.mirror_stale
        await c.close()
    finally:
        await server.stop(0)

    import argparse

    def parse(argv):
        p = argparse.ArgumentParser()
        memory_cli.add_arguments(p)
        return memory_cli.config_from_args(p.parse_args(argv))

    monkeypatch.delenv("KVPAGER_REDIS_URL", raising=False)
    assert parse([]).redis_url is None
    assert parse(["--redis-url", "redis://h:1/0"]).redis_url == "redis://h:1/0"
    monkeypatch.setenv("KVPAGER_REDIS_URL", "redis://env:2/0")
    assert parse([]).redis_url == "redis://env:2/0"


@pytest.mark.parametrize("n", [1])
async def test_reader_agrees_with_score_prefix_rpc(redis_proc, n):
    server = await MemoryServer(MemoryConfig(port=0, redis_url=redis_proc.url)).start()
    c = Client(server.address)
    try:
        base = list(range(200, 264))
        for i in range(4):
            await c.register(pool_info(f"e{i}", num_blocks=64))
            await c.prefill(f"e{i}", base[:BS * 3 * (i + 1) + 1], free=i % 2 == 1)
        await c.wait_mirror(stale=False)
        await server.mirror.sync()
        reader = reader_for(redis_proc.url)
        for cut in (0, 3, 5, 13, 25, 37, 49, 64):
            assert reader.score(base[:cut]) == await c.scores(base[:cut]), cut
        reader.close()
    finally:
        await c.close()
        await server.stop(0)


async def test_restart_recovery_keeps_prefix_hits_of_a_grouped_sliding_executor(redis_proc):
    """An executor with a table per KV group (a full and a sliding group of
    window 8): its registration (the groups) and every group's cached blocks
    (each group chained under its own root) come back from Redis, so the
    same prompt after a restart is a hit across both groups."""
    fake = FakeExecutor(41, 2)
    server, addr = await serve_fake(fake)
    config = MemoryConfig(port=free_port(), redis_url=redis_proc.url, confirm_timeout_s=0.5)
    info = pool_info("g0", 41, addr, pool_generation=2)
    info.kv_group_windows[:] = [0, 8]
    prompt = list(range(1, 34))  # 4x the window (+1): 8 full blocks per group
    first = await MemoryServer(config).start()
    c = Client(first.address)
    await c.register(info)
    await c.prefill("g0", prompt, free=True)
    before = (await c.snapshot()).executors[0]
    assert [g.window for g in before.kv_groups] == [0, 8] and before.cached_blocks == 16
    await first.mirror.sync()
    await c.close()
    await first.stop(0)

    fake.last_step_id = 1
    second = await MemoryServer(config).start()
    c = Client(second.address)
    try:
        (listed,) = (await c.stub.ListExecutors(memory_pb2.ListExecutorsRequest())).executors
        assert list(listed.kv_group_windows) == [0, 8]
        after = (await c.snapshot()).executors[0]
        assert [g.window for g in after.kv_groups] == [0, 8] and after.cached_blocks == 16
        plan = await c.prefill("g0", prompt)
        ep = plan.executor_plans[0]
        assert list(unpack_i32(ep.started_cached_tokens)) == [32]  # the longest hit both groups hold
        assert len(ep.group_tables) == 1
        assert not second.state.manager.check_invariants()
    finally:
        await c.close()
        await second.stop(0)
        await server.stop(0)
