"""The KV manager of an executor with a table per KV group (its
``kv_layout`` "hybrid"): ``ExecutorKV``'s interface over ``GroupedKV``.

A sequence of such an executor carries a ``GroupedSeq`` (``Sequence.kv_groups``)
sharing its token list; the group allocator decides every table, with its
window frees, prefix hits intersected across groups, copy-on-write and
swaps. ``Sequence.blocks`` / ``block_ids`` stay the flat list of the device
blocks it holds over all groups (what accounting, quotas, victim costs and
the block map count), rebuilt after each change.

What the executor learns: group 0's table changes go in ``tables`` (with
every group's forks and drops), groups 1, 2, … in ``group_tables``; a start
sends whole tables, holes (blocks the window passed) as -1. Window frees send
nothing: the executor never reads a block wholly behind the window, so a
stale id there is harmless.

Frees happen when the planner commits a step's tokens, before the executor
runs them, so a block is freed only once the step's *first* query no longer
reads it (``GroupedKV.commit``'s ``reader``): a block handed to another
sequence in the same step is never one this step still reads.
"""

from __future__ import annotations

from array import array

from kvpager.kv_spec import KvGroupSpec
from kvpager.seq_status import SeqStatus
from memory_service.block import Block
from memory_service.changes import CacheOpsBuilder, TableChanges
from memory_service.events import EventQueue
from memory_service.kv_groups import GroupedKV, GroupedSeq, GroupUsage
from memory_service.kv_manager import ExecutorKV, ExecutorSpec
from memory_service.policy import EvictionPolicy
from memory_service.sequence import Sequence


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupedExecutorKV(ExecutorKV):
    """Block tables per KV group of one executor's sequences."""

    grouped = True

    def __init__(self, spec: ExecutorSpec, events: EventQueue | None = None,
                 eviction: EvictionPolicy | None = None) -> None:
        super().__init__(spec, events, eviction)
        self.groups = [KvGroupSpec(w or None, ()) for w in spec.kv_group_windows]
        self.gkv = GroupedKV(self.pool, self.groups)
        self.group_changes = [TableChanges() for _ in self.groups[1:]]

    # ---- the sequence's group tables ------------------------------------------

    def _gs(self, seq: Sequence) -> GroupedSeq:
        gs = seq.kv_groups
        if gs is None:
            n = len(self.groups)
            # The token list is shared: appends and placeholder fills reach the allocator's hashing.
            gs = seq.kv_groups = GroupedSeq(seq.seq_id, seq.token_ids, seq.root_hash,
                                            tables=[[] for _ in range(n)], hashes=[[] for _ in range(n)],
                                            num_indexed=[0] * n)
        gs.num_computed = seq.num_computed
        return gs

    @staticmethod
    def _sync(seq: Sequence, gs: GroupedSeq) -> None:
        seq.blocks = [b for t in gs.tables for b in t if b is not None]
        seq.block_ids = array("i", [b.block_id for b in seq.blocks])
        seq.num_computed = gs.num_computed
        seq.num_cached_blocks = gs.num_indexed[0]

    def _take_copies(self) -> None:
        """The allocator's copy-on-write pairs into this step's ops (its pins stay until take_ops)."""
        copies, self.gkv.copies = self.gkv.copies, []
        for src, dst in copies:
            self.ops.copy_src.append(src)
            self.ops.copy_dst.append(dst)
            self.recent_copies.append(dst)
        self.counters.cow_copies += len(copies)

    def usage(self, seqs) -> list[GroupUsage]:
        return self.gkv.usage([s.kv_groups for s in seqs if s.kv_groups is not None])

    # ---- prefix index -------------------------------------------------------

    def find_prefix(self, seq: Sequence) -> list[Block]:
        """The distinct cached blocks the longest cross-group hit would reuse."""
        _, tables = self.gkv.find_prefix(self._gs(seq))
        return list({id(b): b for t in tables for b in t if b is not None}.values())

    # ---- allocation ---------------------------------------------------------

    def admit(self, seq: Sequence, max_new_tokens: int, count_hits: bool) -> tuple[int, int] | None:
        gs = self._gs(seq)
        got = self.gkv.admit(gs, max_new_tokens)
        if got is None:
            return None
        hit, k = got
        self._sync(seq, gs)
        seq.status = SeqStatus.RUNNING
        self.counters.count_lookup(seq.num_tokens, hit, first=count_hits)
        self._start(seq, hit, hit if count_hits else 0)
        return hit, k

    def blocks_needed(self, seq: Sequence, k: int) -> int:
        """Free blocks ``allocate_slots(seq, k)`` would take (a RUNNING sequence)."""
        return self.gkv.blocks_needed(self._gs(seq), k)

    def allocate_slots(self, seq: Sequence, k: int) -> bool:
        gs = self._gs(seq)
        first = seq.num_computed // self.block_size
        before = [t[first:] for t in gs.tables]
        lens = [len(t) for t in gs.tables]
        if not self.gkv.allocate_slots(gs, k):
            return False
        self._take_copies()
        changed = False
        for g, (table, old) in enumerate(zip(gs.tables, before)):
            # The first entry that changed: a copy-on-write replacement, or the growth.
            i = next((first + j for j, b in enumerate(old) if table[first + j] is not b), lens[g])
            if i < len(table):
                changed = True
                ids = [-1 if b is None else b.block_id for b in table[i:]]
                (self.tables if g == 0 else self.group_changes[g - 1]).extend(seq.seq_id, i, ids)
        if changed:
            self._sync(seq, gs)
        return True

    def open_block(self, seq: Sequence) -> bool:
        return self.allocate_slots(seq, 1)  # never the decode fast path (off for grouped executors)

    def commit(self, seq: Sequence, k: int) -> None:
        gs = self._gs(seq)
        dropped = self.gkv.num_dropped
        self.gkv.commit(gs, k, known=seq.num_known, reader=seq.num_computed)
        if self.gkv.num_dropped != dropped:
            self._sync(seq, gs)
        else:  # the window passed no block: the flat block list stands
            seq.num_computed = gs.num_computed
            seq.num_cached_blocks = gs.num_indexed[0]

    def index_known(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.commit(seq, 0)

    def can_ever_fit(self, num_tokens: int) -> bool:
        # In chunks small enough (``fit_tokens``) a sliding group holds at most its window's blocks
        # and the one being written.
        bs = self.block_size
        need = sum(g.max_blocks(num_tokens, bs) + (1 if g.sliding else 0) for g in self.groups)
        return need <= self.pool.num_blocks

    def pool_tokens(self) -> int:
        bs = self.block_size
        fixed = sum(_cdiv(g.window, bs) + 2 for g in self.groups if g.sliding)
        num_full = sum(1 for g in self.groups if not g.sliding)
        if fixed > self.pool.num_blocks:
            return 0
        if not num_full:
            return 1 << 30  # every group slides: any length, a window's blocks at a time
        return (self.pool.num_blocks - fixed) // num_full * bs

    def fit_tokens(self, seq: Sequence, k: int) -> int:
        """The most of k tokens (0..k) a RUNNING or WAITING sequence gets room
        for in the free blocks now: a prefill chunk cut to what fits, where
        the whole chunk cannot fit even with every victim preempted (a sliding
        group frees behind the window, so smaller chunks always progress)."""
        gs = self._gs(seq)
        if seq.status is SeqStatus.RUNNING:
            def fits(n: int) -> bool:
                return self.gkv.blocks_needed(gs, n) <= self.pool.num_free
        else:
            need1, hits = self.room_needed(seq, 1)
            free = self.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0)

            def fits(n: int) -> bool:
                return (need1 if n == 1 else self.room_needed(seq, n)[0]) <= free
        lo, hi = 0, k  # fits(lo); find the largest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _growth(self, gs: GroupedSeq, k: int) -> int:
        return sum(max(0, _cdiv(gs.num_computed + k, self.block_size) - len(t)) for t in gs.tables)

    def room_needed(self, seq: Sequence, k: int) -> tuple[int, list[Block]]:
        gs = self._gs(seq)
        if seq.status is SeqStatus.SWAPPED:
            return len(gs.swapped) + self._growth(gs, k), []
        hit, tables = self.gkv.find_prefix(gs)
        k = min(k, seq.num_tokens - hit)
        need = len(self.groups) * _cdiv(hit + k, self.block_size) - sum(len(t) for t in tables)
        return need, list({id(b): b for t in tables for b in t if b is not None}.values())

    # ---- sharing, preemption, release ----------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> int:
        if parent.swap_blocks:
            raise AssertionError("fork of a swapped sequence is refused by the caller")
        cg = self.gkv.fork(self._gs(parent), child.seq_id)
        cg.token_ids = child.token_ids
        child.kv_groups = cg
        self._sync(child, cg)
        child.block_hashes = list(parent.block_hashes)
        child.status = parent.status
        if parent.on_executor:
            self.tables.fork(parent.seq_id, child.seq_id)  # the executor forks every group's table
            child.on_executor = True
        return len(child.blocks)

    def release(self, seq: Sequence) -> int:
        self._drop(seq)
        gs = self._gs(seq)
        freed = self.gkv.release(gs)
        gs.swapped = []
        if seq.swap_blocks:
            self.swap.free(seq.swap_blocks)
            seq.swap_blocks = []
        self._sync(seq, gs)
        return freed

    def preempt_swap(self, seq: Sequence) -> None:
        gs = self._gs(seq)
        cpu = self.swap.allocate(len(seq.blocks))
        assert cpu is not None, "caller checks can_swap_out"
        for dev, host in self.gkv.swap_out(gs, cpu):
            self.ops.swap_out_src.append(dev)
            self.ops.swap_out_dst.append(host)
        self._drop(seq)
        seq.swap_blocks = cpu
        self._sync(seq, gs)
        seq.status = SeqStatus.SWAPPED
        self.counters.preemptions_swap += 1
        self.counters.swapped_out_blocks += len(cpu)

    def swap_in(self, seq: Sequence, k: int) -> bool:
        gs = self._gs(seq)
        if len(gs.swapped) + self._growth(gs, k) > self.pool.num_free:
            return False
        pairs = self.gkv.swap_in(gs)
        assert pairs is not None
        for host, dev in pairs:
            self.ops.swap_in_src.append(host)
            self.ops.swap_in_dst.append(dev)
        self.ops.deferred_swap_free.extend(seq.swap_blocks)
        self.counters.swapped_in_blocks += len(pairs)
        seq.swap_blocks = []
        assert self.gkv.allocate_slots(gs, k)  # fresh blocks only: nothing is shared after a swap-in
        self._sync(seq, gs)
        seq.status = SeqStatus.RUNNING
        self._start(seq, seq.num_computed, 0)
        return True

    def _start(self, seq: Sequence, context_len: int, cached_tokens: int) -> None:
        for g, table in enumerate(seq.kv_groups.tables):
            ids = array("i", [-1 if b is None else b.block_id for b in table])
            (self.tables if g == 0 else self.group_changes[g - 1]).start(seq.seq_id, context_len, cached_tokens, ids)
        seq.on_executor = True

    def take_group_tables(self) -> list[TableChanges]:
        out, self.group_changes = self.group_changes, [TableChanges() for _ in self.groups[1:]]
        return out

    def take_ops(self) -> CacheOpsBuilder:
        self.gkv.take_copies()  # the copy sources' pinned references go with this step's ops
        return super().take_ops()
