"""KV events: what the prefix index did, queued for the Redis mirror.

The pool appends records to an in-memory queue on the allocation path (no
I/O); the mirror writer drains it off the hot path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Union

from kvpager.prefix_index.ops import TIER_CPU, TIER_DEVICE  # noqa: F401 - the tiers events name


@dataclass(slots=True)
class BlockStored:
    executor_id: str
    block_hash: bytes
    parent_hash: bytes | None  # None for the first block of a prefix
    block_id: int
    depth: int                 # index of the block in its prefix (0-based)
    token_ids: tuple[int, ...] = ()  # the block's tokens: a rebuilt index verifies hits with them
    tier: str = TIER_DEVICE


@dataclass(slots=True)
class BlockRemoved:
    executor_id: str
    block_hash: bytes
    block_id: int
    tier: str = TIER_DEVICE


@dataclass(slots=True)
class AllCleared:
    executor_id: str


KVEvent = Union[BlockStored, BlockRemoved, AllCleared]


class EventQueue:
    """Unbounded FIFO of KV events with a drain for the mirror.

    `enabled` is False when nothing consumes events (the embedded default), so
    the allocation path does not pay for them.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: deque[KVEvent] = deque()
        self.num_emitted = 0

    def emit(self, event: KVEvent) -> None:
        if self.enabled:
            self._events.append(event)
            self.num_emitted += 1

    def drain(self, max_events: int | None = None) -> list[KVEvent]:
        n = len(self._events) if max_events is None else min(max_events, len(self._events))
        return [self._events.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._events)
