"""Which sequences compute how many tokens in the next step.

The order is a policy (one method, ``key``; chosen by name through
``make_policy``); the budget is per executor and step, since each executor
runs its own forward: at most ``max_batch_tokens`` tokens (prefill chunks
and decodes together) and ``max_running`` sequences. A prefill that does not
fit whole is chunked by what is left of the budget. An executor whose every sequence is
a running decode may take a decode burst of ``num_steps`` tokens each
(gateway.bursts).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.bursts import MAX_STEPS, DecodeClock, lookaheads
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
    # Per entry of seqs (empty: none): tokens it samples ahead in a decode burst.
    lookahead: list[int] = field(default_factory=list)
    # Executors whose burst answers sub-step by sub-step (ExecuteStream): a client waits for tokens mid-burst.
    streamed: set[str] = field(default_factory=set)
    # Per entry of seqs: its tokens that steps in flight sample and this step feeds (0: none; its
    # last one needs a placeholder at the memory service, the others hold theirs already).
    fed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


def fed_tokens(seq: Seq) -> int:
    """Tokens of ``seq`` that steps in flight sample and a step planned now
    would feed (0: none may be fed). A running sequence fed ahead
    (``Seq.feed_ahead``) whose every computed token is known or held as a
    placeholder: the token its latest row samples, after the ones a burst in
    flight samples before it (held as placeholders: ``Seq.placeholders``)."""
    unknown = seq.num_computed - len(seq.tokens)
    if not seq.feed_ahead or seq.status is not SeqStatus.RUNNING or unknown != seq.placeholders:
        return 0
    return unknown + 1


@dataclass(slots=True)
class Scheduler:
    policy: SchedulingPolicy
    max_batch_tokens: int = 2048
    max_running: int = 64
    num_steps: int = 1  # > 1: decode bursts of up to this many tokens (gateway.bursts)
    max_burst_s: float = 0.03  # a burst lasts at most this long in measured forwards (gateway.bursts)
    clock: DecodeClock = field(default_factory=DecodeClock)  # each executor's time per one-token forward

    def __post_init__(self) -> None:
        if not 1 <= self.num_steps <= MAX_STEPS:
            raise ValueError(f"num_scheduler_steps must be in [1, {MAX_STEPS}], got {self.num_steps}")

    def schedule(self, seqs: Iterable[Seq], idle: Collection[str], max_model_len: int = 0,
                 hold: Collection[str] = ()) -> Batch:
        """The work of the executors in ``idle`` (the others cannot take a step
        now). A sequence whose next token a step in flight samples and that may
        be fed ahead (``Seq.feed_ahead``) counts that token as its next to compute,
        unless its executor is in ``hold`` (a burst runs there, not near its end).
        ``max_model_len``: the executors' context limit (bursts stay under it)."""
        budget = dict.fromkeys(idle, self.max_batch_tokens)
        running = dict.fromkeys(idle, 0)
        open_executors = len(budget)
        batch = Batch()
        bursts = self.num_steps > 1 and max_model_len > 0
        mixed: set[str] = set()  # executors with work other than running decodes: no burst
        fed: list[int] = []      # per batch entry: tokens in flight it is fed (Batch.fed)
        for s in sorted(seqs, key=self.policy.key):
            if open_executors == 0 and not bursts:
                break
            eid = s.executor_id
            remaining = len(s.tokens) - s.num_computed
            in_flight = fed_tokens(s) if eid not in hold else 0
            if in_flight:
                remaining = 1  # the last token being sampled, fed as a placeholder
            if budget.get(eid, 0) <= 0:
                if bursts and eid in budget and remaining > 0:
                    mixed.add(eid)  # work left out of this step: it waits for the next
                continue
            if remaining <= 0:
                continue
            if bursts and (s.status is not SeqStatus.RUNNING or remaining != 1):
                mixed.add(eid)
            fed.append(in_flight)
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
        batch.fed = fed
        if bursts and len(mixed) < len(budget):
            self._bursts(batch, fed, mixed, max_model_len)
        return batch

    def _bursts(self, batch: Batch, fed: list[int], mixed: set[str], max_model_len: int) -> None:
        """batch.lookahead for the executors whose every sequence is a running decode in the batch."""
        rows: dict[str, list[int]] = {}
        for i, s in enumerate(batch.seqs):
            if s.executor_id not in mixed:
                rows.setdefault(s.executor_id, []).append(i)
        ahead = [0] * len(batch.seqs)
        limits = self.clock.limits(self.num_steps, self.max_burst_s)
        for eid, idx in rows.items():
            steps = limits.get(eid, 1)  # not measured yet: no burst
            if steps < 2:
                continue
            sizes, streamed = lookaheads([batch.seqs[i] for i in idx], [fed[i] for i in idx], steps, max_model_len)
            for i, m in zip(idx, sizes):
                ahead[i] = m
            if streamed:
                batch.streamed.add(eid)
        if any(ahead):
            batch.lookahead = ahead
