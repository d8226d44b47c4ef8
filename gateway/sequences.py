"""The gateway's live sequences, and what changed about them since the last Step.

A sequence is one memory-service sequence (one completion, or one beam). The
table hands out sequence ids, and records the changes the next Step carries
to the memory service: forks, sampled tokens, frees and aborts. It is the
narrow interface parallel sampling and beam search work through (``fork``,
``append``, ``release``); nothing else mutates these records. Mutated only by
the engine loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.state import Completion, Request, Seq
from kvpager.seq_status import SeqStatus


@dataclass(slots=True)
class Changes:
    """What the next Step tells the memory service before scheduling."""

    forks: list[tuple[int, list[int]]] = field(default_factory=list)  # (parent, children), in order
    appends: dict[int, list[int]] = field(default_factory=dict)        # seq_id -> the tokens sampled for it
    free: list[int] = field(default_factory=list)                      # finished
    abort: list[int] = field(default_factory=list)                     # aborted, failed, pruned on error
    cut: list[int] = field(default_factory=list)                       # whose burst was cut short (gateway.bursts)
    carried: list[int] = field(default_factory=list)                   # cut, the next sub-step carried (results)

    def __bool__(self) -> bool:
        return bool(self.forks or self.appends or self.free or self.abort or self.cut or self.carried)

    def only_appends(self) -> bool:
        return not (self.forks or self.free or self.abort or self.cut or self.carried)


class SequenceTable:
    def __init__(self) -> None:
        self.seqs: dict[int, Seq] = {}
        # Unique across gateway restarts too (a memory service outlives a gateway): milliseconds << 20.
        self._ids = itertools.count((int(time.time() * 1000) << 20) + 1)
        self.changes = Changes()

    def __len__(self) -> int:
        return len(self.seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def get(self, seq_id: int) -> Seq | None:
        return self.seqs.get(seq_id)

    def __iter__(self) -> Iterator[Seq]:
        return iter(self.seqs.values())

    # ---- creation -----------------------------------------------------------------

    def start(self, req: Request, completion: Completion | None) -> Seq:
        """The first sequence of a request: its prompt, nothing computed, not yet known to the memory service."""
        seq = Seq(next(self._ids), req, completion, list(req.prompt_ids), req.executor_id)
        self.seqs[seq.seq_id] = seq
        return seq

    def fork(self, parent: Seq, completions: list[Completion | None], *, sampled_first: bool = False) -> list[Seq]:
        """Children sharing every block of ``parent`` (copy-on-write at the memory
        service), one per completion given, with the parent's tokens and progress
        (and its rewinds: ``max_retries`` bounds a lineage, gateway/recovery.py)."""
        children = []
        for comp in completions:
            child = Seq(next(self._ids), parent.request, comp, list(parent.tokens), parent.executor_id,
                        num_computed=parent.num_computed, status=SeqStatus.RUNNING, created=True,
                        sampled_first=sampled_first, retries=parent.retries)
            self.seqs[child.seq_id] = child
            children.append(child)
        if children:
            self.changes.forks.append((parent.seq_id, [c.seq_id for c in children]))
        return children

    # ---- change ---------------------------------------------------------------------

    def append(self, seq: Seq, token: int) -> None:
        """A sampled token joins the sequence (and the memory service's copy next Step)."""
        seq.tokens.append(token)
        self.changes.appends.setdefault(seq.seq_id, []).append(token)
        if seq.placeholders:  # at the memory service it replaces the placeholder it held for this token
            seq.placeholders -= 1

    def release(self, seq: Seq, abort: bool = False) -> None:
        """Forget a sequence; the memory service frees it in the next Step."""
        self.forget(seq.seq_id)
        if seq.created:
            (self.changes.abort if abort else self.changes.free).append(seq.seq_id)

    def forget(self, seq_id: int) -> None:
        """Drop it here only (the memory service already dropped it, or never had it)."""
        self.seqs.pop(seq_id, None)
        self.changes.appends.pop(seq_id, None)
        if seq_id in self.changes.cut:
            self.changes.cut.remove(seq_id)
        if seq_id in self.changes.carried:
            self.changes.carried.remove(seq_id)

    def readmit(self, seqs: list[Seq], executor_id: str) -> list[int]:
        """Give each of ``seqs`` a new id, to be admitted again as new on
        ``executor_id`` with every token it has (recompute: gateway/recovery.py).
        The memory service's copies under the old ids are gone, or the caller
        frees them; the changes still naming them are dropped. Returns the old ids."""
        old = [s.seq_id for s in seqs]
        gone = set(old)
        ch = self.changes
        for seq_id in old:
            self.seqs.pop(seq_id, None)
            ch.appends.pop(seq_id, None)
        ch.free = [i for i in ch.free if i not in gone]
        ch.abort = [i for i in ch.abort if i not in gone]
        ch.cut = [i for i in ch.cut if i not in gone]
        ch.carried = [i for i in ch.carried if i not in gone]
        ch.forks = [(p, [c for c in kids if c not in gone]) for p, kids in ch.forks if p not in gone]
        ch.forks = [(p, kids) for p, kids in ch.forks if kids]
        for s in seqs:
            s.seq_id = next(self._ids)
            s.executor_id = executor_id
            s.num_computed = 0
            s.status = SeqStatus.WAITING
            s.created = False
            s.sampling = 0
            s.feed_ahead = False
            s.placeholders = 0
            self.seqs[s.seq_id] = s
        return old

    def take_changes(self) -> Changes:
        changes, self.changes = self.changes, Changes()
        return changes

    def clear(self) -> None:
        self.seqs.clear()
        self.changes = Changes()

    # ---- views ----------------------------------------------------------------------

    def of_request(self, req: Request) -> list[Seq]:
        return [s for s in self.seqs.values() if s.request is req]

    def of_executor(self, executor_id: str) -> list[Seq]:
        return [s for s in self.seqs.values() if s.executor_id == executor_id]

    def load(self, executor_id: str) -> int:
        return sum(1 for s in self.seqs.values() if s.executor_id == executor_id)
