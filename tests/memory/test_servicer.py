"""The memory service over real gRPC (in-process aio server on loopback):
the happy path, and every bad input with its status code and no leak."""

from __future__ import annotations

import grpc
import pytest

from kvpager.channel import make_channel
from kvpager.packed import pack_i32, pack_i64, unpack_i32, unpack_i64
from kvpager.v1 import common_pb2, memory_pb2, memory_pb2_grpc
from plan_mirror import TableMirror, proto_view
from memory_service.service import MemoryConfig, MemoryServer

BS = 4


@pytest.fixture
async def memory():
    server = await MemoryServer(MemoryConfig(port=0, metrics_port=None)).start()
    channel = make_channel(server.address)
    stub = memory_pb2_grpc.MemoryServiceStub(channel)
    await stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
        executor_id="e0", num_blocks=16, block_size=BS, num_swap_blocks=8, model_id="m", dtype="float32",
        incarnation=1, pool_generation=1, max_model_len=48, vocab_size=100)))
    yield stub
    await channel.close()
    await server.stop(0)


def new_seq(seq_id, tokens, **kw):
    return memory_pb2.NewSequence(seq_id=seq_id, executor_id=kw.pop("executor_id", "e0"),
                                  prompt_token_ids=pack_i32(tokens), **kw)


def schedule(ids, nums):
    return dict(schedule_seq_ids=pack_i64(ids), schedule_num_tokens=pack_i32(nums))


def appended(ids, toks):
    return common_pb2.TokenBatch(seq_ids=pack_i64(ids), offsets=pack_i32(range(len(ids) + 1)),
                                 token_ids=pack_i32(toks))


async def accounting(stub, executor_id=""):
    snap = await stub.GetAccounting(memory_pb2.AccountingRequest(executor_id=executor_id))
    return snap.total


async def state(stub, executor_id="e0"):
    t = await accounting(stub, executor_id)
    return (t.free_blocks, t.used_blocks, t.num_sequences, t.live_tokens, t.logical_blocks)


async def test_step_plan_decode_fork_free_roundtrip(memory):
    stub = memory
    base = await accounting(stub)
    assert base.free_blocks == 16 and base.used_blocks == 0

    plan = await stub.Step(memory_pb2.StepRequest(step_id=1, new_sequences=[new_seq(1, range(10))],
                                                  **schedule([1], [10])))
    (ep,) = plan.executor_plans
    assert ep.executor_id == "e0" and ep.incarnation == 1 and ep.table_epoch
    assert list(unpack_i64(ep.seq_ids)) == [1]
    mirror = TableMirror(BS)  # the executor's tables, replayed from the plans' changes
    r = mirror.apply(proto_view(ep))[1]
    assert (r.context_len, r.query_len) == (0, 10)
    table = r.block_table
    assert list(unpack_i64(ep.tables.started_seq_ids)) == [1] and len(table) == 3  # the whole table, once
    assert r.slots == [table[p // BS] * BS + p % BS for p in range(10)]

    # decode one token, then fork into two children that share every block
    plan = await stub.Step(memory_pb2.StepRequest(step_id=2, appended=appended([1], [42]), **schedule([1], [1])))
    ep = plan.executor_plans[0]
    assert mirror.apply(proto_view(ep))[1].slots == [table[2] * BS + 2]
    assert not ep.tables.started_seq_ids and not ep.tables.extended_seq_ids  # no table change: none sent
    fork = await stub.Fork(memory_pb2.ForkRequest(fork=common_pb2.ForkOp(parent_seq_id=1, child_seq_ids=[2, 3])))
    assert fork.shared_blocks == 3 * 2
    t = await accounting(stub)
    assert t.logical_blocks == 9 and t.physical_blocks == 3 and t.sharing_saved_blocks == 6

    # children diverge: the shared partial block is copied for all but the last writer
    plan = await stub.Step(memory_pb2.StepRequest(step_id=3, appended=appended([1, 2, 3], [5, 6, 7]),
                                                  **schedule([1, 2, 3], [1, 1, 1])))
    ep = plan.executor_plans[0]
    ops = ep.cache_ops
    assert len(unpack_i32(ops.copy_src)) == 2 and set(unpack_i32(ops.copy_src)) == {table[2]}
    assert [(f.parent_seq_id, list(f.child_seq_ids)) for f in ep.tables.forks] == [(1, [2, 3])]
    rows = mirror.apply(proto_view(ep))
    assert {r.block_table[2] for r in rows.values()} == {table[2], *unpack_i32(ops.copy_dst)}

    released = await stub.Free(memory_pb2.FreeRequest(seq_ids=[1, 2, 3]))
    assert released.blocks_released == 5
    t = await accounting(stub)
    assert t.free_blocks == 16 and t.used_blocks == 0 and t.num_sequences == 0
    assert t.cached_blocks == 5  # 2 prompt blocks + each child's own full third block stay findable


async def test_prefix_hit_reported_and_scored(memory):
    stub = memory
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4
    await stub.Step(memory_pb2.StepRequest(step_id=1, new_sequences=[new_seq(1, prompt)], **schedule([1], [13])))
    plan = await stub.Step(memory_pb2.StepRequest(step_id=2, new_sequences=[new_seq(2, prompt)],
                                                  **schedule([2], [13])))
    ep = plan.executor_plans[0]
    assert list(unpack_i32(ep.tables.started_context_lens)) == [12] and list(unpack_i32(ep.query_lens)) == [1]
    assert list(unpack_i32(ep.started_cached_tokens)) == [12]
    scores = await stub.ScorePrefix(memory_pb2.ScorePrefixRequest(token_ids=pack_i32(prompt)))
    (s,) = scores.scores
    assert s.executor_id == "e0" and s.hit_blocks == 3 and s.hit_tokens == 12
    salted = await stub.ScorePrefix(memory_pb2.ScorePrefixRequest(token_ids=pack_i32(prompt), cache_salt="other"))
    assert salted.scores[0].hit_blocks == 0
    t = await accounting(stub)
    assert t.prefix_hit_tokens == 12 and t.prefix_query_tokens == 26


async def expect(code, coro):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() == code, err.value.details()
    assert err.value.details()
    return err.value


async def test_every_bad_input_gets_its_status_and_leaks_nothing(memory):
    stub = memory
    await stub.Step(memory_pb2.StepRequest(step_id=1, new_sequences=[new_seq(1, range(6))], **schedule([1], [6])))
    await stub.Free(memory_pb2.FreeRequest(seq_ids=[1]))
    await stub.Step(memory_pb2.StepRequest(step_id=2, new_sequences=[new_seq(5, range(6))], **schedule([5], [6])))
    before = await state(stub)
    S = grpc.StatusCode
    cases = [
        (S.NOT_FOUND, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, **schedule([99], [1])))),
        (S.NOT_FOUND, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, new_sequences=[new_seq(7, [1], executor_id="nope")]))),
        (S.NOT_FOUND, lambda: stub.Heartbeat(memory_pb2.HeartbeatRequest(executor_id="nope"))),
        (S.NOT_FOUND, lambda: stub.GetAccounting(memory_pb2.AccountingRequest(executor_id="nope"))),
        (S.NOT_FOUND, lambda: stub.Free(memory_pb2.FreeRequest(seq_ids=[12345]))),
        (S.ALREADY_EXISTS, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, new_sequences=[new_seq(5, [1, 2])]))),
        (S.ALREADY_EXISTS, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, new_sequences=[new_seq(8, [1]), new_seq(8, [2])]))),
        (S.ALREADY_EXISTS, lambda: stub.Fork(memory_pb2.ForkRequest(fork=common_pb2.ForkOp(parent_seq_id=5, child_seq_ids=[5])))),
        (S.FAILED_PRECONDITION, lambda: stub.Free(memory_pb2.FreeRequest(seq_ids=[1]))),
        (S.FAILED_PRECONDITION, lambda: stub.Free(memory_pb2.FreeRequest(seq_ids=[5, 5]))),
        (S.FAILED_PRECONDITION, lambda: stub.Fork(memory_pb2.ForkRequest(fork=common_pb2.ForkOp(parent_seq_id=1, child_seq_ids=[9])))),
        (S.FAILED_PRECONDITION, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, abort_seq_ids=pack_i64([1])))),
        (S.INVALID_ARGUMENT, lambda: stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(
            info=memory_pb2.ExecutorPoolInfo(executor_id="e1", num_blocks=0, block_size=4)))),
        (S.INVALID_ARGUMENT, lambda: stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(
            info=memory_pb2.ExecutorPoolInfo(executor_id="e1", num_blocks=4, block_size=0)))),
        (S.INVALID_ARGUMENT, lambda: stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(
            info=memory_pb2.ExecutorPoolInfo(executor_id="", num_blocks=4, block_size=4)))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, new_sequences=[new_seq(9, [1, -2, 3])]))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, new_sequences=[new_seq(9, [1, 100])]))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, new_sequences=[new_seq(9, [])]))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(
            step_id=3, new_sequences=[new_seq(9, [1, 2, 3], max_total_tokens=2)]))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, appended=appended([5], [-1]), **schedule([5], [1])))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, schedule_seq_ids=b"\x01\x02\x03",
                                                              schedule_num_tokens=pack_i32([1])))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, schedule_seq_ids=pack_i64([5]),
                                                              schedule_num_tokens=pack_i32([1, 1])))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, **schedule([5], [0])))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, **schedule([5, 5], [1, 1])))),
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, **schedule([5], [1])))),  # nothing to compute
        (S.INVALID_ARGUMENT, lambda: stub.Step(memory_pb2.StepRequest(step_id=3, appended=common_pb2.TokenBatch(
            seq_ids=pack_i64([5]), offsets=pack_i32([0, 3]), token_ids=pack_i32([1]))))),
        (S.INVALID_ARGUMENT, lambda: stub.ScorePrefix(memory_pb2.ScorePrefixRequest(token_ids=b"\x00\x01"))),
        (S.INVALID_ARGUMENT, lambda: stub.Fork(memory_pb2.ForkRequest(fork=common_pb2.ForkOp(parent_seq_id=5)))),
    ]
    for code, call in cases:  # one at a time: an aio call starts when created
        await expect(code, call())
        assert await state(stub) == before, f"{code} leaked"
    # a sequence that can never fit is refused at admission with RESOURCE_EXHAUSTED, as data
    await stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
        executor_id="tiny", num_blocks=2, block_size=4, max_model_len=64)))
    plan = await stub.Step(memory_pb2.StepRequest(step_id=3, new_sequences=[new_seq(20, range(9), executor_id="tiny"),
                                                                            new_seq(21, range(3))],
                                                  **schedule([20, 21], [9, 3])))
    (rej,) = plan.rejected
    assert rej.seq_id == 20 and rej.reason == common_pb2.REJECTION_REASON_OVER_POOL  # RESOURCE_EXHAUSTED
    assert list(unpack_i64(plan.executor_plans[0].seq_ids)) == [21]  # the other request is unharmed
    await stub.Free(memory_pb2.FreeRequest(seq_ids=[21]))
    assert await state(stub) == before
    assert (await accounting(stub, "tiny")).used_blocks == 0
    # and the rejected id was never created
    await expect(S.NOT_FOUND, stub.Free(memory_pb2.FreeRequest(seq_ids=[20])))


async def test_preemption_reported_over_grpc(memory):
    stub = memory
    # 16 blocks of 4: two 28-token sequences fill 14 blocks; growth forces a preemption
    await stub.Step(memory_pb2.StepRequest(step_id=1, new_sequences=[new_seq(1, [1] * 28), new_seq(2, [2] * 28)],
                                           **schedule([1, 2], [28, 28])))
    await stub.Step(memory_pb2.StepRequest(step_id=2, new_sequences=[new_seq(3, [3] * 8)], **schedule([3], [8])))
    plan = await stub.Step(memory_pb2.StepRequest(step_id=3, appended=appended([1, 2, 3], [4, 4, 4]),
                                                  **schedule([1, 2, 3], [1, 1, 1])))
    assert [p.seq_id for p in plan.preempted] == [3]
    assert plan.preempted[0].mode == common_pb2.PREEMPTION_MODE_RECOMPUTE
    assert list(unpack_i64(plan.unscheduled_seq_ids)) == [3]
    t = await accounting(stub)
    assert t.preemptions == 1 and t.preemptions_recompute == 1


async def test_watch_accounting_streams(memory):
    stub = memory
    stream = stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=100))
    seen = 0
    async for snap in stream:
        assert snap.total.total_blocks == 16
        seen += 1
        if seen == 3:
            break
    stream.cancel()
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 _first(stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=1))))


async def _first(stream):
    async for item in stream:
        return item


async def test_reregistration_with_new_incarnation_drops_sequences(memory):
    stub = memory
    await stub.Step(memory_pb2.StepRequest(step_id=1, new_sequences=[new_seq(1, range(6))], **schedule([1], [6])))
    resp = await stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
        executor_id="e0", num_blocks=16, block_size=BS, incarnation=2, pool_generation=1, max_model_len=48)))
    assert resp.replaced_previous
    t = await accounting(stub)
    assert t.used_blocks == 0 and t.num_sequences == 0
    await expect(grpc.StatusCode.FAILED_PRECONDITION, stub.Free(memory_pb2.FreeRequest(seq_ids=[1])))
    await expect(grpc.StatusCode.FAILED_PRECONDITION,
                 stub.Heartbeat(memory_pb2.HeartbeatRequest(executor_id="e0", incarnation=1)))


def test_steps_are_refused_while_the_mirror_is_restored():
    """A block allocated, written and freed during recovery could be restored
    with the hash of what it held before: Steps wait (UNAVAILABLE, retryable)."""
    from kvpager.errors import Unavailable
    from memory_service.records import StepInput
    from memory_service.service_state import MemoryState

    state = MemoryState()
    state.recovering = True
    with pytest.raises(Unavailable, match="mirror"):
        state.step(StepInput(step_id=1))
    state.recovering = False
    assert state.step(StepInput(step_id=1)).step_id == 1


async def test_measured_costs_arrive_with_heartbeats_and_explain_the_preemption(memory):
    stub = memory
    costs = memory_pb2.ExecutorCosts(prefill_batch_tokens=[8], prefill_tokens_per_s=[1000.0],
                                     swap_bytes_per_s=1e9, block_bytes=4096)
    await stub.Heartbeat(memory_pb2.HeartbeatRequest(executor_id="e0", incarnation=1, costs=costs))
    t = (await stub.GetAccounting(memory_pb2.AccountingRequest())).executors[0]  # per executor (total: 0)
    assert (t.prefill_tokens_per_s, t.swap_bytes_per_s) == (1000.0, 1e9)
    await stub.Step(memory_pb2.StepRequest(step_id=1, new_sequences=[new_seq(1, [1] * 28), new_seq(2, [2] * 28)],
                                           **schedule([1, 2], [28, 28])))
    await stub.Step(memory_pb2.StepRequest(step_id=2, new_sequences=[new_seq(3, [3] * 8)], **schedule([3], [8])))
    plan = await stub.Step(memory_pb2.StepRequest(step_id=3, appended=appended([1, 2, 3], [4, 4, 4]),
                                                  **schedule([1, 2, 3], [1, 1, 1])))
    (p,) = plan.preempted
    # 3's 8 computed tokens fill 2 cached blocks; the grower takes its tail block -> 4 to recompute
    assert (p.seq_id, p.mode, p.swap_bytes) == (3, common_pb2.PREEMPTION_MODE_SWAP, 2 * 4096)
    assert p.recompute_cost_s == pytest.approx(4 / 1000.0) and p.swap_cost_s == pytest.approx(2 * 2 * 4096 / 1e9)
    assert p.reason.startswith("swap ") and p.recompute_tokens == 4
    t = await accounting(stub)
    assert t.preempt_swap_bytes == 2 * 2 * 4096 and t.preempt_saved_s > 0
    # a malformed report is refused, and the last good one stays
    bad = memory_pb2.ExecutorCosts(prefill_batch_tokens=[8, 4], prefill_tokens_per_s=[1.0, 2.0])
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 stub.Heartbeat(memory_pb2.HeartbeatRequest(executor_id="e0", incarnation=1, costs=bad)))
    info = memory_pb2.ExecutorPoolInfo(executor_id="e9", num_blocks=4, block_size=BS, model_id="m", dtype="float32",
                                       incarnation=1, costs=memory_pb2.ExecutorCosts(swap_bytes_per_s=-1))
    await expect(grpc.StatusCode.INVALID_ARGUMENT, stub.RegisterExecutor(
        memory_pb2.RegisterExecutorRequest(info=info)))
    listed = await stub.ListExecutors(memory_pb2.ListExecutorsRequest())
    assert [e.executor_id for e in listed.executors] == ["e0"]
    assert (await stub.GetAccounting(memory_pb2.AccountingRequest())).executors[0].swap_bytes_per_s == 1e9
