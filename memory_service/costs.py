"""What an executor measured of its own costs, as the memory service keeps it.

Executors time their own steps and swaps (``executor_service/costs.py``) and
report the figures at registration and in every heartbeat; the mode policy
turns them into seconds per victim. Nothing here is configured: an executor
that has not measured something reports 0 and the policy falls back.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from kvpager.errors import InvalidArgument

MAX_PREFILL_POINTS = 64  # buckets one report may carry


@dataclass(frozen=True, slots=True)
class ExecutorCosts:
    """Prefill throughput by batch size and the host-link copy bandwidth.

    ``prefill_batch_tokens`` ascending: a step computing about that many
    tokens ran at ``prefill_tokens_per_s`` (same length). ``swap_bytes_per_s``:
    device <-> CPU swap pool copies (0 = not measured). ``block_bytes``: one
    block of all layers, K and V."""

    prefill_batch_tokens: tuple[int, ...] = ()
    prefill_tokens_per_s: tuple[float, ...] = ()
    swap_bytes_per_s: float = 0.0
    block_bytes: int = 0

    def __post_init__(self) -> None:
        tokens, rates = self.prefill_batch_tokens, self.prefill_tokens_per_s
        if len(tokens) != len(rates):
            raise InvalidArgument("costs: prefill_batch_tokens and prefill_tokens_per_s differ in length")
        if len(tokens) > MAX_PREFILL_POINTS:
            raise InvalidArgument(f"costs: at most {MAX_PREFILL_POINTS} prefill points, got {len(tokens)}")
        if any(t <= 0 for t in tokens) or any(b <= a for a, b in zip(tokens, tokens[1:])):
            raise InvalidArgument("costs: prefill_batch_tokens must be positive and strictly ascending")
        if any(not math.isfinite(r) or r <= 0 for r in rates):
            raise InvalidArgument("costs: prefill_tokens_per_s must be finite and positive")
        if not math.isfinite(self.swap_bytes_per_s) or self.swap_bytes_per_s < 0 or self.block_bytes < 0:
            raise InvalidArgument("costs: swap_bytes_per_s and block_bytes must be finite and >= 0 (0: unmeasured)")

    @property
    def measured(self) -> bool:
        return bool(self.prefill_batch_tokens) and self.swap_bytes_per_s > 0 and self.block_bytes > 0

    def prefill_s(self, num_tokens: int) -> float | None:
        """Seconds to prefill num_tokens: a step's time is interpolated
        linearly between the measured batch sizes around it; past the largest
        a prefill runs in chunks at that rate, below the smallest at its
        rate. None when nothing is measured."""
        if num_tokens <= 0:
            return 0.0
        sizes, rates = self.prefill_batch_tokens, self.prefill_tokens_per_s
        if not sizes:
            return None
        i = bisect_right(sizes, num_tokens)
        if i == 0:
            return num_tokens / rates[0]
        if i == len(sizes):
            return num_tokens / rates[-1]
        lo, hi = sizes[i - 1], sizes[i]
        t_lo, t_hi = lo / rates[i - 1], hi / rates[i]
        return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)

    def swap_s(self, num_blocks: int) -> float | None:
        """Seconds to copy num_blocks out to the swap pool and back in."""
        if num_blocks <= 0:
            return 0.0
        if self.swap_bytes_per_s <= 0 or self.block_bytes <= 0:
            return None
        return 2 * num_blocks * self.block_bytes / self.swap_bytes_per_s
