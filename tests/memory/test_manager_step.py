"""MemoryManager.step on a tiny pool, exactly: block ids, refcounts, free-queue
order, cache ops, preemptions and the plan, after each step; every bad input
changes nothing; accounting identities.

Every step runs through `Harness.run`, which also asserts check_invariants()
== [] and slot == block_id * block_size + offset for every planned token.
"""

from __future__ import annotations

import pytest

from kvpager.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, KvpagerError, NotFound
from memory_service.events import AllCleared, BlockRemoved, BlockStored
from memory_service.kv_manager import ExecutorSpec
from memory_service.policy import PreemptionMode
from memory_service.records import RejectionReason


RECOMPUTE, SWAP = PreemptionMode.RECOMPUTE, PreemptionMode.SWAP


# ---- the plan -----------------------------------------------------------------------


def test_prefill_then_decode_plan(harness):
    h = harness(num_blocks=8)
    out = h.step(new=[h.new(1, range(10))], sched=[(1, 10)])
    r = h.rows(out)[1]
    assert (r.context_len, r.query_len, r.block_table, r.num_cached_tokens) == (0, 10, [0, 1, 2], 0)
    assert r.slots == list(range(10))
    assert h.free_ids() == [3, 4, 5, 6, 7] and h.ref(0, 1, 2) == [1, 1, 1]
    out = h.step(append={1: [42]}, sched=[(1, 1)])
    r = h.rows(out)[1]
    assert (r.context_len, r.query_len, r.block_table, r.slots) == (10, 1, [0, 1, 2], [10])
    assert out.preempted == [] and out.unscheduled == [] and out.rejected == []


def test_chunked_prefill_takes_blocks_chunk_by_chunk(harness):
    h = harness(num_blocks=8)
    out = h.step(new=[h.new(1, range(11))], sched=[(1, 3)])
    assert h.rows(out)[1].block_table == [0] and h.rows(out)[1].slots == [0, 1, 2]
    out = h.step(sched=[(1, 6)])
    r = h.rows(out)[1]
    assert (r.context_len, r.query_len, r.block_table) == (3, 6, [0, 1, 2])
    assert r.slots == [3, 4, 5, 6, 7, 8]
    out = h.step(sched=[(1, 100)])  # capped at what is left
    r = h.rows(out)[1]
    assert (r.context_len, r.query_len, r.slots) == (9, 2, [9, 10])
    assert h.seq(1).num_computed == 11


# ---- prefix cache ---------------------------------------------------------------------


def test_freed_cached_blocks_hit_again_then_lru_evicts_them(harness):
    h = harness(num_blocks=6, events=True)
    prompt = list(range(1, 10))  # 9 tokens: 2 full blocks
    h.step(new=[h.new(1, prompt)], sched=[(1, 9)])
    stored = h.events.drain()
    assert [(type(e), e.block_id, e.depth) for e in stored] == [(BlockStored, 0, 0), (BlockStored, 1, 1)]
    h.step(free=[1])
    assert h.free_ids() == [3, 4, 5, 2, 1, 0] and h.pool.num_cached_free == 2
    # the same prompt again: both full blocks hit, the last token is recomputed
    out = h.step(new=[h.new(2, prompt)], sched=[(2, 9)])
    r = h.rows(out)[2]
    assert (r.context_len, r.query_len, r.block_table, r.num_cached_tokens) == (8, 1, [0, 1, 3], 8)
    assert h.free_ids() == [4, 5, 2] and h.ref(0, 1, 3) == [1, 1, 1]
    h.step(free=[2])
    assert h.free_ids() == [4, 5, 2, 3, 1, 0]
    # distinct prompts take 5 blocks: uncached 4, 5, 2, 3 first, then cached block 1
    h.events.drain()
    out = h.step(new=[h.new(3, range(100, 120))], sched=[(3, 20)])
    assert h.rows(out)[3].block_table == [4, 5, 2, 3, 1]
    removed = [e for e in h.events.drain() if isinstance(e, BlockRemoved)]
    assert [(e.block_id, e.block_hash) for e in removed] == [(1, stored[1].block_hash)]
    assert h.free_ids() == [0] and h.pool.num_evictions == 1
    h.step(free=[3])
    # the prompt now hits only its first block
    out = h.step(new=[h.new(4, prompt)], sched=[(4, 9)])
    r = h.rows(out)[4]
    assert (r.context_len, r.num_cached_tokens, r.block_table[0]) == (4, 4, 0)


def test_a_fully_evicted_prompt_misses(harness):
    h = harness(num_blocks=3, events=True)
    prompt = list(range(1, 10))
    h.step(new=[h.new(1, prompt)], sched=[(1, 9)])
    h.step(free=[1])
    h.step(new=[h.new(2, range(50, 62))], sched=[(2, 12)])  # all three blocks
    assert sorted(e.block_id for e in h.events.drain() if isinstance(e, BlockRemoved)) == [0, 1]
    assert h.pool.cached.keys() == {b.block_hash for b in h.pool.blocks if b.block_hash}
    h.step(free=[2])
    out = h.step(new=[h.new(3, prompt)], sched=[(3, 9)])
    assert h.rows(out)[3].num_cached_tokens == 0 and h.rows(out)[3].context_len == 0


def test_reverse_order_free_evicts_the_tail_before_the_prefix(harness):
    h = harness(num_blocks=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks + 1
    h.step(new=[h.new(1, prompt)], sched=[(1, 13)])
    h.step(free=[1])
    assert h.free_ids() == [3, 2, 1, 0]
    # two blocks for someone else: the partial tail (3), then the last full block (2)
    h.step(new=[h.new(2, range(100, 106))], sched=[(2, 6)])
    assert h.table(2) == [3, 2]
    h.step(free=[2])
    out = h.step(new=[h.new(3, prompt)], sched=[(3, 13)])
    r = h.rows(out)[3]
    assert (r.context_len, r.num_cached_tokens) == (8, 8) and r.block_table[:2] == [0, 1]


def test_hash_collision_with_other_tokens_never_hits(harness, monkeypatch):
    import kvpager.prefix_index.hashing as hashing

    # Every block hashes to its parent's digest: all first blocks collide.
    monkeypatch.setattr(hashing, "hash_block", lambda parent, tokens: parent)
    h = harness(num_blocks=8)
    h.step(new=[h.new(1, [1, 2, 3, 4, 5])], sched=[(1, 5)])
    assert len(h.pool.cached) == 1
    out = h.step(new=[h.new(2, [9, 9, 9, 9, 5])], sched=[(2, 5)])
    r = h.rows(out)[2]
    assert (r.context_len, r.num_cached_tokens, r.block_table) == (0, 0, [2, 3])
    assert h.ref(0) == [1]  # not shared
    # the index still maps the hash to the first block only
    assert list(h.pool.cached.values()) == [h.pool.blocks[0]]


def test_inserted_block_with_same_hash_other_tokens_never_hits(harness):
    h = harness(num_blocks=8)
    h.step(new=[h.new(1, [1, 2, 3, 4, 5])], sched=[(1, 5)])
    h.step(free=[1])
    # corrupt the cached block's recorded tokens: its hash now names other content
    h.pool.blocks[0].token_ids = (7, 7, 7, 7)
    out = h.step(new=[h.new(2, [1, 2, 3, 4, 5])], sched=[(2, 5)])
    assert h.rows(out)[2].num_cached_tokens == 0 and h.rows(out)[2].context_len == 0
    assert 0 not in h.table(2)


def test_prompt_of_exactly_k_full_blocks_hits_k_minus_1(harness):
    h = harness(num_blocks=8)
    prompt = list(range(12))  # 3 full blocks
    h.step(new=[h.new(1, prompt)], sched=[(1, 12)])
    out = h.step(new=[h.new(2, prompt)], sched=[(2, 12)])
    r = h.rows(out)[2]
    assert (r.context_len, r.query_len, r.num_cached_tokens) == (8, 4, 8)
    assert r.block_table == [0, 1, 3] and h.ref(0, 1, 2, 3) == [2, 2, 1, 1]


def test_cache_salt_isolates_tenants(harness):
    h = harness(num_blocks=16)
    prompt = list(range(9))
    h.step(new=[h.new(1, prompt, salt="a")], sched=[(1, 9)])
    out = h.step(new=[h.new(2, prompt, salt="b"), h.new(3, prompt), h.new(4, prompt, salt="a")],
                 sched=[(2, 9), (3, 9), (4, 9)])
    r = h.rows(out)
    assert (r[2].num_cached_tokens, r[3].num_cached_tokens, r[4].num_cached_tokens) == (0, 0, 8)
    assert r[4].block_table[:2] == h.table(1)[:2]
    assert not set(h.table(2)) & set(h.table(1)) and not set(h.table(3)) & set(h.table(1))
    scores = {s.executor_id: s for s in h.m.score_prefix(prompt, cache_salt="a")}
    assert scores["e0"].hit_blocks == 2 and scores["e0"].hit_tokens == 8
    assert h.m.score_prefix(prompt, cache_salt="zzz")[0].hit_blocks == 0


def test_prefix_hit_counted_once_recompute_after_preemption_is_not_a_hit(harness):
    h = harness(num_blocks=4)
    prompt = list(range(9))
    h.step(new=[h.new(1, prompt)], sched=[(1, 9)])
    h.step(free=[1])
    assert h.free_ids() == [3, 2, 1, 0]
    out = h.step(new=[h.new(2, prompt, priority=5)], sched=[(2, 9)])
    r = h.rows(out)[2]
    assert (r.context_len, r.num_cached_tokens, r.block_table) == (8, 8, [0, 1, 3])
    total, _ = h.m.accounting()
    assert (total.prefix_query_tokens, total.prefix_hit_tokens) == (9 + 9, 8)
    # a more important request needs two blocks: 2 is preempted (recompute)
    out = h.step(new=[h.new(3, range(100, 108), priority=0)], sched=[(3, 8)])
    assert out.preempted == [(2, RECOMPUTE)] and h.seq(2).status.value == "waiting"
    assert h.table(3) == [2, 3] and h.free_ids() == [1, 0]
    h.step(free=[3])
    # re-admitted from the same two cached blocks: computed again, not a hit
    out = h.step(sched=[(2, 9)])
    r = h.rows(out)[2]
    assert (r.context_len, r.query_len, r.block_table[:2]) == (8, 1, [0, 1])
    assert r.num_cached_tokens == 0
    assert h.seq(2).num_cached_tokens == 8  # the first admission's hit, for the usage report
    total, _ = h.m.accounting()
    assert (total.prefix_query_tokens, total.prefix_hit_tokens) == (9 + 9 + 8, 8)
    assert total.prefix_hit_rate == pytest.approx(8 / 26)


# ---- fork and copy-on-write -------------------------------------------------------------


def test_fork_shares_every_block_refcount_equals_holders(harness):
    h = harness(num_blocks=8)
    h.step(new=[h.new(1, range(10))], sched=[(1, 10)])
    assert h.m.fork(1, [2, 3]) == 6
    assert h.table(1) == h.table(2) == h.table(3) == [0, 1, 2]
    assert h.ref(0, 1, 2) == [3, 3, 3] and h.free_ids() == [3, 4, 5, 6, 7]
    h.check()
    assert h.m.free([2]) == 0 and h.ref(0, 1, 2) == [2, 2, 2]
    assert h.m.free([1, 3]) == 3 and h.free_ids() == [3, 4, 5, 6, 7, 2, 1, 0]


@pytest.mark.parametrize("order", [[1, 2, 3], [3, 2, 1], [2, 1, 3]])
def test_diverging_children_copy_once_each_the_last_holder_writes_in_place(harness, order):
    h = harness(num_blocks=8)
    h.step(new=[h.new(1, range(10))], sched=[(1, 10)])
    # fork and give each member its own sampled token in one step
    out = h.step(forks=[(1, [2, 3])], append={1: [50], 2: [51], 3: [52]}, sched=[(s, 1) for s in order])
    o = h.ops(out)
    assert o.copy_src == [2, 2] and o.copy_dst == [3, 4]
    r = h.rows(out)
    writers = order[:2]
    assert r[writers[0]].block_table == [0, 1, 3] and r[writers[0]].slots == [3 * 4 + 2]
    assert r[writers[1]].block_table == [0, 1, 4] and r[writers[1]].slots == [4 * 4 + 2]
    assert r[order[2]].block_table == [0, 1, 2] and r[order[2]].slots == [2 * 4 + 2]  # in place
    assert h.ref(0, 1, 2, 3, 4) == [3, 3, 1, 1, 1]
    assert [h.seq(s).token_ids[-1] for s in (1, 2, 3)] == [50, 51, 52]
    # from now on every tail is private: no more copies
    out = h.step(append={1: [60], 2: [61], 3: [62]}, sched=[(1, 1), (2, 1), (3, 1)])
    assert not h.ops(out)
    total, _ = h.m.accounting()
    assert total.copy_on_write_copies == 2


def test_fork_of_a_waiting_sequence_admits_each_child_from_the_prefix(harness):
    h = harness(num_blocks=8)
    h.step(new=[h.new(1, range(9))])  # created, not scheduled
    out = h.step(forks=[(1, [2])], sched=[(1, 9), (2, 9)])
    r = h.rows(out)
    assert r[1].block_table == [0, 1, 2] and r[2].num_cached_tokens == 8
    assert r[2].block_table == [0, 1, 3] and h.ref(0, 1) == [2, 2]


# ---- preemption -------------------------------------------------------------------------


def test_swap_preemption_and_swap_in_later(harness):
    h = harness(num_blocks=4, num_swap_blocks=4, swap_min_tokens=4)
    h.step(new=[h.new(1, range(4)), h.new(2, range(10, 18), priority=5), h.new(3, range(20, 24))],
           sched=[(1, 4), (2, 8), (3, 4)])
    assert (h.table(1), h.table(2), h.table(3)) == ([0], [1, 2], [3])
    # 1 needs a block; the least important running sequence (2) is swapped out
    out = h.step(append={1: [5]}, sched=[(1, 1)])
    assert out.preempted == [(2, SWAP)]
    o = h.ops(out)
    assert (o.swap_out_src, o.swap_out_dst) == ([1, 2], [0, 1])
    assert h.seq(2).status.value == "swapped" and h.seq(2).swap_blocks == [0, 1]
    assert h.table(1) == [0, 2] and h.free_ids() == [1] and h.kv.swap.num_free == 2
    # a swapped sequence may not preempt an equally or more important one
    h.step(free=[3])
    out = h.step(append={2: [99]}, sched=[(2, 1)])
    assert out.unscheduled == [2] and out.preempted == [] and h.seq(2).status.value == "swapped"
    h.step(free=[1])
    assert h.free_ids() == [1, 3, 2, 0]
    out = h.step(sched=[(2, 1)])
    o = h.ops(out)
    assert (o.swap_in_src, o.swap_in_dst) == ([0, 1], [1, 3])
    r = h.rows(out)[2]
    assert (r.context_len, r.query_len, r.block_table, r.slots) == (8, 1, [1, 3, 2], [2 * 4])
    assert h.seq(2).status.value == "running" and h.kv.swap.num_free == 4
    # decoding continues in place
    out = h.step(append={2: [100]}, sched=[(2, 1)])
    assert h.rows(out)[2].slots == [2 * 4 + 1] and not h.ops(out)


def test_recompute_preemption_frees_and_readmits_from_the_cached_prefix(harness):
    h = harness(num_blocks=4)
    h.step(new=[h.new(1, range(4)), h.new(2, range(10, 18), priority=5), h.new(3, range(20, 24))],
           sched=[(1, 4), (2, 8), (3, 4)])
    out = h.step(append={1: [5]}, sched=[(1, 1)])
    assert out.preempted == [(2, RECOMPUTE)] and not h.ops(out)
    assert h.seq(2).status.value == "waiting" and h.seq(2).blocks == []
    assert h.table(1) == [0, 2] and h.free_ids() == [1]
    h.step(free=[1, 3])
    # 8 prompt tokens + 1 sampled: block 1 (tokens 10..13) is still cached, block 2 was reused
    out = h.step(append={2: [18]}, sched=[(2, 9)])
    r = h.rows(out)[2]
    assert (r.context_len, r.query_len, r.block_table[0]) == (4, 5, 1)
    assert h.seq(2).num_computed == 9


def test_more_important_waiting_request_preempts_a_less_important_running_one(harness):
    h = harness(num_blocks=4, events=True)
    h.step(new=[h.new(1, range(8), priority=5), h.new(2, range(10, 18), priority=5)], sched=[(1, 8), (2, 8)])
    # equal priority: no preemption, just unscheduled
    out = h.step(new=[h.new(3, range(20, 24), priority=5)], sched=[(3, 4)])
    assert out.preempted == [] and out.unscheduled == [3] and h.seq(3).blocks == []
    # more important: the newest of the least important is preempted, and only it
    h.events.drain()
    out = h.step(new=[h.new(4, range(30, 34), priority=0)], sched=[(4, 4)])
    assert out.preempted == [(2, RECOMPUTE)]
    assert h.table(4) == [3] and h.table(1) == [0, 1] and h.free_ids() == [2]
    removed = [e.block_id for e in h.events.drain() if isinstance(e, BlockRemoved)]
    assert removed == [3]  # 2's freed tail block, reused for 4


def test_admission_does_not_preempt_when_that_cannot_make_room(harness):
    h = harness(num_blocks=4)
    h.step(new=[h.new(1, range(12), priority=0), h.new(2, range(20, 24), priority=5)], sched=[(1, 12), (2, 4)])
    # 3 needs 2 blocks; preempting 2 would free only 1
    out = h.step(new=[h.new(3, range(30, 38), priority=1)], sched=[(3, 8)])
    assert out.preempted == [] and out.unscheduled == [3]
    assert h.seq(2).status.value == "running" and h.table(2) == [3]


def test_running_sequence_preempts_the_worst_not_yet_handled_or_itself(harness):
    h = harness(num_blocks=3)
    h.step(new=[h.new(1, range(4), priority=0), h.new(2, range(10, 18), priority=5)], sched=[(1, 4), (2, 8)])
    # 2 goes first and is the worst: it preempts itself, 1 then fits
    out = h.step(append={1: [4], 2: [18]}, sched=[(2, 1), (1, 1)])
    assert out.preempted == [(2, RECOMPUTE)] and out.unscheduled == [2]
    assert h.rows(out).keys() == {1} and h.table(1) == [0, 2]


def test_running_sequence_preempts_a_worse_one_that_comes_later(harness):
    h = harness(num_blocks=3)
    h.step(new=[h.new(1, range(4), priority=0), h.new(2, range(10, 18), priority=5)], sched=[(1, 4), (2, 8)])
    out = h.step(append={1: [4], 2: [18]}, sched=[(1, 1), (2, 1)])
    assert out.preempted == [(2, RECOMPUTE)] and out.unscheduled == [2]
    assert h.table(1) == [0, 2]


def test_sequences_already_handled_this_step_are_never_victims(harness):
    h = harness(num_blocks=3)
    h.step(new=[h.new(1, range(3), priority=9), h.new(2, range(10, 18), priority=0)], sched=[(1, 3), (2, 8)])
    # 1 (the worst) is handled first and fits; 2 then needs a block and may only preempt itself
    out = h.step(append={1: [3], 2: [18]}, sched=[(1, 1), (2, 1)])
    assert out.preempted == [(2, RECOMPUTE)] and out.unscheduled == [2]
    assert h.seq(1).status.value == "running" and h.rows(out).keys() == {1}


def test_fcfs_no_waiting_sequence_overtakes_one_that_did_not_fit(harness):
    h = harness(num_blocks=4)
    h.m.register_executor(ExecutorSpec("e1", num_blocks=4, block_size=4, model_id="m", dtype="float32"))
    h.step(new=[h.new(1, range(8))], sched=[(1, 8)])
    out = h.step(new=[h.new(2, range(10, 22)), h.new(3, range(30, 34)), h.new(4, range(40, 44), executor_id="e1")],
                 sched=[(2, 12), (3, 4), (4, 4)])
    assert out.unscheduled == [2, 3] and out.preempted == []
    assert h.seq(3).blocks == [] and h.free_ids() == [2, 3]
    assert h.rows(out, "e1").keys() == {4}  # another executor is not held back
    out = h.step(sched=[(3, 4)])
    assert h.rows(out).keys() == {3}


def test_a_rejected_request_does_not_close_admission(harness):
    h = harness(num_blocks=4, max_model_len=32)
    out = h.step(new=[h.new(1, range(40)), h.new(2, range(4))], sched=[(1, 40), (2, 4)])
    assert [(r.seq_id, r.reason) for r in out.rejected] == [(1, RejectionReason.OVER_CONTEXT_LIMIT)]
    assert h.rows(out).keys() == {2} and 1 not in h.m.seqs


# ---- what can never fit, limits, retries, re-registration -----------------------------------


def test_can_never_fit_is_rejected_resource_exhausted_and_allocates_nothing(harness):
    h = harness(num_blocks=4, max_model_len=64)
    before = h.snapshot()
    out = h.step(new=[h.new(1, range(17))], sched=[(1, 17)])
    assert [(r.seq_id, r.reason) for r in out.rejected] == [(1, RejectionReason.OVER_POOL)]
    assert out.executor_plans == [] and out.unscheduled == [] and 1 not in h.m.seqs
    out = h.step(new=[h.new(2, range(4), max_total_tokens=20)], sched=[(2, 4)])
    assert [(r.seq_id, r.reason) for r in out.rejected] == [(2, RejectionReason.OVER_POOL)]
    after = h.snapshot()
    assert after[:4] == before[:4]
    # a request over the context limit is INVALID_ARGUMENT
    out = h.step(new=[h.new(3, range(4), max_total_tokens=65)])
    assert [(r.seq_id, r.reason) for r in out.rejected] == [(3, RejectionReason.OVER_CONTEXT_LIMIT)]


def test_retried_step_returns_the_same_plan_without_applying_twice(harness):
    h = harness(num_blocks=8)
    step = h.step_input(new=[h.new(1, range(6))], sched=[(1, 6)], step_id=7)
    out = h.run(step)
    snap = h.snapshot()
    again = h.run(step)
    assert again is out and h.snapshot() == snap
    with pytest.raises(Aborted, match="another gateway"):  # an older id: the single-writer fence
        h.m.step(h.step_input(sched=[(1, 1)], step_id=6))
    assert h.snapshot() == snap


def test_reregistration_with_a_new_incarnation_drops_sequences_and_the_index(harness):
    h = harness(num_blocks=8, events=True)
    h.step(new=[h.new(1, range(9)), h.new(2, range(20, 29))], sched=[(1, 9), (2, 9)])
    h.step(free=[2])
    h.events.drain()
    same = ExecutorSpec("e0", num_blocks=8, block_size=4, model_id="m", dtype="float32", incarnation=1,
                        pool_generation=1, address="x:1")
    assert h.m.register_executor(same) is False  # the same incarnation: nothing lost
    assert h.table(1) == [0, 1, 2] and h.kv.spec.address == "x:1"
    newer = ExecutorSpec("e0", num_blocks=8, block_size=4, model_id="m", dtype="float32", incarnation=2,
                         pool_generation=1)
    assert h.m.register_executor(newer) is True
    assert h.events.drain() == [AllCleared("e0")]
    assert h.m.seqs == {} and h.pool.cached == {} and h.free_ids() == list(range(8))
    h.check()
    with pytest.raises(FailedPrecondition):
        h.m.free([1])  # dropped with the old incarnation
    out = h.step(new=[h.new(3, range(9))], sched=[(3, 9)])
    assert h.rows(out)[3].num_cached_tokens == 0 and out.executor_plans[0].incarnation == 2
    with pytest.raises(FailedPrecondition):
        h.m.deregister_executor("e0", incarnation=1)
    assert h.m.deregister_executor("e0", incarnation=2) == 1 and h.m.executors == {}


# ---- every bad input changes nothing ---------------------------------------------------------


@pytest.fixture
def busy(harness):
    """Executor with vocab 100, max_model_len 32: 1, 2, 5 running (6/6 computed,
    1 limited to 8 tokens), 3 swapped, 4 freed."""
    h = harness(num_blocks=16, num_swap_blocks=8, max_model_len=32, vocab_size=100, swap_min_tokens=1)
    h.step(new=[h.new(1, range(1, 7), max_total_tokens=8), h.new(2, range(10, 16)), h.new(3, range(20, 26)),
                h.new(4, range(30, 34)), h.new(5, range(40, 46))],
           sched=[(1, 6), (2, 6), (3, 6), (4, 4), (5, 6)])
    h.kv.preempt_swap(h.seq(3))
    h.kv.take_ops()
    h.step(free=[4])
    assert h.seq(3).status.value == "swapped"
    return h


def base_step(h):
    """A valid step touching every phase; each case breaks one part of it."""
    return h.step_input(forks=[(1, [50])], append={2: [7], 3: [8], 50: [9]}, free=[5],
                        new=[h.new(60, [1, 2, 3, 4, 5])], sched=[(2, 1), (50, 1), (60, 5)])


def _set(**fields):
    def mod(h, s):
        for k, v in fields.items():
            setattr(s, k, v(h) if callable(v) else v)
    return mod


def _append(pairs):
    def mod(h, s):
        ids, offs, toks = [], [0], []
        for seq_id, tokens in pairs:
            ids.append(seq_id)
            toks.extend(tokens)
            offs.append(len(toks))
        s.appended_seq_ids, s.appended_offsets, s.appended_tokens = ids, offs, toks
    return mod


BAD = {
    "unknown seq appended": (_append([(2, [7]), (99, [1])]), NotFound),
    "unknown seq freed": (_set(free_seq_ids=[5, 99]), NotFound),
    "unknown seq aborted": (_set(abort_seq_ids=[99]), NotFound),
    "unknown seq scheduled": (_set(schedule_seq_ids=[2, 50, 60, 99], schedule_num_tokens=[1, 1, 5, 1]), NotFound),
    "unknown fork parent": (_set(forks=[(1, [50]), (99, [51])]), NotFound),
    "unknown executor": (_set(new_seqs=lambda h: [h.new(60, [1], executor_id="nope")]), NotFound),
    "duplicate new id": (_set(new_seqs=lambda h: [h.new(60, [1]), h.new(60, [2])]), AlreadyExists),
    "new id is live": (_set(new_seqs=lambda h: [h.new(60, [1]), h.new(1, [2])]), AlreadyExists),
    "new id is a fork child": (_set(new_seqs=lambda h: [h.new(50, [1])]), AlreadyExists),
    "fork child exists": (_set(forks=[(1, [2])]), AlreadyExists),
    "fork child twice": (_set(forks=[(1, [50]), (2, [50])]), AlreadyExists),
    "double free of a freed seq": (_set(free_seq_ids=[5, 4]), FailedPrecondition),
    "free twice in one step": (_set(free_seq_ids=[5, 5]), FailedPrecondition),
    "free and abort in one step": (_set(abort_seq_ids=[5]), FailedPrecondition),
    "abort of a freed seq": (_set(abort_seq_ids=[4]), FailedPrecondition),
    "fork of a freed seq": (_set(forks=[(1, [50]), (4, [51])]), FailedPrecondition),
    "fork of a swapped seq": (_set(forks=[(1, [50]), (3, [51])]), FailedPrecondition),
    "schedule a freed seq": (_set(schedule_seq_ids=[2, 4], schedule_num_tokens=[1, 1]), FailedPrecondition),
    "schedule a seq freed in this step": (_set(schedule_seq_ids=[2, 5], schedule_num_tokens=[1, 1]),
                                          (NotFound, FailedPrecondition)),
    "append to a freed seq": (_append([(2, [7]), (4, [1])]), FailedPrecondition),
    "fork without children": (_set(forks=[(1, [50]), (2, [])]), InvalidArgument),
    "negative prompt token": (_set(new_seqs=lambda h: [h.new(60, [1, -1])]), InvalidArgument),
    "negative appended token": (_append([(2, [-3]), (50, [9])]), InvalidArgument),
    "prompt token >= vocab": (_set(new_seqs=lambda h: [h.new(60, [1, 100])]), InvalidArgument),
    "appended token >= vocab": (_append([(2, [7]), (50, [100])]), InvalidArgument),
    "empty prompt": (_set(new_seqs=lambda h: [h.new(60, [])]), InvalidArgument),
    "negative max_total_tokens": (_set(new_seqs=lambda h: [h.new(60, [1], max_total_tokens=-1)]), InvalidArgument),
    "schedule zero tokens": (_set(schedule_num_tokens=[1, 0, 5]), InvalidArgument),
    "schedule negative tokens": (_set(schedule_num_tokens=[1, 1, -5]), InvalidArgument),
    "duplicate seq in schedule": (_set(schedule_seq_ids=[2, 50, 2], schedule_num_tokens=[1, 1, 1]), InvalidArgument),
    "schedule lengths differ": (_set(schedule_num_tokens=[1, 1]), InvalidArgument),
    "appended offsets one short": (_set(appended_offsets=[0, 1, 2]), InvalidArgument),
    "appended offsets not from 0": (_set(appended_offsets=[1, 1, 2, 3]), InvalidArgument),
    "appended offsets do not span": (_set(appended_offsets=[0, 1, 2, 2]), InvalidArgument),
    "appended offsets decrease": (_set(appended_offsets=[0, 2, 1, 3]), InvalidArgument),
    "appended tokens without seq ids": (_set(appended_seq_ids=[], appended_offsets=[], appended_tokens=[7],
                                             schedule_seq_ids=[60], schedule_num_tokens=[5]), InvalidArgument),
    "duplicate appended seq": (_append([(2, [7]), (2, [8])]), InvalidArgument),
    "append past max_model_len": (_append([(2, list(range(27))), (50, [9])]), InvalidArgument),
    "append past max_total_tokens": (_append([(1, [7, 8, 9]), (50, [9])]), InvalidArgument),
    "schedule a running seq with nothing to compute": (
        _set(schedule_seq_ids=[2, 50, 5], schedule_num_tokens=[1, 1, 1], free_seq_ids=[]), InvalidArgument),
    "schedule a fork child with nothing to compute": (_append([(2, [7])]), InvalidArgument),
    "schedule a swapped seq with nothing to compute": (
        lambda h, s: (_append([(2, [7]), (50, [9])])(h, s), _set(schedule_seq_ids=[2, 50, 3],
                                                                   schedule_num_tokens=[1, 1, 1])(h, s)),
        InvalidArgument),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_step_changes_nothing(busy, case):
    h = busy
    mod, error = BAD[case]
    good = base_step(h)
    bad = base_step(h)
    mod(h, bad)
    before = h.snapshot()
    with pytest.raises(error) as err:
        h.m.step(bad)
    assert isinstance(err.value, KvpagerError) and err.value.message
    assert h.snapshot() == before
    assert h.m.check_invariants() == []
    # the failed step did not use up its step id: the good version of it applies
    out = h.run(good)
    assert h.rows(out).keys() == {2, 50, 60} and 5 not in h.m.seqs and 50 in h.m.seqs


def test_bad_standalone_fork_and_free_change_nothing(busy):
    h = busy
    before = h.snapshot()
    for call, error in ((lambda: h.m.fork(3, [70]), FailedPrecondition), (lambda: h.m.fork(1, [2]), AlreadyExists),
                        (lambda: h.m.free([2, 4]), FailedPrecondition), (lambda: h.m.free([2, 2]), FailedPrecondition),
                        (lambda: h.m.free([99], abort=True), NotFound)):
        with pytest.raises(error):
            call()
        assert h.snapshot() == before


def test_bad_step_tokens_beyond_uint32_are_refused_before_any_change(harness):
    h = harness(num_blocks=8)  # no vocabulary limit registered
    h.step(new=[h.new(1, [1, 2, 3])], sched=[(1, 3)])
    before = h.snapshot()
    with pytest.raises(InvalidArgument):
        h.m.step(h.step_input(free=[1], new=[h.new(2, [1, 2, 3, 4, 2**40])], sched=[(2, 5)]))
    assert h.snapshot() == before


# ---- copy sources stay intact until the copies ran ---------------------------------------------


def test_a_copy_source_is_not_reused_as_a_swap_in_destination_in_the_same_step(harness):
    """The executor runs swap-outs, then swap-ins, then copies. A block that a
    copy reads must not be handed to a swap-in of the same step, even when its
    last other holder is preempted in between."""
    h = harness(num_blocks=4, num_swap_blocks=8, swap_min_tokens=3)
    h.step(new=[h.new(1, [1, 2, 3, 4], priority=0), h.new(2, [5, 6, 7], priority=3),
                h.new(3, [10, 11, 12, 13, 14, 15, 16, 17], priority=0)], sched=[(1, 4), (2, 3), (3, 8)])
    out = h.step(append={1: [5]}, sched=[(1, 1)])
    assert out.preempted == [(2, SWAP)]
    h.step(free=[1, 3])
    h.step(new=[h.new(4, [100, 101, 102, 103, 104, 105], priority=5), h.new(5, [200, 201, 202, 203])],
           sched=[(4, 6), (5, 4)])
    h.step(forks=[(4, [6])])
    assert h.table(4) == h.table(6) and len(h.free_ids()) == 1
    # 6 writes into the shared tail (a copy); 2 (swapped, priority 3) needs a block
    # and may preempt 4 (priority 5), the tail's last other holder
    out = h.step(append={6: [7], 2: [8]}, sched=[(6, 1), (2, 1)])
    o = h.ops(out)
    assert o.copy_src, "the fork child copies the shared tail"
    assert not set(o.copy_src) & set(o.swap_in_dst)
    assert not set(o.copy_src) & set(o.copy_dst)


# ---- accounting ----------------------------------------------------------------------------------


def test_accounting_for_a_fork_family(harness):
    h = harness(num_blocks=16, max_model_len=30)
    h.step(new=[h.new(1, range(6))], sched=[(1, 6)])
    total, (part,) = h.m.accounting()
    assert (part.used_blocks, part.free_blocks, part.live_tokens, part.allocated_slots) == (2, 14, 6, 8)
    assert part.kv_utilization == pytest.approx(6 / 8)
    h.m.fork(1, [2, 3])
    total, (part,) = h.m.accounting()
    assert (part.logical_blocks, part.physical_blocks, part.sharing_saved_blocks) == (6, 2, 4)
    assert part.live_tokens == 6 and part.used_blocks == 2
    assert part.num_sequences == 3
    assert part.contiguous_equivalent_blocks == 3 * 8  # ceil(30 / 4) each
    out = h.step(append={1: [6], 2: [7], 3: [8]}, sched=[(1, 1), (2, 1), (3, 1)])
    assert len(h.ops(out).copy_src) == 2
    total, (part,) = h.m.accounting()
    assert (part.logical_blocks, part.physical_blocks, part.sharing_saved_blocks) == (6, 4, 2)
    assert part.live_tokens == 4 + 3 * 3 and part.used_blocks == 4
    assert part.kv_utilization == pytest.approx(13 / 16)
    assert part.copy_on_write_copies == 2
    assert total.as_dict() == {**part.as_dict(), "executor_id": ""}


def test_accounting_totals_over_executors_and_cached_blocks(harness):
    h = harness(num_blocks=8, num_swap_blocks=2)
    h.m.register_executor(ExecutorSpec("e1", num_blocks=4, block_size=4, num_swap_blocks=1, model_id="m",
                                       dtype="float32", max_model_len=8))
    h.step(new=[h.new(1, range(9)), h.new(2, range(5), executor_id="e1")], sched=[(1, 9), (2, 5)])
    h.step(new=[h.new(3, range(9))], sched=[(3, 9)])  # hits 8 of 9
    total, parts = h.m.accounting()
    e0, e1 = parts
    assert (e0.used_blocks, e1.used_blocks, total.used_blocks) == (4, 2, 6)
    assert (total.total_blocks, total.free_blocks, total.swap_total_blocks) == (12, 6, 3)
    assert e0.contiguous_equivalent_blocks == 2 * 8 and e1.contiguous_equivalent_blocks == 2
    assert total.contiguous_equivalent_blocks == 18
    assert e0.prefix_hit_rate == pytest.approx(8 / 18) and e1.prefix_hit_rate == 0.0
    assert total.prefix_hit_rate == pytest.approx(8 / 23)
    assert total.kv_utilization == pytest.approx((9 + 9 - 8 + 5) / (6 * 4))
    h.step(free=[1, 3])
    _, (e0, _) = h.m.accounting()
    assert e0.cached_blocks == 2 and e0.free_blocks == 8 and e0.used_blocks == 0
    assert h.m.accounting("e1")[1][0].executor_id == "e1"
    with pytest.raises(NotFound):
        h.m.accounting("nope")
