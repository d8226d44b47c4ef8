"""Which device blocks this pool's recent steps wrote.

The memory service mirrors its prefix index to Redis write-behind, so after
a crash the mirror may describe the pool as of step P while the executor has
applied steps up to A > P. Refusing the whole mirror then (the coarse step
fence) throws away a warm cache for the few blocks those steps touched. The
executor instead answers, at ConfirmPool, the blocks written in the steps
after P — KV stored through the slot mapping, copy and swap-in destinations —
and recovery keeps every other mirrored block.

The log keeps the written arrays of the last ``max_steps`` steps as given
(no per-step work beyond a reference); the union is computed only when asked.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class WriteLog:
    def __init__(self, block_size: int, max_steps: int = 4096) -> None:
        self.block_size = block_size
        self.max_steps = max_steps
        # (step_id, slot_mapping int32 [tokens], copy_dst int32, swap_in_dst int32)
        self._steps: deque[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = deque()
        self._dropped_upto = 0  # highest step id no longer in the log (0: nothing dropped)

    def record(self, step_id: int, slot_mapping: np.ndarray, copy_dst: np.ndarray, swap_in_dst: np.ndarray) -> None:
        """A step about to touch the pool (recorded before it does)."""
        self._steps.append((step_id, slot_mapping, copy_dst, swap_in_dst))
        while len(self._steps) > self.max_steps:
            self._dropped_upto = max(self._dropped_upto, self._steps.popleft()[0])

    def reset(self) -> None:
        """A new pool generation: earlier steps say nothing about it."""
        self._steps.clear()
        self._dropped_upto = 0

    def written_since(self, step_id: int) -> np.ndarray | None:
        """Sorted unique device block ids written by steps with id > step_id
        (int32), or None when the log no longer reaches back that far."""
        steps = list(self._steps)  # one C call under the GIL: a snapshot even while a step records itself
        if step_id < self._dropped_upto:
            return None
        parts = []
        for sid, slots, copy_dst, swap_in_dst in steps:
            if sid <= step_id:
                continue
            if len(slots):
                parts.append(slots // self.block_size)
            parts.append(copy_dst)
            parts.append(swap_in_dst)
        if not parts:
            return np.zeros(0, np.int32)
        return np.unique(np.concatenate(parts).astype(np.int32, copy=False))
