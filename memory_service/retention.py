"""Prefix retention: a request may ask that its prompt's blocks stay cached
for ``retention_s`` after it ends (SGLang's TTL pins, TensorRT-LLM's
retention priorities).

When such a sequence is freed, its prompt's full cached blocks are pinned
(``Block.retain_until``) before they go back to the free queue, where the
``RetentionEvictionPolicy`` sends them behind every unpinned block. Pins are
budgeted per tenant and pool: at most ``cap`` blocks of one tenant pinned at
once; a request over its tenant's budget pins its leading blocks up to it
(the prefix is what later requests can hit). A later pin of a block extends
it, never shortens it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memory_service.block import Block
from memory_service.policy import TenantQuota
from memory_service.sequence import Sequence

MAX_RETENTION_S = 7 * 24 * 3600.0  # what one request may ask


@dataclass
class PinBudget:
    """Pinned blocks per (executor, tenant), pruned of expired and evicted
    pins as it is asked (a pin on an evicted block was cleared with its content)."""

    quota: TenantQuota | None      # the most pinned blocks per tenant and pool (None: no pins at all)
    clock: Callable[[], float] = time.monotonic
    _pins: dict[tuple[str, str], dict[Block, float]] = field(default_factory=dict)

    def pinned(self, executor_id: str, tenant: str) -> dict[Block, float]:
        now = self.clock()
        pins = self._pins.setdefault((executor_id, tenant), {})
        for block in [b for b, until in pins.items() if b.retain_until != until or until <= now]:
            del pins[block]
        return pins

    def pin(self, seq: Sequence, num_pool_blocks: int, block_size: int) -> int:
        """Pin seq's prompt blocks for its retention_s. Returns how many are pinned (new or extended)."""
        if seq.retention_s <= 0 or self.quota is None:
            return 0
        pins = self.pinned(seq.executor_id, seq.tenant)
        cap = self.quota.cap(num_pool_blocks) if self.quota is not None else 0
        until = self.clock() + seq.retention_s
        n = 0
        for block in seq.blocks[:seq.num_prompt_tokens // block_size]:
            if block.block_hash is None:
                break  # not cached: nothing after it can be hit either
            if block not in pins and len(pins) >= cap:
                break
            block.retain_until = max(block.retain_until, until)
            pins[block] = block.retain_until
            n += 1
        return n

    def forget(self, executor_id: str) -> None:
        for key in [k for k in self._pins if k[0] == executor_id]:
            del self._pins[key]

    def count(self, executor_id: str) -> int:
        """Pinned blocks of every tenant on one executor (accounting)."""
        return sum(len(self.pinned(eid, tenant)) for eid, tenant in list(self._pins) if eid == executor_id)
