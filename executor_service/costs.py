"""The executor's own costs, measured as it runs: what the memory service's
preemption mode policy weighs (recompute = prefill again, swap = copy out
and back over the host link).

* prefill throughput as a function of batch tokens: every forward's time,
  bucketed by its batch size in powers of two, kept as a moving average
  per bucket (a step's tokens / its forward seconds);
* copy bandwidth between the device pool and the CPU swap pool: every
  step's swap ops (bytes / seconds), seeded at start by a short probe so
  the figure exists before the first preemption.

Pure bookkeeping (no torch, no grpc); ``Executor`` feeds it, the
registration reports ``snapshot()``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

EWMA = 0.2            # weight of a new sample (recent steps matter, one outlier does not)
MIN_SECONDS = 1e-5    # shorter timings are clock noise, not throughput


@dataclass(frozen=True, slots=True)
class CostSnapshot:
    prefill_batch_tokens: tuple[int, ...]   # ascending bucket sizes measured (tokens per step)
    prefill_tokens_per_s: tuple[float, ...]
    swap_bytes_per_s: float                  # 0: not measured
    block_bytes: int


def bucket(num_tokens: int) -> int:
    """The power of two at or below num_tokens (>= 1)."""
    return 1 << (max(1, num_tokens).bit_length() - 1)


class CostMeter:
    """Thread-safe: steps record on the executor's thread, heartbeats read on the loop."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._prefill: dict[int, float] = {}   # bucket -> tokens/s
        self._swap_bytes_per_s = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def _mix(old: float, new: float) -> float:
        return new if old <= 0 else (1 - EWMA) * old + EWMA * new

    def record_forward(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds < MIN_SECONDS:
            return
        b = bucket(num_tokens)
        with self._lock:
            self._prefill[b] = self._mix(self._prefill.get(b, 0.0), num_tokens / seconds)

    def record_swap(self, num_blocks: int, seconds: float) -> None:
        """num_blocks moved one way or the other (out and in summed) in seconds."""
        if num_blocks <= 0 or seconds < MIN_SECONDS:
            return
        with self._lock:
            self._swap_bytes_per_s = self._mix(self._swap_bytes_per_s, num_blocks * self.block_bytes / seconds)

    def snapshot(self) -> CostSnapshot:
        with self._lock:
            sizes = tuple(sorted(self._prefill))
            return CostSnapshot(sizes, tuple(self._prefill[b] for b in sizes), self._swap_bytes_per_s,
                                self.block_bytes)
