"""Policies: small one-method objects the mechanism consults. The pool and
the per-executor KV manager never choose; the planner asks these.

* ``VictimEligibility.eligible`` — may this running sequence give its blocks
  back so that the requester gets room?
* ``VictimPolicy.select`` — which of the eligible ones goes first.
* ``ModePolicy.choose`` — recompute or swap, per victim.
* ``EvictionPolicy.tier`` — which cached-but-free blocks are evicted first
  (the pool pops the lowest tier, least recently freed first within it).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvpager.seq_status import SeqStatus
from memory_service.block import Block
from memory_service.sequence import Sequence


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class VictimEligibility:
    """A running sequence that cannot grow may push back any running sequence
    not yet served in this step (itself included: it then waits). A waiting or
    swapped one being admitted may push back only strictly less important
    ones (equal priorities never preempt for admission, so the pool cannot
    thrash)."""

    def eligible(self, candidate: Sequence, requester: Sequence) -> bool:
        if requester.status is SeqStatus.RUNNING:
            return True
        return candidate.priority > requester.priority


class VictimPolicy:
    """Which eligible running sequence gives its blocks back: the least
    important (highest priority value), and among equals the newest arrival —
    the sequence that has had the least service loses the least work."""

    def select(self, candidates: Iterable[Sequence]) -> Sequence | None:
        return max(candidates, key=lambda s: (s.priority, s.arrival), default=None)


@dataclass
class ModePolicy:
    """Recompute or swap, per victim, by a fixed length threshold: swap when
    the victim has at least ``swap_min_tokens`` computed tokens (a long
    prefill is costlier to redo than its blocks are to copy over the host
    link) and the CPU swap pool has room for all its blocks; otherwise
    recompute."""

    swap_min_tokens: int = 256

    def choose(self, seq: Sequence, swap_free_blocks: int) -> PreemptionMode:
        if seq.num_computed >= self.swap_min_tokens and len(seq.blocks) <= swap_free_blocks:
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE


class EvictionPolicy:
    """Eviction order of free blocks: every block in one tier, so the pool
    evicts least recently freed first (LRU). A policy with more tiers sends
    some blocks behind others (say, retained prefixes after the rest);
    ``tiers`` says how many, ``tier(block)`` is asked when a block is freed."""

    tiers = 1

    def tier(self, block: Block) -> int:
        return 0
