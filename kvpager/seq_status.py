"""Where a sequence's KV is: the one vocabulary the memory service and the
gateway share (each keeps its own view of a sequence, with this status)."""

from __future__ import annotations

import enum


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # no KV: new, or preempted by recompute
    RUNNING = "running"    # holds device blocks
    SWAPPED = "swapped"    # KV held in the executor's CPU swap pool
