"""Greedy output through the real gRPC server is token-for-token identical to
transformers' ``generate`` (fp32, eager), under every cache trick the memory
service plays: ragged batches, prefix hits, chunked prefill, forks with
copy-on-write, swap out/in, and recompute after preemption."""

from __future__ import annotations

import pytest

from executor_harness import BLOCK_SIZE, Plan, prompts
from kvpager import packed
from kvpager.v1 import common_pb2

ALL = ["llama_mha", "llama_gqa", "qwen2"]
NEW = 6  # generated tokens per sequence
# (attention backend, model implementation): our own Llama forward on the
# in-place C++ CPU kernel, and transformers' model code on the torch reference.
ENGINES = {"kvpager-cpu": ("cpu", "kvpager"), "transformers-torch": ("torch", "transformers")}


@pytest.fixture(params=sorted(ENGINES))
def serve_engine(request, serve):
    backend, impl = ENGINES[request.param]
    if backend == "cpu":
        from kvpager_kernels import cpu_attention

        if not cpu_attention.available():
            pytest.skip("the C++ CPU attention kernel did not build here")

    def get(name: str):
        served = serve(name, backend, model_impl=impl)
        assert (served.info.attention_backend, served.info.model_impl) == (backend, impl)
        return served

    return get


def _run_to(plan: Plan, seqs, total_new: int) -> None:
    """Prefill everything in one step, then decode all together."""
    plan.prefill(seqs)
    plan.decode(seqs, total_new - 1)


@pytest.mark.parametrize("ckpt", ALL)
def test_ragged_batch_matches_generate(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(4, [3, 9, 1, 14], seed=11)]
    _run_to(plan, seqs, NEW)
    for s in seqs:
        assert s.generated == oracle(ckpt).greedy(s.tokens[: s.prompt_len], NEW)


@pytest.mark.parametrize("ckpt", ALL)
def test_plain_equal_length_batch(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(3, [8, 8, 8], seed=12)]
    _run_to(plan, seqs, NEW)
    for s in seqs:
        assert s.generated == oracle(ckpt).greedy(s.tokens[: s.prompt_len], NEW)


@pytest.mark.parametrize("ckpt", ALL)
def test_shared_prefix_computes_only_the_rest(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    [prefix] = prompts(1, [2 * BLOCK_SIZE], seed=13)
    a = plan.new_seq(prefix + [7, 8, 9])
    _run_to(plan, [a], 2)
    # B reuses A's two full prefix blocks (refcount++), computes only its tail.
    b = plan.new_seq(prefix + [40, 41, 42, 43, 44])
    b.blocks = a.blocks[:2]
    for blk in b.blocks:
        plan.alloc.share(blk)
    b.num_computed = 2 * BLOCK_SIZE
    req = plan.request([(b, len(b.tokens) - b.num_computed)])
    assert list(packed.unpack_i32(req.context_lens)) == [2 * BLOCK_SIZE]
    plan.step([(b, len(b.tokens) - b.num_computed)])
    plan.decode([a, b], NEW - 1)
    assert b.generated == oracle(ckpt).greedy(b.tokens[: b.prompt_len], NEW)
    assert a.generated == oracle(ckpt).greedy(a.tokens[: a.prompt_len], NEW + 1)


@pytest.mark.parametrize("ckpt", ALL)
def test_chunked_prefill_mixed_with_decodes(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    long_p, short_p = prompts(2, [19, 5], seed=14)
    long, short = plan.new_seq(long_p), plan.new_seq(short_p)
    plan.prefill([short])
    # The long prompt arrives in chunks of 6 (no sample until its last chunk)
    # while the short one decodes in the same forwards.
    while long.num_computed < len(long_p):
        chunk = min(6, len(long_p) - long.num_computed)
        plan.step([(short, 1), (long, chunk)])
    plan.decode([long, short], NEW - 1)
    assert long.generated == oracle(ckpt).greedy(long_p, NEW)
    assert short.generated == oracle(ckpt).greedy(short_p, len(short.generated))


@pytest.mark.parametrize("ckpt", ALL)
def test_fork_copies_the_shared_partial_block(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    [p] = prompts(1, [2 * BLOCK_SIZE + 2], seed=15)  # last block partial
    parent = plan.new_seq(p)
    plan.prefill([parent])  # parent now holds 1 sampled token
    # Fork: the child shares every block; it diverges with a forced token.
    child = plan.new_seq(list(parent.tokens), prompt_len=len(p))
    plan.fork(parent, child)  # the executor learns it as a fork op: the child's table is the parent's
    forced = 99 if parent.tokens[-1] != 99 else 98
    child.tokens[-1] = forced
    # Both write position len(p) into the shared partial block: copy it for the child.
    shared = child.blocks[-1]
    fresh = plan.alloc.alloc()
    plan.alloc.release([shared])
    child.blocks[-1] = fresh
    ops = common_pb2.CacheOps(copy_src=packed.pack_i32([shared]), copy_dst=packed.pack_i32([fresh]))
    req = plan.request([(parent, 1), (child, 1)], cache_ops=ops)
    assert [f.parent_seq_id for f in req.plan.tables.forks] == [parent.seq_id]
    assert list(packed.unpack_i64(req.plan.tables.extended_seq_ids)) == [child.seq_id]  # only its copied tail
    assert not req.plan.tables.started_seq_ids
    plan.step_id -= 1  # the request above was a look; send the same step
    plan.step([(parent, 1), (child, 1)], cache_ops=ops)
    plan.decode([parent, child], NEW - 2)
    assert parent.generated == oracle(ckpt).greedy(p, NEW)
    assert child.generated[1:] == oracle(ckpt).greedy(p + [forced], NEW - 1)


@pytest.mark.parametrize("ckpt", ALL)
def test_swap_out_then_in_to_other_blocks(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    a_p, b_p = prompts(2, [10, 12], seed=16)
    a = plan.new_seq(a_p)
    _run_to(plan, [a], 3)
    # Preempt A by swapping: its blocks go to swap blocks 5.., then are freed.
    old = list(a.blocks)
    swap_ids = list(range(5, 5 + len(old)))
    b = plan.new_seq(b_p)
    plan.alloc.release(old)
    ops = common_pb2.CacheOps(swap_out_src=packed.pack_i32(old), swap_out_dst=packed.pack_i32(swap_ids))
    # B reuses (and overwrites) A's old device blocks in the same step.
    plan.step([(b, len(b.tokens))], cache_ops=ops)
    assert set(b.blocks) & set(old)
    plan.decode([b], 2)
    # Swap A back into different device blocks and continue.
    a.blocks = [plan.alloc.alloc() for _ in old]
    assert not set(a.blocks) & set(old)
    ops = common_pb2.CacheOps(swap_in_src=packed.pack_i32(swap_ids), swap_in_dst=packed.pack_i32(a.blocks))
    plan.step([(a, 1), (b, 1)], cache_ops=ops)
    plan.decode([a, b], 2)
    assert a.generated == oracle(ckpt).greedy(a_p, 6)
    assert b.generated == oracle(ckpt).greedy(b_p, 6)


@pytest.mark.parametrize("ckpt", ALL)
def test_recompute_after_preemption(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    a_p, b_p = prompts(2, [7, 9], seed=17)
    a = plan.new_seq(a_p)
    _run_to(plan, [a], 3)
    # Preempt A by recompute: its blocks are freed and reused by B.
    plan.free(a)
    a.num_computed = 0
    b = plan.new_seq(b_p)
    _run_to(plan, [b], 3)
    # A resumes: prompt + its generated tokens in one prefill, then decodes.
    plan.step([(a, len(a.tokens)), (b, 1)])
    plan.decode([a, b], 2)
    assert a.generated == oracle(ckpt).greedy(a_p, 6)
    assert b.generated == oracle(ckpt).greedy(b_p, 6)


# ---- the same kernels through Triton's interpreter (few tokens: it is slow)


@pytest.mark.parametrize("ckpt", ["llama_gqa", "qwen2"])
def test_triton_interpreter_ragged_and_chunked(serve, oracle, ckpt):
    served = serve(ckpt, "triton")
    assert served.info.attention_backend == "triton"
    plan = Plan(served)
    p1, p2 = prompts(2, [6, 3], seed=18)
    s1, s2 = plan.new_seq(p1), plan.new_seq(p2)
    plan.step([(s1, 4), (s2, 3)])  # s1's first chunk, s2 whole
    plan.step([(s1, 2), (s2, 1)])  # s1's last chunk + s2's decode
    plan.decode([s1, s2], 2)
    assert s1.generated == oracle(ckpt).greedy(p1, 3)
    assert s2.generated == oracle(ckpt).greedy(p2, 4)


def test_triton_interpreter_fork_and_prefix(serve, oracle):
    ckpt = "llama_mha"
    served = serve(ckpt, "triton")
    plan = Plan(served)
    [p] = prompts(1, [BLOCK_SIZE + 2], seed=19)
    parent = plan.new_seq(p)
    plan.prefill([parent])
    child = plan.new_seq(list(parent.tokens), prompt_len=len(p))
    plan.fork(parent, child)  # the executor learns it as a fork op: the child's table is the parent's
    shared, fresh = child.blocks[-1], plan.alloc.alloc()
    plan.alloc.release([shared])
    child.blocks[-1] = fresh
    ops = common_pb2.CacheOps(copy_src=packed.pack_i32([shared]), copy_dst=packed.pack_i32([fresh]))
    # A third sequence hits the parent's first (full) block as a cached prefix.
    hit = plan.new_seq(p[:BLOCK_SIZE] + [50, 51])
    hit.blocks = parent.blocks[:1]
    plan.alloc.share(hit.blocks[0])
    hit.num_computed = BLOCK_SIZE
    plan.step([(parent, 1), (child, 1), (hit, 2)], cache_ops=ops)
    plan.decode([hit], 1)
    ref = oracle(ckpt).greedy(p, 2)
    assert parent.generated == ref and child.generated == ref
    assert hit.generated == oracle(ckpt).greedy(p[:BLOCK_SIZE] + [50, 51], 2)


@pytest.mark.parametrize("ckpt", ["llama_gqa", "qwen2"])
def test_the_mlp_in_row_blocks_matches_generate(serve, oracle, ckpt, monkeypatch):
    """Our forward's MLP split into row blocks (every row its own block here;
    executor_service.models.llama.MLP_BLOCK_ELEMS) changes no token."""
    from kvpager_kernels import cpu_attention
    from executor_service.models import llama

    if not cpu_attention.available():
        pytest.skip("the C++ CPU attention kernel did not build here")
    blocked = []
    mlp = llama.DecoderLayer.mlp

    def spy(self, x, ops):
        blocked.append(x.shape[0])
        return mlp(self, x, ops)

    monkeypatch.setattr(llama, "MLP_BLOCK_ELEMS", 1)
    monkeypatch.setattr(llama.DecoderLayer, "mlp", spy)
    served = serve(ckpt, "cpu", model_impl="kvpager")
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(4, [3, 9, 1, 14], seed=11)]
    _run_to(plan, seqs, NEW)
    assert max(blocked) == 3 + 9 + 1 + 14  # the prefill step: 27 rows, 27 blocks
    for s in seqs:
        assert s.generated == oracle(ckpt).greedy(s.tokens[: s.prompt_len], NEW)
