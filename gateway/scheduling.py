"""Which sequences compute how many tokens in the next step.

The order is a policy (one method, ``key``; chosen by name through
``make_policy``); the budget is per executor and step, since each executor
runs its own forward: at most ``max_batch_tokens`` tokens (prefill chunks
and decodes together) and ``max_running`` sequences. A prefill that does not
fit whole is chunked by what is left of the budget.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.state import Seq
from kvpager.seq_status import SeqStatus


class SchedulingPolicy(Protocol):
    name: str

    def key(self, seq: Seq) -> tuple:
        """Sort key: smaller is served first (and preempted last)."""


class FcfsPolicy:
    """Sequences already holding KV first, then by arrival; a request's
    ``priority`` is not looked at (``--policy fcfs``)."""

    name = "fcfs"

    def key(self, seq: Seq) -> tuple:
        return (seq.status is SeqStatus.WAITING, seq.request.arrival, seq.seq_id)


class PriorityPolicy:
    """The default: by priority (lower = more important, as vLLM) across
    running and waiting sequences, so a more important waiting request can
    preempt a running one; among equal priorities exactly ``FcfsPolicy``
    (those holding KV first, then arrival), so a deployment where no request
    sets a priority schedules as it did before priorities were honoured."""

    name = "priority"

    def key(self, seq: Seq) -> tuple:
        return (seq.request.priority, seq.status is SeqStatus.WAITING, seq.request.arrival, seq.seq_id)


POLICIES = {cls.name: cls for cls in (FcfsPolicy, PriorityPolicy)}
DEFAULT_POLICY = PriorityPolicy.name


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"scheduling policy must be one of {sorted(POLICIES)}, got {name!r}") from None


@dataclass(slots=True)
class Batch:
    """One step's work, in the policy's order (the order the memory service allocates in)."""

    seqs: list[Seq] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # at most this many not-yet-computed tokens each
    new: list[Seq] = field(default_factory=list)          # not yet known to the memory service

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(slots=True)
class Scheduler:
    policy: SchedulingPolicy
    max_batch_tokens: int = 2048
    max_running: int = 64

    def schedule(self, seqs: Iterable[Seq], idle: Collection[str]) -> Batch:
        """The work of the executors in ``idle`` (the others cannot take a step
        now). A sequence whose next token a step in flight samples and that may
        be fed ahead (``Seq.feed_ahead``) counts that token as its next to compute."""
        budget = dict.fromkeys(idle, self.max_batch_tokens)
        running = dict.fromkeys(idle, 0)
        open_executors = len(budget)
        batch = Batch()
        for s in sorted(seqs, key=self.policy.key):
            if open_executors == 0:
                break
            eid = s.executor_id
            if budget.get(eid, 0) <= 0:
                continue
            remaining = len(s.tokens) - s.num_computed
            if s.feed_ahead and s.status is SeqStatus.RUNNING:
                remaining += 1  # the token being sampled, fed as a placeholder
            if remaining <= 0:
                continue
            k = min(remaining, budget[eid])
            budget[eid] -= k
            running[eid] += 1
            if budget[eid] <= 0 or running[eid] >= self.max_running:
                budget[eid] = 0
                open_executors -= 1
            batch.seqs.append(s)
            batch.num_tokens.append(k)
            if not s.created:
                batch.new.append(s)
        return batch
