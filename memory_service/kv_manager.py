"""Per-executor KV manager: block tables of the sequences living in one
executor's pool, prefix hits, slot allocation with copy-on-write, fork,
swap and free.

Mechanism only. Every operation either succeeds or returns None / False
with no change; which sequence to preempt is decided by the caller's policy.
What the executor must learn is recorded as data as it happens: cache
operations (copies, swaps) in a ``CacheOpsBuilder``, block-table changes in
a ``TableChanges`` (``memory_service.changes``).
"""

from __future__ import annotations

import secrets
from collections import deque
from array import array
from dataclasses import dataclass

from memory_service.block import Block
from memory_service.block_pool import RECENT_OPS, BlockPool, SwapPool
from memory_service.changes import CacheOpsBuilder, TableChanges
from memory_service.events import EventQueue
from memory_service.policy import EvictionPolicy
from kvpager.prefix_index.hashing import extend_chain, hash_blocks
from kvpager.seq_status import SeqStatus
from memory_service.sequence import Sequence


@dataclass(slots=True)
class ExecutorSpec:
    """What an executor registered (mirrors ExecutorPoolInfo)."""

    executor_id: str
    num_blocks: int
    block_size: int
    num_swap_blocks: int = 0
    address: str = ""
    model_id: str = ""
    dtype: str = ""
    incarnation: int = 0
    pool_generation: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    adapter: str = ""
    # Its KV layout's table groups, in plan order: each group's sliding window (0 = full attention).
    # Empty: one table for all layers (ExecutorKV); else a table per group (grouped_kv.GroupedExecutorKV).
    kv_group_windows: tuple[int, ...] = ()


@dataclass(slots=True)
class Counters:
    prefix_query_tokens: int = 0    # first admissions: prompt tokens looked up
    prefix_hit_tokens: int = 0      # ... and found cached
    recompute_query_tokens: int = 0  # re-admissions after preemption by recompute: tokens to compute again
    recompute_hit_tokens: int = 0    # ... that the cache still held (the rest is prefill redone)
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    cow_copies: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    # The planner's preemption estimates (memory_service.policy), summed over its decisions:
    preempt_recompute_tokens: int = 0  # prefill to redo, of the victims recomputed
    preempt_swap_bytes: int = 0        # host-link bytes (out + in), of the victims swapped
    preempt_cost_s: float = 0.0        # the chosen modes' estimated seconds (where measured)
    preempt_saved_s: float = 0.0       # the other modes' seconds minus the chosen ones' (both measured)

    def count_lookup(self, num_tokens: int, num_hit_tokens: int, first: bool) -> None:
        """An admission's prefix lookup: a first prefill's, or a recompute's after preemption (apart)."""
        if first:
            self.prefix_query_tokens += num_tokens
            self.prefix_hit_tokens += num_hit_tokens
        else:
            self.recompute_query_tokens += num_tokens
            self.recompute_hit_tokens += num_hit_tokens


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ExecutorKV:
    """Block tables of one executor's sequences. Owns its BlockPool and SwapPool."""

    grouped = False  # a table per KV group (GroupedExecutorKV): no decode fast path

    def __init__(self, spec: ExecutorSpec, events: EventQueue | None = None,
                 eviction: EvictionPolicy | None = None) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = BlockPool(spec.executor_id, spec.num_blocks, spec.block_size, events, eviction)
        self.swap = SwapPool(spec.num_swap_blocks)
        self.seq_ids: set[int] = set()
        self.counters = Counters()
        self.ops = CacheOpsBuilder()
        self.tables = TableChanges()
        # Names this registration's tables at the executor: it forgets tables of any other epoch
        # (an earlier registration of the same pool, or another memory service's) when it sees a new one.
        self.table_epoch = secrets.randbits(63) or 1
        # Copy-on-write sources of this step -> references still held for the
        # copies. The executor runs swap-ins before copies, so a source must not
        # be handed out again (say to a swap-in, after its last other holder is
        # preempted) until the step's ops are taken.
        self._copy_pins: dict[Block, int] = {}
        # The last copy-on-write destinations (the block map flashes those since its last frame).
        self.recent_copies: deque[int] = deque(maxlen=RECENT_OPS)

    # ---- prefix index -------------------------------------------------------

    def _hashes(self, seq: Sequence, n_full: int) -> list[bytes]:
        """seq.block_hashes extended to at least n_full entries."""
        return extend_chain(seq.block_hashes, seq.root_hash, seq.token_ids, self.block_size, n_full)

    def find_prefix(self, seq: Sequence) -> list[Block]:
        """Leading cached blocks of seq's tokens. The last token is always left
        to compute: the model needs its logits."""
        bs = self.block_size
        n_full = (seq.num_tokens - 1) // bs
        if n_full <= 0:
            return []
        hashes = self._hashes(seq, n_full)
        lookup = self.pool.lookup
        tokens = seq.token_ids
        hits = []
        for i in range(n_full):
            block = lookup(hashes[i], tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def count_prefix_blocks(self, root_hash: bytes, token_ids, limit: int | None = None) -> int:
        """Consecutive leading full blocks of token_ids this pool holds (scoring)."""
        bs = self.block_size
        for i, h in enumerate(hash_blocks(root_hash, token_ids, bs, limit=limit)):
            if self.pool.lookup(h, token_ids[i * bs:(i + 1) * bs]) is None:
                return i
        return min(len(token_ids) // bs, limit if limit is not None else len(token_ids))

    def count_prefix_hashes(self, block_hashes: list[bytes]) -> int:
        """Consecutive leading hashes (a caller's chain) this pool holds: scoring
        by hashes the router computed once. Advisory, so not token-verified: an
        admission verifies every hit it takes."""
        cached = self.pool.cached
        for i, h in enumerate(block_hashes):
            if h not in cached:
                return i
        return len(block_hashes)

    # ---- allocation ---------------------------------------------------------

    def admit(self, seq: Sequence, max_new_tokens: int, count_hits: bool) -> tuple[int, int] | None:
        """Give a WAITING sequence its blocks: prefix hits plus fresh blocks for
        up to max_new_tokens more. Returns (num_cached_tokens, num_new_tokens)
        or None (nothing changed)."""
        bs = self.block_size
        hits = self.find_prefix(seq)
        num_hit_tokens = len(hits) * bs
        k = min(max_new_tokens, seq.num_tokens - num_hit_tokens)
        need = _cdiv(num_hit_tokens + k, bs) - len(hits)
        reclaimed = sum(1 for b in hits if b.ref_cnt == 0)  # leave the free queue on touch
        if need > self.pool.num_free - reclaimed:
            return None
        self.pool.touch(hits)
        fresh = self.pool.allocate(need)
        assert fresh is not None
        seq.blocks = hits + fresh
        seq.block_ids = array("i", [b.block_id for b in seq.blocks])
        seq.num_computed = num_hit_tokens
        seq.num_cached_blocks = len(hits)
        seq.status = SeqStatus.RUNNING
        self.counters.count_lookup(seq.num_tokens, num_hit_tokens, first=count_hits)
        self._start(seq, num_hit_tokens, num_hit_tokens if count_hits else 0)
        return num_hit_tokens, k

    def allocate_slots(self, seq: Sequence, k: int) -> bool:
        """Room for k more tokens of a RUNNING sequence, copying a shared block
        it is about to write into. False (nothing changed) if short."""
        bs = self.block_size
        c = seq.num_computed
        blocks = seq.blocks
        first = c // bs
        if first == len(blocks) - 1 and c + k <= len(blocks) * bs and blocks[first].ref_cnt == 1:
            return True  # the common decode: room left in a private tail block
        need = _cdiv(c + k, bs) - len(blocks)
        shared = None
        if first < len(blocks):
            # Only blocks at or after the write position can be written; before
            # a fork they are private, after it the partial tail is shared.
            pins = self._copy_pins
            shared = [i for i in range(first, len(blocks)) if blocks[i].ref_cnt - pins.get(blocks[i], 0) > 1]
            need += len(shared)
        if need > self.pool.num_free:
            return False
        pool = self.pool
        first_changed = shared[0] if shared else len(blocks)
        if shared:
            ops = self.ops
            for i in shared:
                old = blocks[i]
                new = pool.allocate(1)[0]
                ops.copy_src.append(old.block_id)
                ops.copy_dst.append(new.block_id)
                pins[old] = pins.get(old, 0) + 1  # our reference goes at take_ops
                blocks[i] = new
                seq.block_ids[i] = new.block_id
                self.counters.cow_copies += 1
                self.recent_copies.append(new.block_id)
            need -= len(shared)
        if need > 0:
            fresh = pool.allocate(need)
            blocks.extend(fresh)
            seq.block_ids.extend([b.block_id for b in fresh])
        if first_changed < len(blocks):
            self.tables.extend(seq.seq_id, first_changed, seq.block_ids[first_changed:])
        return True

    def open_block(self, seq: Sequence) -> bool:
        """Room for the next token of a RUNNING sequence whose blocks are all
        full: one fresh block at the tail (no block holds that position yet,
        so nothing is shared or copied). False (nothing changed) when the pool
        is empty. A decode's growth; ``allocate_slots`` is the general case."""
        pool = self.pool
        if not pool.num_free:
            return False
        block = pool.allocate(1)[0]
        first = len(seq.blocks)
        seq.blocks.append(block)
        seq.block_ids.append(block.block_id)
        self.tables.extend(seq.seq_id, first, (block.block_id,))
        return True

    def commit(self, seq: Sequence, k: int) -> None:
        """The planned k tokens count as computed; newly full blocks enter the
        prefix index."""
        seq.num_computed += k
        # A block holding a placeholder is indexed once its id is known (``index_known``).
        n_full = min(seq.num_computed, len(seq.token_ids) - seq.num_pending) // self.block_size
        if n_full > seq.num_cached_blocks:
            bs = self.block_size
            hashes = self._hashes(seq, n_full)
            tokens = seq.token_ids
            pool = self.pool
            for i in range(seq.num_cached_blocks, n_full):
                block = seq.blocks[i]
                if block.block_hash is None:
                    parent = hashes[i - 1] if i else None
                    pool.cache_block(block, hashes[i], tokens[i * bs:(i + 1) * bs], parent, i)
            seq.num_cached_blocks = n_full

    def index_known(self, seq: Sequence) -> None:
        """Index the computed full blocks whose placeholder tokens just got
        their ids (``commit`` leaves those out)."""
        if seq.status is SeqStatus.RUNNING and seq.num_computed // self.block_size > seq.num_cached_blocks:
            self.commit(seq, 0)

    def cut(self, seq: Sequence, num_computed: int) -> int:
        """A decode burst ended early: only ``num_computed`` (fewer) tokens of
        the RUNNING ``seq`` are computed. The blocks past them go back; the
        executor cut its table the same way when it cut the burst (no table
        change is sent: one deferred to a later plan would follow that plan's
        forks, which copy the table). Returns the blocks freed."""
        keep = _cdiv(num_computed, self.block_size)
        seq.num_computed = num_computed
        tail = seq.blocks[keep:]
        if not tail:
            return 0
        del seq.blocks[keep:]
        del seq.block_ids[keep:]
        return self.pool.free(tail)

    def pool_tokens(self) -> int:
        """The longest sequence the pool can ever hold."""
        return self.spec.num_blocks * self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        return _cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def room_needed(self, seq: Sequence, k: int) -> tuple[int, list[Block]]:
        """(free blocks that admitting a WAITING seq, or swapping in a SWAPPED
        one, with k tokens needs; the cached blocks it would reuse) — the same
        arithmetic as admit / swap_in, so a caller can tell whether preempting
        others could ever make room."""
        bs = self.block_size
        if seq.status is SeqStatus.SWAPPED:
            return max(len(seq.swap_blocks), _cdiv(seq.num_computed + k, bs)), []
        hits = self.find_prefix(seq)
        num_hit_tokens = len(hits) * bs
        k = min(k, seq.num_tokens - num_hit_tokens)
        return _cdiv(num_hit_tokens + k, bs) - len(hits), hits

    # ---- sharing, preemption, release ----------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """child shares every block of parent (refcount++). Returns blocks shared."""
        for block in parent.blocks:
            block.ref_cnt += 1
        child.blocks = list(parent.blocks)
        child.block_ids = array("i", parent.block_ids)
        child.num_computed = parent.num_computed
        child.num_cached_blocks = parent.num_cached_blocks
        child.block_hashes = list(parent.block_hashes)
        child.status = parent.status
        if parent.swap_blocks:
            raise AssertionError("fork of a swapped sequence is refused by the caller")
        if parent.on_executor:
            self.tables.fork(parent.seq_id, child.seq_id)
            child.on_executor = True
        return len(parent.blocks)

    def release(self, seq: Sequence) -> int:
        """Give back every block (device and swap). Returns device blocks freed."""
        self._drop(seq)
        freed = self.pool.free(seq.blocks) if seq.blocks else 0
        seq.blocks = []
        seq.block_ids = array("i")
        if seq.swap_blocks:
            self.swap.free(seq.swap_blocks)
            seq.swap_blocks = []
        seq.num_computed = 0
        seq.num_cached_blocks = 0
        return freed

    def preempt_recompute(self, seq: Sequence) -> None:
        self.release(seq)
        seq.status = SeqStatus.WAITING
        self.counters.preemptions_recompute += 1

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.blocks) <= self.swap.num_free

    def preempt_swap(self, seq: Sequence) -> None:
        cpu = self.swap.allocate(len(seq.blocks))
        assert cpu is not None, "caller checks can_swap_out"
        self.ops.swap_out_src.extend(b.block_id for b in seq.blocks)
        self.ops.swap_out_dst.extend(cpu)
        self._drop(seq)
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.block_ids = array("i")
        seq.swap_blocks = cpu
        seq.num_cached_blocks = 0
        seq.status = SeqStatus.SWAPPED
        self.counters.preemptions_swap += 1
        self.counters.swapped_out_blocks += len(cpu)

    def swap_in(self, seq: Sequence, k: int) -> bool:
        """Bring a SWAPPED sequence back with room for k more tokens."""
        n = len(seq.swap_blocks)
        need = max(n, _cdiv(seq.num_computed + k, self.block_size))
        if need > self.pool.num_free:
            return False
        blocks = self.pool.allocate(need)
        self.ops.swap_in_src.extend(seq.swap_blocks)
        self.ops.swap_in_dst.extend(b.block_id for b in blocks[:n])
        self.ops.deferred_swap_free.extend(seq.swap_blocks)
        self.counters.swapped_in_blocks += n
        seq.swap_blocks = []
        seq.blocks = blocks
        seq.block_ids = array("i", [b.block_id for b in blocks])
        seq.status = SeqStatus.RUNNING
        self._start(seq, seq.num_computed, 0)
        return True

    def _start(self, seq: Sequence, context_len: int, cached_tokens: int) -> None:
        self.tables.start(seq.seq_id, context_len, cached_tokens, seq.block_ids)
        seq.on_executor = True

    def _drop(self, seq: Sequence) -> None:
        if seq.on_executor:
            self.tables.drop(seq.seq_id)
            seq.on_executor = False

    def take_tables(self) -> TableChanges:
        """The table changes since the last plan this executor was sent."""
        tables, self.tables = self.tables, TableChanges()
        return tables

    def take_group_tables(self) -> list[TableChanges]:
        """Table changes of KV groups 1, 2, … (none: one table for all layers)."""
        return []

    def take_ops(self) -> CacheOpsBuilder:
        """This step's cache ops; deferred swap blocks and copy sources become
        reusable now."""
        ops = self.ops
        if ops.deferred_swap_free:
            self.swap.free(ops.deferred_swap_free)
        self.ops = CacheOpsBuilder()
        if self._copy_pins:
            for block, n in self._copy_pins.items():
                self.pool.free([block] * n)
            self._copy_pins = {}
        return ops
