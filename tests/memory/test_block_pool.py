"""Exact tests of the block pool, the free queue, the swap pool and the prefix
hash: block ids, refcounts and free-queue order after every operation."""

from __future__ import annotations

import hashlib
import struct

import pytest

from memory_service.block import Block, FreeBlockQueue
from memory_service.block_pool import BlockPool, SwapPool
from memory_service.events import AllCleared, BlockRemoved, BlockStored, EventQueue
from kvpager.prefix_index.hashing import hash_block, hash_blocks, namespace_digest, root_hash


def ids(blocks):
    return [b.block_id for b in blocks]


def make_pool(num_blocks=6, block_size=4, events=True):
    return BlockPool("e0", num_blocks, block_size, EventQueue(enabled=events))


def cache(pool, block, tag, parent=None, depth=0):
    """Index `block` under a hash named by `tag`, with tokens [tag] * block_size."""
    h = hashlib.sha256(str(tag).encode()).digest()
    assert pool.cache_block(block, h, [tag] * pool.block_size, parent, depth)
    return h


# ---- free queue -----------------------------------------------------------------


def test_free_queue_order_remove_and_popleft():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and q.num_free == 5
    q.remove(blocks[2])  # middle
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert q.block_ids() == [1, 3] and q.num_free == 2
    assert not blocks[2].in_free_queue and blocks[2].prev_free is None and blocks[2].next_free is None
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 0]
    assert q.popleft() is blocks[1]
    assert q.popleft() is blocks[3]
    assert q.popleft() is blocks[0]
    assert q.block_ids() == [] and q.num_free == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_refuses_a_block_twice():
    blocks = [Block(0)]
    q = FreeBlockQueue(blocks)
    with pytest.raises(AssertionError):
        q.append(blocks[0])
    assert q.block_ids() == [0]


# ---- allocate / free ------------------------------------------------------------


def test_allocate_pops_the_head_with_refcount_one():
    pool = make_pool()
    a = pool.allocate(2)
    assert ids(a) == [0, 1] and [b.ref_cnt for b in a] == [1, 1]
    assert pool.free_queue.block_ids() == [2, 3, 4, 5] and pool.num_free == 4
    b = pool.allocate(3)
    assert ids(b) == [2, 3, 4]
    assert pool.free_queue.block_ids() == [5]


def test_allocate_short_returns_none_and_changes_nothing():
    pool = make_pool()
    pool.allocate(4)
    assert pool.allocate(3) is None
    assert pool.free_queue.block_ids() == [4, 5]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 0, 0]
    assert pool.allocate(0) == []


def test_free_appends_in_reverse_so_the_tail_is_evicted_first():
    pool = make_pool()
    a = pool.allocate(4)
    assert pool.free(a) == 4
    # remaining free first, then the freed sequence tail-first
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0] * 6


def test_free_of_a_shared_block_only_drops_a_reference():
    pool = make_pool()
    a = pool.allocate(2)
    pool.touch([a[0]])  # a second holder of block 0
    assert [b.ref_cnt for b in a] == [2, 1]
    assert pool.free(a) == 1  # only block 1 became free
    assert [b.ref_cnt for b in a] == [1, 0]
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1]
    assert pool.free([a[0]]) == 1
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    with pytest.raises(AssertionError):
        pool.free([a[0]])  # a double free is a bug in the caller, never silent


# ---- prefix index -----------------------------------------------------------------


def test_cached_free_block_is_taken_back_by_touch_from_the_middle():
    pool = make_pool()
    a = pool.allocate(3)
    h = cache(pool, a[1], 7)
    pool.free(a)
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert pool.num_cached_free == 1
    hit = pool.lookup(h, [7, 7, 7, 7])
    assert hit is a[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_cached_free == 0
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 0]
    pool.touch([hit])  # a live block: only the refcount moves
    assert hit.ref_cnt == 2 and pool.free_queue.block_ids() == [3, 4, 5, 2, 0]


def test_cache_block_emits_block_stored_and_keeps_one_block_per_hash():
    pool = make_pool()
    a = pool.allocate(2)
    h0 = cache(pool, a[0], 1)
    h1 = hashlib.sha256(b"child").digest()
    assert pool.cache_block(a[1], h1, [2] * 4, h0, 1)
    stored = pool.events.drain()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert (stored[0].block_hash, stored[0].parent_hash, stored[0].block_id, stored[0].depth) == (h0, None, 0, 0)
    assert (stored[1].block_hash, stored[1].parent_hash, stored[1].block_id, stored[1].depth) == (h1, h0, 1, 1)
    # another block with the same content is not indexed a second time
    b = pool.allocate(1)[0]
    assert not pool.cache_block(b, h0, [1] * 4, None, 0)
    assert b.block_hash is None and pool.cached[h0] is a[0]
    # a block already indexed is not re-indexed under another hash
    assert not pool.cache_block(a[0], hashlib.sha256(b"x").digest(), [9] * 4, None, 0)
    assert len(pool.events) == 0


def test_lookup_verifies_tokens_so_a_collision_never_hits():
    pool = make_pool()
    a = pool.allocate(1)
    h = cache(pool, a[0], 3)
    assert pool.lookup(h, [3, 3, 3, 3]) is a[0]
    assert pool.lookup(h, [3, 3, 3, 4]) is None  # same hash, other tokens
    assert pool.lookup(hashlib.sha256(b"nope").digest(), [3, 3, 3, 3]) is None


def test_lru_eviction_drops_the_hash_and_emits_block_removed():
    pool = make_pool(num_blocks=4)
    a = pool.allocate(2)
    h0, h1 = cache(pool, a[0], 10), cache(pool, a[1], 11, depth=1)
    pool.events.drain()
    pool.free(a)
    assert pool.free_queue.block_ids() == [2, 3, 1, 0] and pool.num_cached_free == 2
    # the two uncached blocks go first; the cached ones stay findable
    assert ids(pool.allocate(2)) == [2, 3]
    assert pool.lookup(h1, [11] * 4) is a[1] and len(pool.events) == 0
    # the next allocation reuses block 1 (freed before block 0): evicted
    assert ids(pool.allocate(1)) == [1]
    assert pool.lookup(h1, [11] * 4) is None and h1 not in pool.cached
    assert a[1].block_hash is None and a[1].token_ids is None
    assert pool.events.drain() == [BlockRemoved("e0", h1, 1)]
    assert pool.num_evictions == 1 and pool.num_cached_free == 1
    assert pool.lookup(h0, [10] * 4) is a[0]


def test_events_disabled_by_default_cost_nothing():
    pool = BlockPool("e0", 2, 4)
    a = pool.allocate(1)
    cache(pool, a[0], 1)
    pool.free(a)
    pool.allocate(2)
    assert len(pool.events) == 0 and pool.events.num_emitted == 0 and pool.num_evictions == 1


def test_clear_forgets_every_hash_and_emits_all_cleared():
    pool = make_pool()
    a = pool.allocate(2)
    cache(pool, a[0], 1)
    cache(pool, a[1], 2)
    pool.free([a[1]])
    pool.events.drain()
    pool.clear()
    assert pool.cached == {} and pool.num_cached_free == 0
    assert all(b.block_hash is None and b.token_ids is None for b in pool.blocks)
    assert pool.events.drain() == [AllCleared("e0")]


def test_event_queue_drain_is_fifo_and_bounded():
    q = EventQueue(enabled=True)
    for i in range(5):
        q.emit(AllCleared(str(i)))
    assert [e.executor_id for e in q.drain(2)] == ["0", "1"]
    assert [e.executor_id for e in q.drain()] == ["2", "3", "4"]
    assert q.num_emitted == 5 and len(q) == 0


# ---- swap pool ------------------------------------------------------------------------


def test_swap_pool_hands_out_lowest_ids_and_refuses_when_short():
    swap = SwapPool(4)
    assert swap.allocate(2) == [0, 1] and swap.num_free == 2
    assert swap.allocate(3) is None and swap.num_free == 2
    swap.free([1])
    assert swap.num_free == 3
    assert sorted(swap.allocate(3)) == [1, 2, 3]
    assert swap.allocate(1) is None
    assert SwapPool(0).allocate(1) is None


def test_pool_rejects_empty_geometry():
    with pytest.raises(ValueError):
        BlockPool("e0", 0, 4)
    with pytest.raises(ValueError):
        BlockPool("e0", 4, 0)


# ---- prefix hash -------------------------------------------------------------------------


def test_hash_is_sha256_over_parent_and_little_endian_uint32_tokens():
    parent = b"\x01" * 32
    tokens = [1, 256, 2**32 - 1]
    expected = hashlib.sha256(parent + struct.pack("<3I", *tokens)).digest()
    assert hash_block(parent, tokens) == expected


def test_hash_chain_root_and_salt():
    ns = namespace_digest("m", 4, "float32")
    assert ns == namespace_digest("m", 4, "float32")
    assert len({ns, namespace_digest("m2", 4, "float32"), namespace_digest("m", 8, "float32"),
                namespace_digest("m", 4, "float16"), namespace_digest("m", 4, "float32", "lora")}) == 5
    assert root_hash(ns) == ns and root_hash(ns, "") == ns
    assert root_hash(ns, "a") != root_hash(ns, "b") != ns
    tokens = list(range(10))
    hs = hash_blocks(ns, tokens, 4)
    assert len(hs) == 2  # full blocks only
    assert hs[0] == hash_block(ns, tokens[:4]) and hs[1] == hash_block(hs[0], tokens[4:8])
    assert hash_blocks(ns, tokens, 4, start=1, parent=hs[0]) == hs[1:]
    assert hash_blocks(ns, tokens, 4, limit=1) == hs[:1]
    # the same block content under another prefix is another block
    assert hash_block(hs[0], tokens[:4]) != hs[0]
