"""Preemption policies: small objects the manager consults. The pool and the
per-executor KV manager never choose victims."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from memory_service.sequence import Sequence


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


class VictimPolicy:
    """Which running sequence gives its blocks back: the least important
    (highest priority value), and among equals the newest arrival — the
    sequence that has had the least service lose the least work."""

    def select(self, candidates: Iterable[Sequence]) -> Sequence | None:
        return max(candidates, key=lambda s: (s.priority, s.arrival), default=None)


@dataclass
class ModePolicy:
    """Recompute or swap, per victim, by estimated cost.

    Recomputing n tokens costs a prefill of n tokens (~n / prefill_tokens_per_s);
    swapping costs two copies of its blocks over the host link
    (~2 * blocks * block_bytes / swap_bytes_per_s). With the defaults the
    crossover sits near `swap_min_tokens`: short sequences are cheaper to
    recompute, long ones to swap — when the CPU swap pool has room.
    """

    swap_min_tokens: int = 256

    def choose(self, seq: Sequence, swap_free_blocks: int) -> PreemptionMode:
        if seq.num_computed >= self.swap_min_tokens and len(seq.blocks) <= swap_free_blocks:
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE
