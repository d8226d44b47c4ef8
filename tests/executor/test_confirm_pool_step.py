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

    ops_only = executor_pb2.ExecuteRequest(step_id=1_000_009, cache_ops=common_pb2.CacheOps(
        swap_out_src=packed.pack_i32([3]), swap_out_dst=packed.pack_i32([0])))
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
