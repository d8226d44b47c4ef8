"""A sequence as the memory service sees it: tokens, what is computed, and
where its KV lives."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpager.seq_status import SeqStatus
from memory_service.block import Block

if TYPE_CHECKING:
    from memory_service.kv_groups import GroupedSeq


PLACEHOLDER = -1     # a token id not known yet (see Sequence.num_pending)
# Placeholders one sequence may hold: MAX_PENDING + MAX_LOOKAHEAD, its tokens that Executes in
# flight sample (two one-token steps; or a burst's and the last sample a step planned ahead feeds).
MAX_PENDING = 2
MAX_LOOKAHEAD = 63   # tokens one sequence may sample ahead in a step (a decode burst of 64)


@dataclass(slots=True, eq=False)
class Sequence:
    """Mutated only by the executor's KVManager (blocks, counts) and the
    MemoryManager (tokens, status)."""

    seq_id: int
    executor_id: str
    token_ids: list[int]
    root_hash: bytes                # h_{-1}: namespace chained with cache salt
    priority: int = 0               # lower = more important
    arrival: int = 0                # admission order; higher = newer
    max_total_tokens: int = 0       # prompt + max new tokens (0 = executor limit)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0           # tokens whose KV is (or is being) written
    blocks: list[Block] = field(default_factory=list)
    # blocks' ids, kept beside them so a plan copies a table with one memcpy
    block_ids: array = field(default_factory=lambda: array("i"))
    swap_blocks: list[int] = field(default_factory=list)
    # Chained hashes of full token blocks (not of physical blocks), computed lazily.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0      # leading blocks known to be in the prefix index
    admitted: bool = False          # prefix hits count only on the first admission
    num_cached_tokens: int = 0      # prefix hit at first admission (usage report)
    num_prompt_tokens: int = 0
    token_limit: int = 0            # most tokens it may ever hold (context, pool, max_total_tokens)
    on_executor: bool = False       # the executor holds a table for it (started or forked, not dropped since)
    # Trailing placeholders in token_ids (PLACEHOLDER): tokens an Execute in
    # flight is sampling; the next appends replace them. Never hashed.
    num_pending: int = 0
    request_id: str = ""            # the client's request (operators only; never a key)
    tenant: str = ""                # whose blocks these are (per-tenant quotas; forks inherit it)
    retention_s: float = 0.0        # keep its prompt's blocks cached this long after it ends (retention.py)
    # Its table per KV group, on an executor with a table per group (memory_service.grouped_kv); None otherwise.
    kv_groups: GroupedSeq | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known(self) -> int:
        """Tokens whose ids are known (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending
