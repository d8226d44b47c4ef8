"""The block map's frames, exact on a tiny pool: one byte per block (free,
cached by LRU age, in use by refcount), runs that turn one frame into the
next, full states for new or re-registered pools, flashes for evictions."""

from __future__ import annotations

import base64

import numpy as np

from memory_service.blockmap.frames import Subscriber, pool_cells, runs, swap_cells
from memory_service.kv_manager import ExecutorKV, ExecutorSpec


class Manager:
    """What Subscriber reads: executors, seqs and the retention pins."""

    def __init__(self, *kvs: ExecutorKV) -> None:
        from memory_service.retention import PinBudget

        self.executors = {kv.spec.executor_id: kv for kv in kvs}
        self.seqs = {}
        self.retention = PinBudget(None)


def kv8() -> ExecutorKV:
    return ExecutorKV(ExecutorSpec("e", num_blocks=8, block_size=2, num_swap_blocks=4))


def test_cells_say_free_cached_by_age_and_refcount():
    kv = kv8()
    pool = kv.pool
    b0, b1, b2, b3 = pool.allocate(4)
    pool.touch([b0])                                   # refcount 2
    pool.cache_block(b1, b"h1", [1, 2], None, 0)
    pool.cache_block(b3, b"h3", [3, 4], b"h1", 1)
    pool.free([b1])                                    # cached, freed first (evicted before b3)
    pool.free([b2])                                    # free, never cached
    pool.free([b3])                                    # cached, freed last
    assert pool_cells(kv).tolist() == [102, 1, 0, 51, 0, 0, 0, 0]
    pool.allocate(5)                                   # pops 4..7 then b1 (its hash dropped): an eviction
    assert pool_cells(kv).tolist() == [102, 101, 0, 1, 101, 101, 101, 101]
    assert list(pool.recent_evictions) == [1]


def test_runs_turn_one_frame_into_the_next():
    prev = np.array([0, 0, 5, 5, 5, 0, 7], dtype=np.uint8)
    cur = np.array([0, 3, 3, 5, 9, 9, 7], dtype=np.uint8)
    r = runs(cur, prev)
    assert r == [1, 2, 3, 4, 2, 9]
    out = prev.copy()
    for s, n, v in zip(r[::3], r[1::3], r[2::3]):
        out[s:s + n] = v
    assert out.tolist() == cur.tolist()
    assert runs(cur, cur) == []
    assert runs(cur, None) == [0, 1, 0, 1, 2, 3, 3, 1, 5, 4, 2, 9, 6, 1, 7]


def test_subscriber_sends_a_full_state_then_changes_and_flashes():
    kv = kv8()
    m = Manager(kv)
    sub = Subscriber()
    first = sub.update(m, 1)["executors"][0]
    assert base64.b64decode(first["cells_b64"]) == bytes(8) and first["seqs"] == [] and "acct" in first
    assert base64.b64decode(first["swap_b64"]) == bytes(4)
    (b0,) = kv.pool.allocate(1)
    kv.pool.cache_block(b0, b"h", [1, 2], None, 0)
    kv.pool.free([b0])
    kv.swap.allocate(1)
    second = sub.update(m, 2)["executors"][0]
    assert second["runs"] == [0, 1, 1] and second["swap_runs"] == [0, 1, 1]
    assert second["acct"]["cached_blocks"] == 1 and second["flash_evicted"] == []
    kv.pool.allocate(8)                                # every block, b0's content evicted
    third = sub.update(m, 3)["executors"][0]
    assert third["flash_evicted"] == [0] and third["runs"] == [0, 8, 101]
    assert sub.update(m, 3)["executors"][0]["runs"] == [] and "acct" not in sub.update(m, 3)["executors"][0]
    # a re-registered pool (new table epoch) starts again with a full state; a gone one is named
    m.executors["e"] = kv8()
    assert "cells_b64" in sub.update(m, 4)["executors"][0]
    del m.executors["e"]
    assert sub.update(m, 5)["removed"] == ["e"]
    assert swap_cells(kv).tolist() == [1, 0, 0, 0]
