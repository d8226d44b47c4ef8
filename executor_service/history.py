"""Token histories of the sequences whose sampling uses a penalty.

Repetition, frequency and presence penalties count a sequence's tokens
(prompt and generated), but a plan carries only the tokens computed now, and
a prefix-cache hit means the executor never sees the cached ones. So the
executor keeps each penalised sequence's tokens, as vLLM v1's workers keep
each request's token ids, and follows the plan's table changes the way its
block tables do (``tables.py``): a fork copies the parent's history, a drop
forgets it, a start replaces it by what the request sends with that start
(the tokens already in cache: a prefix hit, a swap-in; none for a fresh
prompt). Each step then appends a row's computed tokens. A steady decode
step therefore sends no history at all: its bytes do not grow with the
context (docs/benchmarks.md).

The invariant, checked every step: a penalised row's history holds exactly
the tokens its table says are in cache (``Resolved.context_lens``), so a
plan that is out of step is refused (FAILED_PRECONDITION) before anything
changes. Applied in two halves like the tables: ``resolve`` checks and
stages, touching nothing; ``commit`` writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from executor_service.step import StepInput
from executor_service.tables import Resolved
from kvpager.errors import FailedPrecondition


@dataclass(slots=True)
class StagedHistories:
    """A checked step's histories, not yet written."""

    reset: bool
    staged: dict[int, np.ndarray | None]  # touched sequences -> history after the step (None: forgotten)
    rows: dict[int, np.ndarray]           # row index -> its tokens through this step (penalised rows)


class TokenHistories:
    def __init__(self) -> None:
        self._tokens: dict[int, np.ndarray] = {}  # seq_id -> int32 tokens in cache (never mutated in place)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tokens

    def tokens(self, seq_id: int) -> list[int]:
        return self._tokens[seq_id].tolist()

    def clear(self) -> None:
        self._tokens.clear()

    def resolve(self, step: StepInput, resolved: Resolved) -> StagedHistories:
        """Raises FailedPrecondition when a penalised row's history does not
        match its tokens in cache; changes nothing."""
        reset = resolved.reset
        staged: dict[int, np.ndarray | None] = {}
        n = len(step.seq_ids)
        penalized = step.sampling.penalized(n)
        if not self._tokens and penalized is None:
            return StagedHistories(reset, staged, {})  # the usual step: nobody penalises

        def current(seq_id: int) -> np.ndarray | None:
            if seq_id in staged:
                return staged[seq_id]
            return None if reset else self._tokens.get(seq_id)

        t = step.tables
        for parent, children in t.forks:
            h = current(parent)
            for child in children:
                staged[child] = h  # arrays are never changed in place: sharing is a copy
        for seq_id in t.dropped.tolist():
            staged[seq_id] = None
        for seq_id in t.started_seq_ids.tolist():
            staged[seq_id] = None  # replaced by what the request sends with the start
        rows: dict[int, np.ndarray] = {}
        if penalized is not None:
            q = step.query_lens.astype(np.int64)
            first = np.cumsum(q) - q
            for i in np.nonzero(penalized)[0].tolist():
                seq_id = int(step.seq_ids[i])
                sent = step.sampling.history(i)
                base = sent if sent is not None else current(seq_id)
                if base is None:
                    base = np.zeros(0, np.int32)
                in_cache = int(resolved.context_lens[i])
                if len(base) != in_cache:
                    raise FailedPrecondition(
                        f"sequence {seq_id}: its token history holds {len(base)} tokens, its table {in_cache} "
                        f"(a penalised row's tokens in cache come with its start)")
                tokens = np.concatenate([base.astype(np.int32, copy=False),
                                         step.token_ids[first[i]:first[i] + q[i]]])
                staged[seq_id] = rows[i] = tokens
        return StagedHistories(reset, staged, rows)

    def commit(self, staged: StagedHistories) -> None:
        if staged.reset:
            self._tokens.clear()
        for seq_id, tokens in staged.staged.items():
            if tokens is None:
                self._tokens.pop(seq_id, None)
            else:
                self._tokens[seq_id] = tokens
