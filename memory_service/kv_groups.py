"""Block tables per KV group over one pool: the hybrid allocator's mechanism.

Vocabulary (``kvpager.kv_spec``): a model's layers fall into groups of one
attention spec, full or a sliding window of W tokens. One ``BlockPool``
serves every group of an executor; a block belongs to one group at a time
(the executor stores, in block b, the K/V of every layer of b's group, one
layer per pool slot), and a sequence has one table per group. Logical block
i of a table holds positions [i * block_size, (i + 1) * block_size) of that
group's layers.

Sliding-window groups free what the window has passed: once the next query
is at position c, keys < c − W + 1 are never read again (transformers'
mask: key > query − W), so every block wholly below that is given back (to
the cached tail of the free queue when it is an indexed full block) and its
table entry becomes a hole (None). A sequence then holds at most
⌈W / block_size⌉ + 1 blocks of such a group between steps.

Prefix hits span the groups: a hit of L tokens needs the full groups to hold
[0, L) and each sliding group the blocks covering [L − W + 1, L) (what the
first recomputed token's window reaches); the hit is the longest L that every
group satisfies, each block token-verified. Each group hashes its blocks
under its own root (``group_root``): the same tokens in two groups are two
different K/V.

Mechanism only: every operation succeeds or returns None / False with no
change; copy-on-write copies are recorded as (src, dst) pairs for the caller.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvpager.kv_spec import KvGroupSpec
from kvpager.prefix_index.hashing import extend_chain
from memory_service.block import Block
from memory_service.block_pool import BlockPool


def group_root(root: bytes, group: int) -> bytes:
    """The hash root of group ``group``: group 0 keeps the request's root (its
    chain is the one routers and the mirror score by)."""
    if group == 0:
        return root
    return hashlib.sha256(root + b"kv-group\0" + group.to_bytes(4, "little")).digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """One group's blocks over a set of sequences (accounting; O(blocks held))."""

    window: int | None
    used_blocks: int          # distinct blocks the sequences hold in this group
    logical_blocks: int       # table entries holding a block (a shared block counts per holder)
    full_attention_blocks: int  # what full attention would hold: every sequence's ⌈computed / block_size⌉

    @property
    def window_saved_blocks(self) -> int:
        """Blocks the window gave back (0 for a full group)."""
        return self.full_attention_blocks - self.logical_blocks


@dataclass(slots=True, eq=False)
class GroupedSeq:
    """One sequence's tables, one per group. Mutated only by ``GroupedKV``."""

    seq_id: int
    token_ids: list[int]
    root: bytes
    num_computed: int = 0
    tables: list[list[Block | None]] = field(default_factory=list)  # per group; None = freed hole
    hashes: list[list[bytes]] = field(default_factory=list)         # per group: chained full-block hashes
    num_indexed: list[int] = field(default_factory=list)             # per group: leading blocks looked at
    swapped: list[tuple[int, int, int]] = field(default_factory=list)  # (group, index, swap block) when swapped out


class GroupedKV:
    """The tables of one executor's sequences, per group, over one pool."""

    def __init__(self, pool: BlockPool, groups: list[KvGroupSpec]) -> None:
        if not groups:
            raise ValueError("at least one KV group")
        self.pool = pool
        self.groups = groups
        self.block_size = pool.block_size
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) since the last take_copies
        self._pins: list[Block] = []               # copy sources, one reference each, until take_copies

    # ---- arithmetic -----------------------------------------------------------

    def first_needed(self, group: int, next_pos: int) -> int:
        """The first table index the query at ``next_pos`` (or any later one)
        still reads in ``group``."""
        window = self.groups[group].window
        if window is None:
            return 0
        return max(0, next_pos - window + 1) // self.block_size

    def new_seq(self, seq_id: int, token_ids: list[int], root: bytes) -> GroupedSeq:
        n = len(self.groups)
        return GroupedSeq(seq_id, list(token_ids), root, tables=[[] for _ in range(n)],
                          hashes=[[] for _ in range(n)], num_indexed=[0] * n)

    def num_held(self, seq: GroupedSeq, group: int) -> int:
        return sum(1 for b in seq.tables[group] if b is not None)

    def usage(self, seqs) -> list[GroupUsage]:
        """Per group: blocks in use, and what full attention would have needed."""
        out = []
        for g, spec in enumerate(self.groups):
            held = [b for s in seqs for b in s.tables[g] if b is not None]
            full = sum(_cdiv(s.num_computed, self.block_size) for s in seqs if s.tables[g])
            out.append(GroupUsage(spec.window, len({id(b) for b in held}), len(held), full))
        return out

    # ---- prefix hits ------------------------------------------------------------

    def _hashes(self, seq: GroupedSeq, group: int, n_full: int) -> list[bytes]:
        return extend_chain(seq.hashes[group], group_root(seq.root, group), seq.token_ids, self.block_size, n_full)

    def _cached(self, seq: GroupedSeq, group: int, index: int) -> Block | None:
        bs = self.block_size
        h = self._hashes(seq, group, index + 1)[index]
        return self.pool.lookup(h, seq.token_ids[index * bs:(index + 1) * bs])

    def find_prefix(self, seq: GroupedSeq) -> tuple[int, list[list[Block | None]]]:
        """The longest hit every group satisfies: (hit tokens, per group the
        table it would start with: hits where the group needs them, holes
        below a sliding window). The last token is always left to compute."""
        bs = self.block_size
        n_full = (len(seq.token_ids) - 1) // bs
        # A full group's hits are a prefix: its longest run bounds every group.
        limit = n_full
        for g, spec in enumerate(self.groups):
            if spec.window is None:
                run = 0
                while run < limit and self._cached(seq, g, run) is not None:
                    run += 1
                limit = run
        for n in range(limit, 0, -1):  # longest first
            tables = []
            for g in range(len(self.groups)):
                first = self.first_needed(g, n * bs)
                hits = [self._cached(seq, g, i) for i in range(first, n)]
                if any(b is None for b in hits):
                    break
                tables.append([None] * first + hits)
            else:
                return n * bs, tables
        return 0, [[] for _ in self.groups]

    # ---- allocation ---------------------------------------------------------------

    def admit(self, seq: GroupedSeq, max_new_tokens: int) -> tuple[int, int] | None:
        """Tables for a sequence holding nothing: the prefix hit plus fresh
        blocks for up to ``max_new_tokens`` more. (hit tokens, tokens to
        compute) or None (nothing changed)."""
        assert all(not t for t in seq.tables), "admit a sequence holding no block"
        hit, tables = self.find_prefix(seq)
        k = min(max_new_tokens, len(seq.token_ids) - hit)
        need = len(self.groups) * _cdiv(hit + k, self.block_size) - sum(len(t) for t in tables)
        distinct = {id(b): b for t in tables for b in t if b is not None}
        reclaimed = sum(1 for b in distinct.values() if b.ref_cnt == 0)
        if need > self.pool.num_free - reclaimed:
            return None
        for t in tables:
            self.pool.touch([b for b in t if b is not None])
        for g, t in enumerate(tables):
            t.extend(self.pool.allocate(_cdiv(hit + k, self.block_size) - len(t)))
            seq.tables[g] = t
            seq.num_indexed[g] = hit // self.block_size
        seq.num_computed = hit
        return hit, k

    def _writes(self, seq: GroupedSeq, k: int) -> tuple[int, list[list[int]]]:
        """(free blocks that k more tokens take, per group the shared blocks
        they would write into: those at or after the write position)."""
        bs, c = self.block_size, seq.num_computed
        shared = [[i for i in range(c // bs, len(t)) if t[i] is not None and t[i].ref_cnt > 1] for t in seq.tables]
        need = sum(max(0, _cdiv(c + k, bs) - len(t)) + len(s) for t, s in zip(seq.tables, shared))
        return need, shared

    def blocks_needed(self, seq: GroupedSeq, k: int) -> int:
        """Free blocks ``allocate_slots(seq, k)`` would take."""
        return self._writes(seq, k)[0]

    def allocate_slots(self, seq: GroupedSeq, k: int) -> bool:
        """Room in every group for k more tokens, copying a shared block about
        to be written. False (nothing changed) when the pool is short."""
        need, shared = self._writes(seq, k)
        if need > self.pool.num_free:
            return False
        bs, c = self.block_size, seq.num_computed
        for table, writes in zip(seq.tables, shared):
            for i in writes:
                new = self.pool.allocate(1)[0]
                self.copies.append((table[i].block_id, new.block_id))
                # Our reference on the source is held until the copies are
                # taken: no other sharer's release may hand it out before the
                # executor has read it.
                self._pins.append(table[i])
                table[i] = new
            grow = _cdiv(c + k, bs) - len(table)
            if grow > 0:
                table.extend(self.pool.allocate(grow))
        return True

    def commit(self, seq: GroupedSeq, k: int) -> int:
        """k more tokens are computed: newly full blocks enter the prefix
        index (per group), and sliding groups give back the blocks their
        window has passed. Returns blocks freed."""
        seq.num_computed += k
        c, bs = seq.num_computed, self.block_size
        n_full = min(c, len(seq.token_ids)) // bs
        freed = 0
        for g, table in enumerate(seq.tables):
            if n_full > seq.num_indexed[g]:
                hashes = self._hashes(seq, g, n_full)
                for i in range(seq.num_indexed[g], n_full):
                    block = table[i]
                    if block is not None and block.block_hash is None:
                        parent = hashes[i - 1] if i else None
                        self.pool.cache_block(block, hashes[i], seq.token_ids[i * bs:(i + 1) * bs], parent, i)
                seq.num_indexed[g] = n_full
            passed = [i for i in range(self.first_needed(g, c)) if table[i] is not None]
            if passed:
                freed += self.pool.free([table[i] for i in passed])
                for i in passed:
                    table[i] = None
        return freed

    # ---- sharing, release -----------------------------------------------------------

    def fork(self, parent: GroupedSeq, child_id: int) -> GroupedSeq:
        """A child sharing every block the parent holds (refcount++), holes included."""
        child = GroupedSeq(child_id, list(parent.token_ids), parent.root, parent.num_computed,
                           tables=[list(t) for t in parent.tables], hashes=[list(h) for h in parent.hashes],
                           num_indexed=list(parent.num_indexed))
        for table in child.tables:
            for block in table:
                if block is not None:
                    block.ref_cnt += 1
        return child

    def release(self, seq: GroupedSeq) -> int:
        """Every block back; returns how many became free."""
        freed = 0
        for g, table in enumerate(seq.tables):
            held = [b for b in table if b is not None]
            if held:
                freed += self.pool.free(held)
            seq.tables[g] = []
            seq.num_indexed[g] = 0
        seq.num_computed = 0
        return freed

    def swap_out(self, seq: GroupedSeq, swap_ids: list[int]) -> list[tuple[int, int]]:
        """Move every held block to the swap blocks given (one each, in table
        order over the groups; holes stay holes). Returns (device, swap) pairs."""
        held = [(g, i) for g, t in enumerate(seq.tables) for i, b in enumerate(t) if b is not None]
        assert len(swap_ids) == len(held), "one swap block per held block"
        pairs = [(seq.tables[g][i].block_id, s) for (g, i), s in zip(held, swap_ids)]
        self.pool.free([seq.tables[g][i] for g, i in held])
        for g, i in held:
            seq.tables[g][i] = None
        seq.swapped = [(g, i, s) for (g, i), s in zip(held, swap_ids)]
        return pairs

    def swap_in(self, seq: GroupedSeq) -> list[tuple[int, int]] | None:
        """Fresh device blocks where the swapped ones were; (swap, device)
        pairs, or None (nothing changed) when the pool is short."""
        fresh = self.pool.allocate(len(seq.swapped))
        if fresh is None:
            return None
        pairs = []
        for (g, i, s), block in zip(seq.swapped, fresh):
            seq.tables[g][i] = block
            pairs.append((s, block.block_id))
        seq.swapped = []
        return pairs

    def take_copies(self) -> list[tuple[int, int]]:
        """This step's copy-on-write pairs; their sources' pinned references go now."""
        copies, self.copies = self.copies, []
        if self._pins:
            self.pool.free(self._pins)
            self._pins = []
        return copies
