"""The KV block record and the doubly linked free queue.

Vocabulary (fixed here for the whole memory service):
  block       - a fixed-size chunk of one executor's device pool holding the
                K/V of `block_size` consecutive token positions; named by
                `block_id`, an index into that pool.
  slot        - one token position of the pool: block_id * block_size + offset.
  block table - a sequence's list of blocks; logical block i holds positions
                [i * block_size, (i + 1) * block_size).
  cached      - a full block whose content hash is in the pool's prefix index;
                it stays findable after its refcount drops to 0, until the
                free queue hands it out again (LRU eviction).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """One physical block. The pool owns ref_cnt/hash; the free queue owns the links."""

    block_id: int
    ref_cnt: int = 0
    # Content hash of a full block, None until full and indexed.
    block_hash: bytes | None = None
    # Token ids a full cached block holds, compared on every hit so that a hash
    # collision can never serve wrong KV.
    token_ids: tuple[int, ...] | None = None
    prev_free: Block | None = None
    next_free: Block | None = None
    in_free_queue: bool = False
    free_tier: int = 0  # which queue of a TieredFreeQueue holds it (the eviction policy's tier)
    # Prefix retention (memory_service.retention): kept cached until then (monotonic s; 0 = not pinned).
    retain_until: float = 0.0


class FreeBlockQueue:
    """Doubly linked queue of free blocks: O(1) pop from the head, append to
    the tail, and removal from the middle (a cached block taken back).

    The head is the least recently freed block, so allocation evicts cached
    blocks in LRU order.
    """

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)  # sentinels keep the link updates branch-free
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None and not block.in_free_queue
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        block.in_free_queue = True
        self.num_free += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None and block.in_free_queue
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free -= 1

    def popleft(self) -> Block:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        """Head-to-tail order (tests and invariant checks)."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out

    def iter_newest(self):
        """Free blocks from the tail (freed last) towards the head (evicted next)."""
        node = self._tail.prev_free
        while node is not None and node is not self._head:
            yield node
            node = node.prev_free


class TieredFreeQueue:
    """Free blocks in ``num_tiers`` FreeBlockQueues: allocation pops the
    lowest non-empty tier's head, so tier 0 is evicted before tier 1 and so
    on, least recently freed first within a tier. A block joins the tier its
    ``free_tier`` names (the pool sets it from the eviction policy). With one
    tier this is exactly a FreeBlockQueue."""

    def __init__(self, blocks: list[Block], num_tiers: int = 1) -> None:
        if num_tiers < 1:
            raise ValueError("num_tiers must be >= 1")
        self.queues = [FreeBlockQueue(blocks)] + [FreeBlockQueue([]) for _ in range(num_tiers - 1)]

    @property
    def num_free(self) -> int:
        return sum(q.num_free for q in self.queues)

    def append(self, block: Block) -> None:
        self.queues[block.free_tier].append(block)

    def remove(self, block: Block) -> None:
        self.queues[block.free_tier].remove(block)

    def popleft(self) -> Block:
        for q in self.queues:
            if q.num_free:
                return q.popleft()
        raise IndexError("no free blocks")

    def block_ids(self) -> list[int]:
        """Eviction order (tests and invariant checks)."""
        return [i for q in self.queues for i in q.block_ids()]

    def iter_newest(self):
        """Free blocks, the last to be evicted first."""
        for q in reversed(self.queues):
            yield from q.iter_newest()
