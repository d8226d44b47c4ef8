"""Exact tests of the per-executor KV manager (ExecutorKV) on a tiny pool:
prefix hits, admission, slot allocation with copy-on-write, fork, swap and
release — block ids, refcounts, free-queue order and cache ops."""

from __future__ import annotations

import pytest

from memory_service.events import BlockStored, EventQueue
from memory_service.kv_manager import ExecutorKV, ExecutorSpec
from kvpager.prefix_index.hashing import hash_block, namespace_digest, root_hash
from kvpager.seq_status import SeqStatus
from memory_service.sequence import Sequence

BS = 4


def make_kv(num_blocks=8, num_swap_blocks=0, events=True):
    spec = ExecutorSpec("e0", num_blocks=num_blocks, block_size=BS, num_swap_blocks=num_swap_blocks,
                        model_id="m", dtype="float32")
    return ExecutorKV(spec, EventQueue(enabled=events))


def make_seq(seq_id, tokens, salt=""):
    return Sequence(seq_id, "e0", list(tokens), root_hash(namespace_digest("m", BS, "float32"), salt))


def table(seq):
    return [b.block_id for b in seq.blocks]


def refs(kv):
    return [b.ref_cnt for b in kv.pool.blocks]


def free_ids(kv):
    return kv.pool.free_queue.block_ids()


def run(kv, seq, k):
    """Admit (if waiting) or extend seq by k tokens, then commit: one scheduled chunk."""
    if seq.status is SeqStatus.WAITING:
        hit, granted = kv.admit(seq, k, count_hits=True)
        kv.commit(seq, granted)
        return hit, granted
    assert kv.allocate_slots(seq, k)
    kv.commit(seq, k)
    return None


def test_admit_grants_only_the_chunk_and_commit_indexes_full_blocks():
    kv = make_kv()
    s = make_seq(1, range(10))
    assert kv.admit(s, 6, count_hits=True) == (0, 6)
    assert table(s) == [0, 1] and s.num_computed == 0 and s.status is SeqStatus.RUNNING
    kv.commit(s, 6)
    assert s.num_computed == 6 and s.num_cached_blocks == 1
    h0 = hash_block(s.root_hash, [0, 1, 2, 3])
    assert kv.pool.cached == {h0: kv.pool.blocks[0]}
    assert kv.pool.events.drain() == [BlockStored("e0", h0, None, 0, 0, (0, 1, 2, 3))]
    # the rest of the prompt: one more block, and block 1 is full now
    assert kv.allocate_slots(s, 4)
    assert table(s) == [0, 1, 2] and free_ids(kv) == [3, 4, 5, 6, 7]
    kv.commit(s, 4)
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert s.block_hashes == [h0, h1]
    assert kv.pool.events.drain() == [BlockStored("e0", h1, h0, 1, 1, (4, 5, 6, 7))]


def test_allocate_slots_short_changes_nothing():
    kv = make_kv(num_blocks=2)
    s = make_seq(1, range(12))
    run(kv, s, 8)
    assert free_ids(kv) == []
    before = (table(s), refs(kv), s.num_computed)
    assert not kv.allocate_slots(s, 1)
    assert (table(s), refs(kv), s.num_computed) == before


def test_prompt_of_k_full_blocks_hits_k_minus_1_the_last_token_is_recomputed():
    kv = make_kv()
    a = make_seq(1, range(8))
    run(kv, a, 8)
    assert table(a) == [0, 1]
    b = make_seq(2, range(8))
    assert table_of(kv.find_prefix(b)) == [0]
    hit, granted = run(kv, b, 8)
    assert (hit, granted) == (4, 4)
    assert table(b) == [0, 2] and refs(kv)[:3] == [2, 1, 1]
    # one token more and both blocks hit
    c = make_seq(3, list(range(8)) + [99])
    assert run(kv, c, 9) == (8, 1)
    assert table(c) == [0, 1, 3] and refs(kv)[:4] == [3, 2, 1, 1]
    assert (kv.counters.prefix_query_tokens, kv.counters.prefix_hit_tokens) == (8 + 8 + 9, 4 + 8)


def table_of(blocks):
    return [b.block_id for b in blocks]


def test_hits_in_the_free_queue_are_not_counted_as_free_room():
    kv = make_kv(num_blocks=3)
    a = make_seq(1, range(9))
    run(kv, a, 9)
    kv.release(a)
    assert free_ids(kv) == [2, 1, 0] and kv.pool.num_cached_free == 2
    # 13 tokens: 2 hit blocks (both free, cached) + 2 fresh = 4 > 3 blocks
    big = make_seq(2, list(range(8)) + [50, 51, 52, 53, 54])
    before = (free_ids(kv), refs(kv), sorted(kv.pool.cached))
    assert kv.admit(big, 13, count_hits=True) is None
    assert (free_ids(kv), refs(kv), sorted(kv.pool.cached)) == before
    assert big.blocks == [] and big.status is SeqStatus.WAITING
    # 9 tokens: 2 hits + 1 fresh fits exactly
    b = make_seq(3, range(9))
    assert kv.admit(b, 9, count_hits=True) == (8, 1)
    assert table(b) == [0, 1, 2] and free_ids(kv) == [] and kv.pool.num_cached_free == 0


def test_salted_sequences_never_share_blocks():
    kv = make_kv()
    a = make_seq(1, range(9), salt="tenant-a")
    run(kv, a, 9)
    assert kv.find_prefix(make_seq(2, range(9), salt="tenant-b")) == []
    assert kv.find_prefix(make_seq(3, range(9))) == []
    assert table_of(kv.find_prefix(make_seq(4, range(9), salt="tenant-a"))) == [0, 1]
    assert kv.count_prefix_blocks(a.root_hash, list(range(9))) == 2
    assert kv.count_prefix_blocks(a.root_hash, list(range(9)), limit=1) == 1
    assert kv.count_prefix_blocks(make_seq(5, []).root_hash, list(range(9))) == 0


def test_fork_shares_every_block_and_cow_copies_only_the_written_shared_block():
    kv = make_kv()
    p = make_seq(1, range(6))
    run(kv, p, 6)
    assert table(p) == [0, 1]
    c1, c2 = make_seq(2, p.token_ids), make_seq(3, p.token_ids)
    assert kv.fork(p, c1) == 2 and kv.fork(p, c2) == 2
    assert table(c1) == table(c2) == [0, 1] and refs(kv)[:2] == [3, 3]
    assert c1.num_computed == 6 and c1.status is SeqStatus.RUNNING
    for s, tok in ((p, 100), (c1, 101), (c2, 102)):
        s.token_ids.append(tok)
    # two writers copy the shared partial block 1; the last holder writes in place
    assert kv.allocate_slots(c1, 1)
    assert table(c1) == [0, 2]
    assert kv.allocate_slots(c2, 1)
    assert table(c2) == [0, 3]
    assert kv.allocate_slots(p, 1)
    assert table(p) == [0, 1]
    # until the copies ran, the source keeps their references
    assert refs(kv)[:4] == [3, 3, 1, 1]
    ops = kv.take_ops()
    assert refs(kv)[:4] == [3, 1, 1, 1]
    assert (ops.copy_src, ops.copy_dst) == ([1, 1], [2, 3])
    assert kv.counters.cow_copies == 2
    for s in (p, c1, c2):
        kv.commit(s, 1)
    # one more token each fills the now private blocks, without any copy
    for s, tok in ((p, 200), (c1, 201), (c2, 202)):
        s.token_ids.append(tok)
        assert kv.allocate_slots(s, 1)
        kv.commit(s, 1)
    assert not kv.take_ops() and table(p) == [0, 1] and table(c1) == [0, 2] and table(c2) == [0, 3]
    # full, diverged blocks are distinct in the index
    assert len({b.block_hash for b in (kv.pool.blocks[1], kv.pool.blocks[2], kv.pool.blocks[3])}) == 3


def test_a_copy_source_is_not_reusable_before_the_step_ops_are_taken():
    kv = make_kv(num_blocks=3)
    p = make_seq(1, range(6))
    run(kv, p, 6)
    c = make_seq(2, p.token_ids)
    kv.fork(p, c)
    c.token_ids.append(7)
    assert kv.allocate_slots(c, 1)
    assert (table(c), free_ids(kv)) == ([0, 2], [])
    kv.release(p)  # the source's last other holder goes (a preemption, say)
    assert free_ids(kv) == [] and refs(kv) == [1, 1, 1]
    ops = kv.take_ops()
    assert (ops.copy_src, ops.copy_dst) == ([1], [2])
    assert free_ids(kv) == [1] and refs(kv) == [1, 0, 1]


def test_cow_is_all_or_nothing_when_the_pool_is_short():
    kv = make_kv(num_blocks=2)
    p = make_seq(1, range(6))
    run(kv, p, 6)
    c = make_seq(2, p.token_ids)
    kv.fork(p, c)
    c.token_ids.append(7)
    assert not kv.allocate_slots(c, 1)  # needs a copy of block 1 and there is no free block
    assert table(c) == [0, 1] and refs(kv) == [2, 2] and not kv.take_ops()


def test_swap_out_and_in_emit_ops_and_defer_cpu_reuse_to_the_end_of_the_step():
    kv = make_kv(num_blocks=4, num_swap_blocks=3)
    s = make_seq(1, range(6))
    run(kv, s, 6)
    assert kv.can_swap_out(s)
    kv.preempt_swap(s)
    assert s.status is SeqStatus.SWAPPED and s.blocks == [] and s.swap_blocks == [0, 1]
    assert s.num_computed == 6 and kv.swap.num_free == 1
    ops = kv.take_ops()
    assert (ops.swap_out_src, ops.swap_out_dst) == ([0, 1], [0, 1])
    assert free_ids(kv) == [2, 3, 1, 0] and refs(kv) == [0, 0, 0, 0]
    # block 0 (full, cached) still serves prefix hits while the sequence is away
    other = make_seq(2, range(5))
    run(kv, other, 5)
    assert table(other) == [0, 2]
    # swap in with room for one more token: into fresh device blocks
    s.token_ids.append(6)
    assert kv.swap_in(s, 1)
    assert s.status is SeqStatus.RUNNING and table(s) == [3, 1] and s.swap_blocks == []
    ops = kv.take_ops()
    assert (ops.swap_in_src, ops.swap_in_dst) == ([0, 1], [3, 1])
    assert kv.swap.num_free == 3  # given back with take_ops, not before
    kv.commit(s, 1)
    assert s.num_computed == 7


def test_swap_in_needs_room_for_the_new_tokens_too():
    kv = make_kv(num_blocks=3, num_swap_blocks=2)
    s = make_seq(1, range(8))
    run(kv, s, 8)
    kv.preempt_swap(s)
    kv.take_ops()
    hog = make_seq(2, [50])
    run(kv, hog, 1)
    s.token_ids.append(9)
    before = (free_ids(kv), refs(kv), kv.swap.num_free)
    assert not kv.swap_in(s, 1)  # 2 swapped blocks + 1 for token 8 > 2 free
    assert (free_ids(kv), refs(kv), kv.swap.num_free) == before and s.swap_blocks == [0, 1]
    assert not kv.take_ops()


def test_release_gives_back_device_and_swap_blocks():
    kv = make_kv(num_blocks=4, num_swap_blocks=4)
    a, b = make_seq(1, range(6)), make_seq(2, range(100, 105))
    run(kv, a, 6)
    run(kv, b, 5)
    kv.preempt_swap(b)
    kv.take_ops()
    assert kv.release(a) == 2 and kv.release(b) == 0
    assert kv.swap.num_free == 4 and refs(kv) == [0, 0, 0, 0]
    assert a.num_computed == 0 and a.blocks == [] and b.swap_blocks == []


def test_recompute_preemption_frees_and_keeps_the_prefix_findable():
    kv = make_kv(num_blocks=4)
    s = make_seq(1, range(9))
    run(kv, s, 9)
    kv.preempt_recompute(s)
    assert s.status is SeqStatus.WAITING and s.blocks == [] and s.num_computed == 0
    assert free_ids(kv) == [3, 2, 1, 0] and kv.counters.preemptions_recompute == 1
    assert kv.admit(s, 9, count_hits=False) == (8, 1)
    assert table(s) == [0, 1, 3]
    assert kv.counters.prefix_query_tokens == 9 and kv.counters.prefix_hit_tokens == 0


@pytest.mark.parametrize("num_tokens,fits", [(16, True), (17, False)])
def test_can_ever_fit(num_tokens, fits):
    assert make_kv(num_blocks=4).can_ever_fit(num_tokens) is fits
