"""Every bad input earns its status code through gRPC, touches nothing, and
the executor keeps serving; GetInfo / ConfirmPool; out of memory."""

from __future__ import annotations

import grpc
import pytest
import torch

from executor_harness import BLOCK_SIZE, NUM_BLOCKS, SWAP_BLOCKS, Plan, prompts
from kvpager import packed
from kvpager.v1 import common_pb2, executor_pb2

CKPT = "llama_gqa"
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _base(served):
    """A valid 2-sequence request: seq 1 prefill of 6, seq 2 prefill of 3 (both started: whole tables)."""
    plan = Plan(served)
    p1, p2 = prompts(2, [6, 3], seed=31)
    a, b = plan.new_seq(p1), plan.new_seq(p2)
    return plan.request([(a, 6), (b, 3)])


def _set(field, values, pack=packed.pack_i32):
    def mutate(req):
        setattr(req, field, pack(values))
    return mutate


def _set_plan(field, values, pack=packed.pack_i32):
    def mutate(req):
        setattr(req.plan, field, pack(values))
    return mutate


def _set_tables(field, values, pack=packed.pack_i32):
    def mutate(req):
        setattr(req.plan.tables, field, pack(values))
    return mutate


def _set_sampling(field, values, pack=packed.pack_i32):
    def mutate(req):
        setattr(req.sampling, field, pack(values))
    return mutate


def _ops(**fields):
    def mutate(req):
        req.plan.cache_ops.CopyFrom(common_pb2.CacheOps(**{k: packed.pack_i32(v) for k, v in fields.items()}))
    return mutate


def _token(i, value):
    def mutate(req):
        toks = list(packed.unpack_i32(req.token_ids))
        toks[i] = value
        req.token_ids = packed.pack_i32(toks)
    return mutate


def _table(i, value):
    def mutate(req):
        t = list(packed.unpack_i32(req.plan.tables.started_block_ids))
        t[i] = value
        req.plan.tables.started_block_ids = packed.pack_i32(t)
    return mutate


def _not_started(req):
    # rows for sequences the executor holds no table for
    req.plan.tables.ClearField("started_seq_ids")
    req.plan.tables.ClearField("started_context_lens")
    req.plan.tables.ClearField("started_offsets")
    req.plan.tables.ClearField("started_block_ids")


def _extend_unknown(req):
    t = req.plan.tables
    t.extended_seq_ids, t.extended_first_index = packed.pack_i64([77]), packed.pack_i32([0])
    t.extended_offsets, t.extended_block_ids = packed.pack_i32([0, 1]), packed.pack_i32([5])


def _long_context(req):
    # 2 tokens at position 255..256 > max_model_len 256, with a valid table.
    blocks = list(range(64))
    req.plan.seq_ids = packed.pack_i64([1])
    req.plan.query_lens = packed.pack_i32([2])
    t = req.plan.tables
    t.started_seq_ids, t.started_context_lens = packed.pack_i64([1]), packed.pack_i32([255])
    t.started_offsets, t.started_block_ids = packed.pack_i32([0, len(blocks)]), packed.pack_i32(blocks)
    req.context_lens = packed.pack_i32([255])
    req.token_ids = packed.pack_i32([5, 6])
    req.ClearField("sampling")


CASES = [
    ("token id past vocab", _token(0, 10_000), INVALID),
    ("negative token id", _token(7, -1), INVALID),
    ("block id past pool", _table(0, NUM_BLOCKS), INVALID),
    ("negative block id", _table(1, -3), INVALID),
    ("context disagrees with the executor's tables", _set("context_lens", [1, 0]), grpc.StatusCode.FAILED_PRECONDITION),
    ("row without a table", _not_started, grpc.StatusCode.FAILED_PRECONDITION),
    ("extends a table it does not hold", _extend_unknown, grpc.StatusCode.FAILED_PRECONDITION),
    ("token_ids shorter than query_lens", _set("token_ids", [5, 6, 7]), INVALID),
    ("started context lens short", _set_tables("started_context_lens", [0]), INVALID),
    ("context_lens wrong length", _set("context_lens", [0]), INVALID),
    ("query_lens zero", _set_plan("query_lens", [9, 0]), INVALID),
    ("negative context", _set_tables("started_context_lens", [-1, 0]), INVALID),
    ("block table too short", _set_tables("started_offsets", [0, 1, 3]), INVALID),
    ("offsets not ending at table length", _set_tables("started_offsets", [0, 2, 2]), INVALID),
    ("duplicate seq ids", _set_plan("seq_ids", [4, 4], packed.pack_i64), INVALID),
    ("malformed packed bytes", lambda r: setattr(r, "token_ids", b"\x01\x02\x03"), INVALID),
    ("malformed table bytes", lambda r: setattr(r.plan.tables, "started_block_ids", b"\x01\x02"), INVALID),
    ("context beyond max_model_len", _long_context, INVALID),
    ("copy dst past pool", _ops(copy_src=[1], copy_dst=[NUM_BLOCKS]), INVALID),
    ("copy src is a dst", _ops(copy_src=[1, 2], copy_dst=[2, 3]), INVALID),
    ("copy lengths differ", _ops(copy_src=[1, 2], copy_dst=[3]), INVALID),
    ("swap out past swap pool", _ops(swap_out_src=[1], swap_out_dst=[SWAP_BLOCKS]), INVALID),
    ("swap in from past swap pool", _ops(swap_in_src=[SWAP_BLOCKS + 5], swap_in_dst=[1]), INVALID),
    ("swap in dst duplicated", _ops(swap_in_src=[1, 2], swap_in_dst=[3, 3]), INVALID),
    ("seeds not one per sample", _set_sampling("seeds", [1], packed.pack_i64), INVALID),
    ("negative temperature", _set_sampling("temperature", [-1.0, 0.0], packed.pack_f32), INVALID),
    ("top_p above one", _set_sampling("top_p", [1.5, 1.0], packed.pack_f32), INVALID),
    ("num_samples negative", _set_sampling("num_samples", [-1, 1]), INVALID),
    ("top logprobs past vocab", _set_sampling("num_top_logprobs", [100_000, 0]), INVALID),
    ("incarnation mismatch", lambda r: setattr(r, "incarnation", 12345), grpc.StatusCode.FAILED_PRECONDITION),
]


def test_slot_written_twice_is_rejected(serve):
    served = serve(CKPT)
    plan = Plan(served)
    p1, p2 = prompts(2, [3, 3], seed=32)
    a, b = plan.new_seq(p1), plan.new_seq(p2)
    plan.ensure_blocks(a, 3)
    b.blocks = list(a.blocks)  # a fork writing its shared block without copy-on-write
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(plan.request([(a, 3), (b, 3)]), timeout=30)
    assert err.value.code() == INVALID and "twice" in err.value.details()


@pytest.mark.parametrize("name,mutate,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_status_and_still_serving(serve, name, mutate, code):
    served = serve(CKPT)
    req = _base(served)
    mutate(req)
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(req, timeout=30)
    assert err.value.code() == code, err.value.details()
    assert err.value.details()  # a message, never a payload string
    # Still serving: info and a valid step both answer.
    assert served.stub.GetInfo(executor_pb2.GetInfoRequest(), timeout=10).executor_id
    ok = served.stub.Execute(_base(served), timeout=30)
    assert len(packed.unpack_i32(ok.sampled_token_ids)) == 2


def test_rejected_step_touches_no_tensor(serve, oracle):
    served = serve(CKPT)
    plan = Plan(served)
    [p] = prompts(1, [9], seed=33)
    a = plan.new_seq(p)
    plan.prefill([a])
    # A bad request whose cache ops would clobber A's blocks must change nothing.
    junk = plan.alloc.alloc()
    bad = plan.request([(a, 1)], cache_ops=common_pb2.CacheOps(
        copy_src=packed.pack_i32([junk] * len(a.blocks)), copy_dst=packed.pack_i32(a.blocks)))
    bad.token_ids = packed.pack_i32([100_000])
    with pytest.raises(grpc.RpcError):
        served.stub.Execute(bad, timeout=30)
    plan.decode([a], 3)
    assert a.generated == oracle(CKPT).greedy(p, 4)


def test_incarnation_match_is_accepted(serve):
    served = serve(CKPT)
    req = _base(served)
    req.incarnation = served.info.incarnation
    served.stub.Execute(req, timeout=30)


def test_info_and_confirm_pool(serve):
    served = serve(CKPT)
    info = served.stub.GetInfo(executor_pb2.GetInfoRequest(), timeout=10)
    assert (info.model_type, info.num_layers, info.num_kv_heads, info.head_dim) == ("llama", 2, 2, 16)
    assert (info.num_blocks, info.block_size, info.num_swap_blocks) == (NUM_BLOCKS, BLOCK_SIZE, SWAP_BLOCKS)
    assert info.vocab_size == 320 and info.max_model_len == 256 and list(info.eos_token_ids) == [1]
    assert info.dtype == "float32" and info.device == "cpu" and info.attention_backend == "torch"
    assert info.incarnation > 0 and info.pool_generation >= 1
    assert info.kv_pool_bytes == 2 * 2 * NUM_BLOCKS * BLOCK_SIZE * 2 * 16 * 4
    yes = served.stub.ConfirmPool(executor_pb2.ConfirmPoolRequest(
        incarnation=info.incarnation, pool_generation=info.pool_generation), timeout=10)
    assert yes.confirmed and yes.incarnation == info.incarnation
    for inc, gen in ((info.incarnation + 1, info.pool_generation), (info.incarnation, info.pool_generation + 1)):
        no = served.stub.ConfirmPool(executor_pb2.ConfirmPoolRequest(incarnation=inc, pool_generation=gen))
        assert not no.confirmed and no.pool_generation == info.pool_generation


def test_out_of_memory_is_resource_exhausted_and_survivable(serve, monkeypatch):
    served = serve(CKPT, executor_id="oom-test")
    runner = served.executor.runner

    def boom(*_a, **_k):
        raise torch.OutOfMemoryError("simulated")

    gen_before = served.executor.pool_generation
    monkeypatch.setattr(runner, "forward", boom)
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(_base(served), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served.executor.pool_generation == gen_before + 1
    monkeypatch.undo()
    served.stub.Execute(_base(served), timeout=30)


def test_empty_step_with_only_cache_ops(serve):
    served = serve(CKPT)
    req = executor_pb2.ExecuteRequest(step_id=9, plan=common_pb2.ExecutorPlan(
        table_epoch=1, cache_ops=common_pb2.CacheOps(swap_out_src=packed.pack_i32([3]),
                                                              swap_out_dst=packed.pack_i32([0]))))
    resp = served.stub.Execute(req, timeout=30)
    assert resp.step_id == 9 and resp.sampled_token_ids == b""


def test_context_limit_fits_the_pool(tmp_path):
    """The model's limit is lowered to what the pool holds (so a request
    that could never fit is refused on arrival); an explicit one over the pool
    is a configuration error."""
    from executor_service.config import ExecutorConfig
    from kvpager_tools.demo_model import build_demo_model
    from executor_service.executor import Executor

    model = str(build_demo_model(tmp_path / "m", vocab_size=320, max_position_embeddings=256))
    assert Executor(ExecutorConfig(model=model, num_blocks=16, block_size=4)).max_model_len == 64
    assert Executor(ExecutorConfig(model=model, num_blocks=128, block_size=4)).max_model_len == 256
    assert Executor(ExecutorConfig(model=model, num_blocks=16, block_size=4, max_model_len=48)).max_model_len == 48
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        Executor(ExecutorConfig(model=model, num_blocks=16, block_size=4, max_model_len=128))
