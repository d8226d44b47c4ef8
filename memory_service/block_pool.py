"""The block pool of one executor: blocks, refcounts, free queue, prefix index.

Mechanism only: it allocates or reports failure (None) and never picks a
victim. All-or-nothing: a failed allocation changes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from memory_service.block import Block, FreeBlockQueue, TieredFreeQueue
from memory_service.events import AllCleared, BlockRemoved, BlockStored, EventQueue
from memory_service.policy import EvictionPolicy


RECENT_OPS = 4096  # recent evictions / copy-on-write destinations kept for operators


class BlockPool:
    def __init__(self, executor_id: str, num_blocks: int, block_size: int,
                 events: EventQueue | None = None, eviction: EvictionPolicy | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.executor_id = executor_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.eviction = eviction or EvictionPolicy()
        self._tiered = self.eviction.tiers > 1
        # One tier (LRU, the default) is a plain queue: no per-free policy call on the hot path.
        self.free_queue = (TieredFreeQueue(self.blocks, self.eviction.tiers) if self._tiered
                           else FreeBlockQueue(self.blocks))
        # hash -> the one block holding that content (refcount may be 0)
        self.cached: dict[bytes, Block] = {}
        self.num_cached_free = 0  # cached blocks with refcount 0
        self.num_evictions = 0
        # The last evicted block ids (the block map flashes those since its last frame).
        self.recent_evictions: deque[int] = deque(maxlen=RECENT_OPS)
        self.events = events if events is not None else EventQueue()

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take, cached-but-free ones included."""
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[Block] | None:
        """n fresh blocks with refcount 1, or None (and no change) if short."""
        if n > self.free_queue.num_free:
            return None
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        # A cached free block is reused for new data: its content is gone.
        del self.cached[block.block_hash]
        self.num_cached_free -= 1
        self.num_evictions += 1
        self.recent_evictions.append(block.block_id)
        if self.events.enabled:  # no record built when nothing drains them
            self.events.emit(BlockRemoved(self.executor_id, block.block_hash, block.block_id))
        block.block_hash = None
        block.token_ids = None
        block.retain_until = 0.0  # a pin keeps content, and the content is gone

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the prefix index."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free(self, blocks: Sequence[Block]) -> int:
        """Drop one reference from each block; returns how many became free.

        Blocks are queued in reverse so a sequence's tail is evicted before
        its (more shareable) prefix.
        """
        released = 0
        tiered = self._tiered
        for block in reversed(blocks):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                if tiered:
                    block.free_tier = self.eviction.tier(block)
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1
                released += 1
        return released

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        """The cached block for a hash, verified token by token."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(self, block: Block, block_hash: bytes, token_ids: Sequence[int],
                    parent_hash: bytes | None, depth: int) -> bool:
        """Index a newly full block. False when another block already holds
        that content (the index keeps exactly one block per hash)."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        if block.ref_cnt == 0:  # not on the hot path, but keep the count honest
            self.num_cached_free += 1
        if self.events.enabled:  # no record built when nothing drains them
            self.events.emit(BlockStored(self.executor_id, block_hash, parent_hash, block.block_id, depth,
                                         block.token_ids))
        return True

    def restore_cached(self, block_hash: bytes, block_id: int, token_ids: Sequence[int],
                       parent_hash: bytes | None = None, depth: int = 0) -> bool:
        """Rebuild one cached refcount-0 block (restart recovery from the mirror).

        The block enters the index and moves to the tail of the free queue:
        evictable, but after plain free blocks and blocks restored earlier.
        Emits BlockStored like cache_block. False, and no change, when the
        block id is out of range, in use or already cached, the hash is
        already indexed, or the tokens do not fill exactly one block.
        """
        if not 0 <= block_id < self.num_blocks or len(token_ids) != self.block_size or block_hash in self.cached:
            return False
        block = self.blocks[block_id]
        if block.ref_cnt != 0 or block.block_hash is not None:
            return False
        self.free_queue.remove(block)
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        if self._tiered:
            block.free_tier = self.eviction.tier(block)
        self.free_queue.append(block)
        self.cached[block_hash] = block
        self.num_cached_free += 1
        self.events.emit(BlockStored(self.executor_id, block_hash, parent_hash, block_id, depth, block.token_ids))
        return True

    def clear(self) -> None:
        """Forget every cached hash (executor lost or reset)."""
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached.clear()
        self.num_cached_free = 0
        self.events.emit(AllCleared(self.executor_id))


class SwapPool:
    """CPU swap blocks of one executor: plain ids, no content index."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: Iterable[int]) -> None:
        self._free.extend(block_ids)

    def free_ids(self) -> list[int]:
        """The free swap block ids (operators: the block map)."""
        return list(self._free)
