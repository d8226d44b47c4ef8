"""The block map's frames: every physical block of every executor's pool as
one byte, and the deltas between two frames as runs.

A cell byte says what the block is now::

    0            free (never cached, or its content evicted)
    1 .. 100     cached and evictable (refcount 0, findable by hash), by LRU
                 age: 1 is evicted next, 100 was freed last
    101 .. 200   in use, 100 + refcount (capped at 200)

A swap cell is 0 (free) or 1 (holds a swapped-out block). A client keeps
the arrays and applies updates: a full state (``cells_b64``: the bytes,
base64) or runs (``runs``: flat ``[start, length, value, ...]``, positions
``start .. start+length-1`` become ``value``); the sequence list whole
(``seqs``) or as changed rows and removed ids, the accounting only when it
changed. Runs cost O(changes), so a
100,000-block pool decoding a few sequences sends a few hundred bytes an
update. Built on demand from the manager's state (O(pool) numpy plus one
walk of the free queue), never on the Step path.
"""

from __future__ import annotations

import base64
import itertools
import operator
import time
from dataclasses import dataclass

import numpy as np

from memory_service.accounting import executor_accounting
from memory_service.kv_manager import ExecutorKV
from memory_service.sequence import Sequence

FREE = 0
CACHED_MIN, CACHED_MAX = 1, 100
USED_BASE, USED_MAX = 100, 200
MAX_SEQS = 4096            # sequences listed per executor per frame (the rest counted)
_REF = operator.attrgetter("ref_cnt")


@dataclass(slots=True)
class PoolFrame:
    """One executor's pool at one moment."""

    executor_id: str
    table_epoch: int
    block_size: int
    cells: np.ndarray          # uint8 [num_blocks]
    swap_cells: np.ndarray     # uint8 [num_swap_blocks]
    seqs: dict[str, list]      # seq id (a string: ids pass 2**53) -> [seq_id, request_id, status, tokens,
                               #   computed, blocks, shared, swap blocks]
    num_seqs: int
    acct: dict
    num_evictions: int
    num_copies: int


def pool_cells(kv: ExecutorKV) -> np.ndarray:
    """The cell bytes of ``kv``'s device pool (see the module docstring)."""
    pool = kv.pool
    n = pool.num_blocks
    refs = np.fromiter(map(_REF, pool.blocks), dtype=np.int32, count=n)
    cells = np.zeros(n, dtype=np.uint8)
    used = refs > 0
    cells[used] = USED_BASE + np.minimum(refs[used], USED_MAX - USED_BASE)
    k = pool.num_cached_free
    if k:
        # From the tail of the free queue (freed last) until every cached free block is seen:
        # O(the recently freed blocks), not O(free) — never-cached free blocks sit at the head.
        newest = []
        for block in pool.free_queue.iter_newest():
            if block.block_hash is not None:
                newest.append(block.block_id)
                if len(newest) == k:
                    break
        ages = np.asarray(newest[::-1], dtype=np.int64)                    # evicted next first
        rank = np.arange(ages.size, dtype=np.int64)
        cells[ages] = CACHED_MIN + (rank * (CACHED_MAX - CACHED_MIN + 1)) // ages.size
    return cells


def swap_cells(kv: ExecutorKV) -> np.ndarray:
    cells = np.ones(kv.swap.num_blocks, dtype=np.uint8)
    free = kv.swap.free_ids()
    if free:
        cells[np.asarray(free, dtype=np.int64)] = 0
    return cells


def sequence_rows(kv: ExecutorKV, seqs: dict[int, Sequence]) -> dict[str, list]:
    rows = {}
    for seq_id in itertools.islice(sorted(kv.seq_ids), MAX_SEQS):
        seq = seqs[seq_id]
        shared = sum(1 for b in seq.blocks if b.ref_cnt > 1)
        rows[str(seq_id)] = [str(seq_id), seq.request_id, seq.status.value, seq.num_known, seq.num_computed,
                             len(seq.blocks), shared, len(seq.swap_blocks)]
    return rows


def pool_frame(kv: ExecutorKV, seqs: dict[int, Sequence], pinned_blocks: int = 0) -> PoolFrame:
    acct = executor_accounting(kv, seqs, pinned_blocks=pinned_blocks).as_dict()
    acct["internal_waste_slots"] = acct["allocated_slots"] - acct["live_tokens"]
    return PoolFrame(kv.spec.executor_id, kv.table_epoch, kv.block_size, pool_cells(kv), swap_cells(kv),
                     sequence_rows(kv, seqs), len(kv.seq_ids), acct, kv.pool.num_evictions,
                     kv.counters.cow_copies)


def pool_frames(manager) -> list[PoolFrame]:
    return [pool_frame(kv, manager.seqs, manager.retention.count(eid)) for eid, kv in manager.executors.items()]


class FrameCache:
    """Frames shared by the viewers that ask within ``max_age_s`` of each
    other: building one costs O(pool), however many watch."""

    def __init__(self, max_age_s: float = 0.05) -> None:
        self.max_age_s = max_age_s
        self._at = -1.0
        self._frames: list[PoolFrame] = []

    def frames(self, manager) -> list[PoolFrame]:
        now = time.monotonic()
        if now - self._at > self.max_age_s:
            self._frames, self._at = pool_frames(manager), now
        return self._frames


def runs(cur: np.ndarray, prev: np.ndarray | None) -> list[int]:
    """Flat [start, length, value, ...] turning ``prev`` into ``cur``
    (``prev`` None: all of ``cur``, run-length encoded)."""
    idx = np.flatnonzero(cur != prev) if prev is not None else np.arange(cur.size)
    if idx.size == 0:
        return []
    vals = cur[idx]
    brk = np.flatnonzero((np.diff(idx) != 1) | (np.diff(vals) != 0)) + 1
    first = np.r_[0, brk]
    last = np.r_[brk - 1, idx.size - 1]
    out = np.empty((first.size, 3), dtype=np.int64)
    out[:, 0] = idx[first]
    out[:, 1] = idx[last] - idx[first] + 1
    out[:, 2] = vals[first]
    return out.ravel().tolist()


def _recent(ring, num_new: int) -> list[int]:
    """The last ``num_new`` ids of a bounded ring (fewer when it overflowed)."""
    k = min(num_new, len(ring))
    return list(itertools.islice(reversed(ring), k))[::-1] if k > 0 else []


class Subscriber:
    """One viewer's stream: each ``update`` is the changes since its last
    one (a full state for an executor it has not seen, or whose pool was
    registered again)."""

    def __init__(self) -> None:
        self._sent: dict[str, PoolFrame] = {}

    def update(self, manager, step_id: int, frames: list[PoolFrame] | None = None) -> dict:
        """``frames``: the pools now, when already built (viewers share them: ``FrameCache``)."""
        if frames is None:
            frames = pool_frames(manager)
        pools = {kv.spec.executor_id: kv for kv in manager.executors.values()}
        out = {"time_s": time.time(), "step_id": step_id, "executors": [],
               "removed": [eid for eid in self._sent if eid not in pools]}
        for f in frames:
            prev = self._sent.get(f.executor_id)
            if prev is not None and (prev.table_epoch != f.table_epoch or prev.cells.size != f.cells.size
                                     or prev.swap_cells.size != f.swap_cells.size):
                prev = None
            kv = pools[f.executor_id]
            item = {"id": f.executor_id, "num_blocks": int(f.cells.size), "block_size": f.block_size,
                    "num_swap_blocks": int(f.swap_cells.size), "num_seqs": f.num_seqs}
            if prev is None or prev.acct != f.acct:
                item["acct"] = f.acct
            delta = runs(f.cells, prev.cells) if prev is not None else None
            if delta is None or len(delta) // 3 > max(16, f.cells.size // 16):  # a full state is smaller
                item["cells_b64"] = base64.b64encode(f.cells.tobytes()).decode()
                item["swap_b64"] = base64.b64encode(f.swap_cells.tobytes()).decode()
            else:
                item["runs"] = delta
                item["swap_runs"] = runs(f.swap_cells, prev.swap_cells)
            if prev is None:
                item["seqs"] = list(f.seqs.values())
            else:  # the rows that changed, and the sequences gone
                changed = [row for sid, row in f.seqs.items() if prev.seqs.get(sid) != row]
                gone = [sid for sid in prev.seqs if sid not in f.seqs]
                if changed:
                    item["seqs_changed"] = changed
                if gone:
                    item["seqs_removed"] = gone
            if prev is not None:
                item["flash_evicted"] = _recent(kv.pool.recent_evictions, f.num_evictions - prev.num_evictions)
                item["flash_copied"] = _recent(kv.recent_copies, f.num_copies - prev.num_copies)
            out["executors"].append(item)
            self._sent[f.executor_id] = f
        for eid in out["removed"]:
            del self._sent[eid]
        return out


def sequence_table(manager, seq_id: int) -> dict | None:
    """One sequence's block table, in logical order (None: unknown)."""
    seq = manager.seqs.get(seq_id)
    if seq is None:
        return None
    return {"seq_id": seq_id, "executor_id": seq.executor_id, "request_id": seq.request_id,
            "status": seq.status.value, "num_tokens": seq.num_known, "num_computed": seq.num_computed,
            "block_ids": list(seq.block_ids), "swap_block_ids": list(seq.swap_blocks),
            "refcounts": [b.ref_cnt for b in seq.blocks]}
