"""KV specs: which layers share one kind of attention, and so one block table.

The vocabulary the executor and the memory service share (vLLM's "KV cache
groups"): a model's layers fall into groups of the same spec — full
attention (``window`` None: every token stays needed) or a sliding window of
``window`` tokens (a query at position p sees keys p - window < k <= p, as
transformers masks it). A sliding-window group's sequence never needs more
than ⌈window / block_size⌉ + 1 blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvGroupSpec:
    """One group of layers with the same attention spec."""

    window: int | None       # sliding window in tokens; None = full attention
    layers: tuple[int, ...]  # layer indices, ascending

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def max_blocks(self, num_tokens: int, block_size: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds in this group."""
        full = -(-num_tokens // block_size)
        if self.window is None:
            return full
        return min(full, -(-self.window // block_size) + 1)


def group_layers(windows: list[int | None]) -> list[KvGroupSpec]:
    """Per-layer windows -> groups, full attention first, then by window.

    Raises ValueError for a window that is not a positive int."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"layer {layer}: sliding window {window!r} must be a positive number of tokens")
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return [KvGroupSpec(window=w, layers=tuple(by_window[w])) for w in order]
