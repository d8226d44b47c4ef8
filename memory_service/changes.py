"""What a plan tells an executor besides its rows, as data: how its block
tables changed, and the block moves it applies before the forward.

The executor keeps every running sequence's block table (as vLLM v1's
workers do); a plan carries only the changes since its last plan. The
executor applies them in this order: forks (a child's table and computed
length are its parent's), drops (tables it forgets: finished, aborted,
preempted or swapped-out sequences), starts (a sequence admitted or swapped
in: its whole table and how many of its tokens are in cache), extends
(``table[first:]`` replaced by the blocks given: growth appends, a
copy-on-write replaces the shared tail).

Starts and extends come only with a row of the same plan. Forks and drops
may happen in steps whose plan never goes to the executor (a stand-alone
Fork or Free, frees while the executor is busy with an earlier step): they
wait in the builder and leave with the next plan that does.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field


def _i32() -> array:
    return array("i")


def _i64() -> array:
    return array("q")


def _offsets() -> array:
    return array("i", [0])


@dataclass(slots=True)
class TableChanges:
    forks: list[tuple[int, list[int]]] = field(default_factory=list)   # (parent, children) in order
    dropped: array = field(default_factory=_i64)
    started_seq_ids: array = field(default_factory=_i64)
    started_context_lens: array = field(default_factory=_i32)   # tokens already in cache
    started_cached_tokens: array = field(default_factory=_i32)  # prefix hit of a first admission (0 otherwise)
    started_offsets: array = field(default_factory=_offsets)
    started_block_ids: array = field(default_factory=_i32)
    extended_seq_ids: array = field(default_factory=_i64)
    extended_first_index: array = field(default_factory=_i32)
    extended_offsets: array = field(default_factory=_offsets)
    extended_block_ids: array = field(default_factory=_i32)

    def fork(self, parent_id: int, child_id: int) -> None:
        if self.forks and self.forks[-1][0] == parent_id:
            self.forks[-1][1].append(child_id)
        else:
            self.forks.append((parent_id, [child_id]))

    def drop(self, seq_id: int) -> None:
        self.dropped.append(seq_id)

    def start(self, seq_id: int, context_len: int, cached_tokens: int, block_ids: array) -> None:
        self.started_seq_ids.append(seq_id)
        self.started_context_lens.append(context_len)
        self.started_cached_tokens.append(cached_tokens)
        self.started_block_ids.extend(block_ids)
        self.started_offsets.append(len(self.started_block_ids))

    def extend(self, seq_id: int, first_index: int, block_ids: Iterable[int]) -> None:
        self.extended_seq_ids.append(seq_id)
        self.extended_first_index.append(first_index)
        self.extended_block_ids.extend(block_ids)
        self.extended_offsets.append(len(self.extended_block_ids))

    @property
    def has_row_changes(self) -> bool:
        return bool(self.started_seq_ids or self.extended_seq_ids)

    def __bool__(self) -> bool:
        return bool(self.forks or self.dropped or self.started_seq_ids or self.extended_seq_ids)


@dataclass(slots=True)
class CacheOpsBuilder:
    """Copy / swap ops of one executor for one step (executed: swap-out,
    swap-in, then copies)."""

    copy_src: list[int] = field(default_factory=list)
    copy_dst: list[int] = field(default_factory=list)
    swap_out_src: list[int] = field(default_factory=list)
    swap_out_dst: list[int] = field(default_factory=list)
    swap_in_src: list[int] = field(default_factory=list)
    swap_in_dst: list[int] = field(default_factory=list)
    # CPU blocks read by this step's swap-ins; reusable only after the step,
    # or a swap-out (executed first) could overwrite them before they are read.
    deferred_swap_free: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copy_src or self.swap_out_src or self.swap_in_src)
