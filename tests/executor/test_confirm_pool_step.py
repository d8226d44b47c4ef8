"""ConfirmPool reports the step_id of the last Execute the pool applied
(restart recovery's step fence, docs/mirror.md): a rejected step changes
nothing, a failed step starts a new generation that has applied nothing."""

from __future__ import annotations

import grpc
import pytest
import torch

from executor_harness import Plan, prompts
from kvpager import packed
from kvpager.v1 import common_pb2, executor_pb2

CKPT = "llama_gqa"


def _confirm(served) -> executor_pb2.ConfirmPoolResponse:
    ex = served.executor
    reply = served.stub.ConfirmPool(executor_pb2.ConfirmPoolRequest(
        incarnation=ex.incarnation, pool_generation=ex.pool_generation), timeout=10)
    assert reply.confirmed
    return reply


def test_confirm_pool_reports_the_last_applied_step(serve, monkeypatch):
    served = serve(CKPT, executor_id="step-fence")  # its own executor: no other test's steps
    assert _confirm(served).last_step_id == 0  # nothing applied yet

    plan = Plan(served)
    [p] = prompts(1, [6], seed=41)
    a = plan.new_seq(p)
    req = plan.request([(a, 6)])
    req.step_id = 1_000_007
    served.stub.Execute(req, timeout=30)
    assert _confirm(served).last_step_id == 1_000_007

    ops_only = executor_pb2.ExecuteRequest(step_id=1_000_009, plan=common_pb2.ExecutorPlan(
        table_epoch=plan.epoch, cache_ops=common_pb2.CacheOps(swap_out_src=packed.pack_i32([3]),
                                                              swap_out_dst=packed.pack_i32([0]))))
    served.stub.Execute(ops_only, timeout=30)
    assert _confirm(served).last_step_id == 1_000_009

    bad = plan.request([(a, 1)])
    bad.step_id = 1_000_011
    bad.token_ids = packed.pack_i32([100_000])  # past the vocabulary: rejected before anything is touched
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(bad, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _confirm(served).last_step_id == 1_000_009

    def boom(*_a, **_k):
        raise torch.OutOfMemoryError("simulated")

    gen = served.executor.pool_generation
    monkeypatch.setattr(served.executor.runner, "forward", boom)
    failing = plan.request([(plan.new_seq(p), 6)])
    failing.step_id = 1_000_013
    with pytest.raises(grpc.RpcError):
        served.stub.Execute(failing, timeout=30)
    monkeypatch.undo()
    reply = _confirm(served)  # a new generation: it has applied no step yet
    assert (reply.pool_generation, reply.last_step_id) == (gen + 1, 0)


def _written(served, since: int) -> tuple[bool, list[int]]:
    ex = served.executor
    reply = served.stub.ConfirmPool(executor_pb2.ConfirmPoolRequest(
        incarnation=ex.incarnation, pool_generation=ex.pool_generation, written_since_step=since), timeout=10)
    assert reply.confirmed
    return reply.writes_known, list(packed.unpack_i32(reply.written_block_ids))


def test_confirm_pool_lists_the_blocks_written_since_a_step(serve):
    """What a restarted memory service needs to keep the rest of a mirror
    that lags the executor (the fine step fence, docs/mirror.md)."""
    served = serve(CKPT, executor_id="write-log")
    bs = served.executor.pool.block_size
    plan = Plan(served)
    [p] = prompts(1, [bs + 3], seed=43)
    a = plan.new_seq(p)
    req = plan.request([(a, bs + 3)])
    req.step_id = 2_000_001
    served.stub.Execute(req, timeout=30)
    a_blocks = sorted(a.blocks)  # what its slot mapping wrote
    assert len(a_blocks) == 2

    swap = executor_pb2.ExecuteRequest(step_id=2_000_003, plan=common_pb2.ExecutorPlan(
        table_epoch=plan.epoch, cache_ops=common_pb2.CacheOps(swap_out_src=packed.pack_i32([a_blocks[0]]),
                                                              swap_out_dst=packed.pack_i32([0]))))
    served.stub.Execute(swap, timeout=30)  # reads a device block, writes swap space only
    copy = executor_pb2.ExecuteRequest(step_id=2_000_005, plan=common_pb2.ExecutorPlan(
        table_epoch=plan.epoch, cache_ops=common_pb2.CacheOps(copy_src=packed.pack_i32([a_blocks[0]]),
                                                              copy_dst=packed.pack_i32([7]))))
    served.stub.Execute(copy, timeout=30)

    assert _written(served, 2_000_000) == (True, sorted({*a_blocks, 7}))
    assert _written(served, 2_000_001) == (True, [7])
    assert _written(served, 2_000_005) == (False, [])   # nothing applied since: nothing to list
    reply = served.stub.ConfirmPool(executor_pb2.ConfirmPoolRequest(
        incarnation=served.executor.incarnation, pool_generation=served.executor.pool_generation), timeout=10)
    assert not reply.writes_known                        # not asked


def test_write_log_forgets_old_steps_and_says_so():
    import numpy as np

    from executor_service.write_log import WriteLog

    log = WriteLog(block_size=4, max_steps=2)
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    log.record(10, i32(0, 1, 2, 3, 4), i32(), i32())
    log.record(12, i32(), i32(9), i32())
    assert list(log.written_since(9)) == [0, 1, 9]
    log.record(14, i32(), i32(), i32(5))
    assert log.written_since(9) is None                  # step 10 was dropped: no longer known
    assert list(log.written_since(10)) == [5, 9]
    assert list(log.written_since(14)) == []
    log.reset()
    assert list(log.written_since(0)) == []
