"""When a step planned ahead behind a prefill waits for arrivals to settle.

Requests that come together (a client's batch of prompts, sent at once)
reach the loop one by one, about half a millisecond apart on a 2-core
machine. The first is planned and sent at once; the step after it, planned
ahead while that prefill runs, took only the few that had come by then: 32
prompts of the 30M model went out as steps of 232, 817, 2,048 and 1,475
tokens, 0.31 s of forwards, against 0.23 s in three full steps. So while
requests are still arriving (the last one less than ``settle_s`` ago), an
executor that runs a prefill gets its next step planned only once the
arrivals pause, that step is full, or the prefill returns: the prefill's
forward lasts tens of milliseconds, the pause costs it nothing. A lone
request's own decode waits too (whether another is coming is not known
yet): it is still planned while the prefill runs unless that prefill is
shorter than the settle time, and then it waits at most that. Holding only
for requests that came after the prefill was planned would plan the first
prompt's decode alone whenever the loop got to it before the second
prompt came: a step of one row, nearly a full decode step's time. An idle
executor's first step is never held, and a decode burst running is not
(a request arriving cuts it, as before).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from gateway import metrics
from gateway.inflight import Call, latest
from gateway.scheduling import Batch, Scheduler


def computes_prompt(call: Call) -> bool:
    """The call computes prompt tokens (a row with more than its fed token and burst)."""
    return any(len(row.token_ids) > 1 + row.burst for row in call.rows)


class ArrivalSettle:
    """The time of the latest admission, and the executors whose planned-ahead step waits."""

    def __init__(self, settle_s: float, max_batch_tokens: int, max_running: int) -> None:
        if settle_s < 0:
            raise ValueError(f"settle_s must be >= 0, got {settle_s}")
        self.settle_s = settle_s
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.last_admit = -math.inf
        self.replan_at = 0.0  # when a step held by the latest schedule is planned (perf_counter; 0.0: none)

    def admitted(self, now: float) -> None:
        self.last_admit = now

    @property
    def settles_at(self) -> float:
        """When the arrivals count as settled if no other comes (the loop plans again then)."""
        return self.last_admit + self.settle_s

    def waiting(self, now: float, calls: list[Call], planned: Iterable[tuple[str, int]]) -> set[str]:
        """Executors whose step, planned now, would wait instead: each runs a
        prefill (its latest call in ``calls``), arrivals have not settled, and
        its part of ``planned`` ((executor id, tokens) per sequence) fills
        neither its token budget nor its sequences."""
        if now >= self.settles_at:
            return set()
        behind = {call.ex.executor_id for call in latest(calls) if computes_prompt(call)}
        if not behind:
            return set()
        tokens: Counter[str] = Counter()
        rows: Counter[str] = Counter()
        for executor_id, k in planned:
            tokens[executor_id] += k
            rows[executor_id] += 1
        return {eid for eid in behind
                if tokens[eid] and tokens[eid] < self.max_batch_tokens and rows[eid] < self.max_running}

    def schedule(self, scheduler: Scheduler, seqs, idle: list[str], max_model_len: int, hold, calls: list[Call],
                 now: float) -> Batch:
        """``scheduler``'s batch for the ``idle`` executors less those whose
        step waits (``waiting``; ``calls``: the Executes that steps would be
        planned behind, none without plan-ahead); ``replan_at`` says when
        to plan again."""
        batch = scheduler.schedule(seqs, idle, max_model_len if idle else 0, hold)
        held = self.waiting(now, calls, zip((s.executor_id for s in batch.seqs), batch.num_tokens)) if calls else ()
        self.replan_at = self.settles_at if held else 0.0
        if not held:
            return batch
        metrics.STEPS_HELD_FOR_ARRIVALS.inc(len(held))
        idle = [eid for eid in idle if eid not in held]
        return scheduler.schedule(seqs, idle, max_model_len if idle else 0, hold)

    def wake_at(self, plan_at: float) -> float:
        """The earlier of ``plan_at`` (0.0: none) and ``replan_at``: when the loop plans next."""
        return min((t for t in (plan_at, self.replan_at) if t), default=0.0)
