"""The per-group block tables (memory_service.kv_groups), exactly: block ids,
holes, refcounts, free-queue order, copy-on-write pairs and prefix hits that
intersect the groups."""

from __future__ import annotations

from kvpager.kv_spec import KvGroupSpec
from memory_service.block_pool import BlockPool
from memory_service.kv_groups import GroupedKV, group_root

BS, W = 4, 8
GEMMA = [KvGroupSpec(None, (1, 3)), KvGroupSpec(W, (0, 2))]   # half the layers sliding
MISTRAL = [KvGroupSpec(W, (0, 1))]                             # every layer sliding
ROOT = b"r" * 32


def _kv(groups, num_blocks=32):
    return GroupedKV(BlockPool("e0", num_blocks, BS), groups)


def _ids(table):
    return [None if b is None else b.block_id for b in table]


def _decode_to(kv, seq, total, check=None):
    while seq.num_computed < total:
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(7 + seq.num_computed % 50)
        assert kv.allocate_slots(seq, 1)
        kv.commit(seq, 1)
        if check:
            check(seq)


def test_sliding_group_frees_what_the_window_passed():
    kv = _kv(GEMMA)
    seq = kv.new_seq(1, list(range(10, 20)), ROOT)
    assert kv.admit(seq, 10) == (0, 10)
    assert [_ids(t) for t in seq.tables] == [[0, 1, 2], [3, 4, 5]]
    assert kv.commit(seq, 10) == 0        # next query at 10 sees keys >= 3: block 0 still read
    seq.token_ids.append(20)
    assert kv.allocate_slots(seq, 1) and kv.commit(seq, 1) == 1   # 11: keys >= 4: block 0 passed
    seq.token_ids.append(21)
    assert kv.allocate_slots(seq, 1) and kv.commit(seq, 1) == 0   # 12: keys >= 5
    assert [_ids(t) for t in seq.tables] == [[0, 1, 2], [None, 4, 5]]
    assert kv.pool.blocks[3].ref_cnt == 0 and kv.pool.blocks[3].block_hash is not None  # cached, free
    assert kv.pool.free_queue.block_ids()[-1] == 3  # at the tail: evicted last

    bound = -(-W // BS) + 1

    def check(s):
        first = kv.first_needed(1, s.num_computed)
        sliding = s.tables[1]
        assert all(b is None for b in sliding[:first]) and all(b is not None for b in sliding[first:])
        assert kv.num_held(s, 1) <= bound
        assert kv.num_held(s, 0) == -(-s.num_computed // BS)  # the full group keeps everything

    _decode_to(kv, seq, 4 * W, check)
    assert seq.num_computed == 32 and len(seq.tables[1]) == 8
    assert kv.num_held(seq, 0) == 8 and kv.num_held(seq, 1) == 2  # keys 25..31: blocks 6, 7
    child = kv.fork(seq, 2)
    full, sliding = kv.usage([seq, child])
    assert (full.used_blocks, full.logical_blocks, full.window_saved_blocks) == (8, 16, 0)
    assert (sliding.used_blocks, sliding.logical_blocks, sliding.full_attention_blocks) == (2, 4, 16)
    assert sliding.window_saved_blocks == 12
    kv.release(child)
    assert kv.release(seq) == 10 and kv.pool.num_free == 32


def test_all_sliding_long_prefill_then_window():
    kv = _kv(MISTRAL)
    seq = kv.new_seq(1, [5 + i % 40 for i in range(4 * W)], ROOT)
    assert kv.admit(seq, 4 * W) == (0, 32)
    assert kv.num_held(seq, 0) == 8              # the chunk's own tokens are written in one step
    assert kv.commit(seq, 32) == 6               # next query 32 sees keys >= 25: blocks 6, 7 stay
    assert _ids(seq.tables[0]) == [None] * 6 + [6, 7]
    assert kv.pool.num_free == 30


def test_fork_and_copy_on_write_per_group():
    kv = _kv(GEMMA)
    parent = kv.new_seq(1, list(range(10, 20)), ROOT)
    kv.admit(parent, 10)
    kv.commit(parent, 10)
    child = kv.fork(parent, 2)
    assert [kv.pool.blocks[i].ref_cnt for i in range(6)] == [2] * 6
    child.token_ids.append(99)
    assert kv.blocks_needed(child, 1) == 2      # the shared partial tail of each group
    assert kv.allocate_slots(child, 1)
    assert kv.take_copies() == [(2, 6), (5, 7)]
    assert [_ids(t) for t in child.tables] == [[0, 1, 6], [3, 4, 7]]
    assert kv.pool.blocks[2].ref_cnt == 1 and kv.pool.blocks[5].ref_cnt == 1  # pins went with the copies
    kv.commit(child, 1)
    kv.release(parent)
    kv.release(child)
    assert kv.pool.num_free == 32


def test_a_short_pool_changes_nothing():
    kv = _kv(GEMMA, num_blocks=5)
    seq = kv.new_seq(1, list(range(10, 20)), ROOT)
    assert kv.admit(seq, 10) is None             # 3 blocks per group
    assert all(t == [] for t in seq.tables) and kv.pool.num_free == 5
    assert kv.admit(seq, 4) == (0, 4)
    kv.commit(seq, 4)
    assert kv.allocate_slots(seq, 6) is False    # 2 more per group, 3 free
    assert [_ids(t) for t in seq.tables] == [[0], [1]] and kv.pool.num_free == 3


def test_prefix_hit_is_the_longest_every_group_satisfies():
    kv = _kv(GEMMA, num_blocks=40)
    prompt = list(range(100, 124))                # 6 full blocks
    a = kv.new_seq(1, prompt + [1], ROOT)
    kv.admit(a, 25)
    kv.commit(a, 25)                              # next query 25 sees keys >= 18: sliding 0..3 passed
    assert [_ids(t) for t in a.tables] == [[0, 1, 2, 3, 4, 5, 6], [None] * 4 + [11, 12, 13]]
    assert kv.pool.free_queue.block_ids()[-4:] == [10, 9, 8, 7]  # freed, still cached, tail first
    b = kv.new_seq(2, prompt[:16] + [9, 9], ROOT)
    hit, tables = kv.find_prefix(b)
    # L = 16: the full group holds [0, 16), the sliding group [9, 16): blocks 2, 3.
    assert hit == 16 and [_ids(t) for t in tables] == [[0, 1, 2, 3], [None, None, 9, 10]]
    # Other allocations take every never-used block and then evict the oldest freed one: 10.
    never_used = kv.pool.num_free - kv.pool.num_cached_free
    other = kv.pool.allocate(never_used + 1)
    assert kv.pool.blocks[10].block_hash is None
    hit, tables = kv.find_prefix(b)
    # L = 16 needs sliding blocks 2, 3 (3 is gone); L = 12 needs [5, 12): blocks 1, 2.
    assert hit == 12 and [_ids(t) for t in tables] == [[0, 1, 2], [None, 8, 9]]
    assert kv.admit(b, 18) is None                # 2 blocks per group to add, 3 cached free: short
    kv.pool.free(other[:5])
    assert kv.admit(b, 18) == (12, 6)
    assert [_ids(t)[:3] for t in b.tables] == [[0, 1, 2], [None, 8, 9]]
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[8].ref_cnt == 1
    kv.release(b)
    kv.release(a)
    kv.pool.free(other[5:])
    assert kv.pool.num_free == 40


def test_groups_hash_under_their_own_roots():
    assert group_root(ROOT, 0) == ROOT
    assert len({group_root(ROOT, g) for g in range(3)}) == 3
    kv = _kv(GEMMA)
    seq = kv.new_seq(1, list(range(9)), ROOT)
    kv.admit(seq, 9)
    kv.commit(seq, 9)
    assert seq.tables[0][0].block_hash != seq.tables[1][0].block_hash
