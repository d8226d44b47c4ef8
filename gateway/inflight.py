"""The Executes in flight, oldest first (at most two per executor: one
planned ahead), when each began to run on its executor, and when the step
after each executor's latest may be planned (``gateway.bursts.next_plan_at``:
at once after a one-token step, near its end after a burst)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway import wire
from gateway.bursts import NEVER, DecodeClock, next_plan_at
from gateway.clients import ExecutorClient


@dataclass(slots=True)
class Call:
    """An Execute call on its way: an executor with one is busy."""

    ex: ExecutorClient
    task: asyncio.Task
    rows: list[wire.Row]
    sent: float        # perf_counter when sent
    step_start: float  # perf_counter when its step began
    step_id: int = 0
    parts: list = field(default_factory=list)  # a streamed burst's sub-steps come, not taken yet
    # perf_counter when its executor began it, as the gateway knows it: when sent to an idle
    # executor, else when the step before it came back (None until then: it is queued).
    started: float | None = None

    def ran_for(self, now: float) -> float | None:
        """Seconds from its start to ``now`` (None: its start is not known)."""
        return None if self.started is None else now - self.started


def latest(calls: list[Call]) -> list[Call]:
    """Each executor's latest call."""
    return list({call.ex.executor_id: call for call in calls}.values())


def plan_at(call: Call, clock: DecodeClock, lead_s: float) -> float:
    return next_plan_at(call.started, call.rows, clock.per_sub_step(call.ex.executor_id), lead_s)


def take_returned(calls: list[Call], now: float) -> tuple[list[Call], list[Call]]:
    """(the calls that came back, the rest), both in order: an executor's
    results are applied in step order, so one that came back behind a call
    of its executor still running stays. The call queued behind one that came
    back (planned ahead) runs on its executor from ``now``."""
    done, pending, returned, running = [], [], set(), set()
    for call in calls:
        eid = call.ex.executor_id
        if call.task.done() and eid not in running:
            done.append(call)
            returned.add(eid)
            continue
        if eid in returned and eid not in running and call.started is None:
            call.started = now
        pending.append(call)
        running.add(eid)
    return done, pending


def bursts_running(calls: list[Call], now: float, clock: DecodeClock, lead_s: float) -> set[str]:
    """Executors whose latest call is a decode burst not near its end: their
    sequences are not fed ahead yet (``Scheduler.schedule``'s ``hold``)."""
    return {call.ex.executor_id for call in latest(calls) if now < plan_at(call, clock, lead_s)}


def next_burst_plan(calls: list[Call], now: float, clock: DecodeClock, lead_s: float) -> float:
    """The earliest time after ``now`` a burst's next step is due to be planned (0.0: none)."""
    return min((t for t in (plan_at(c, clock, lead_s) for c in latest(calls)) if now < t < NEVER), default=0.0)


def carry_into(calls: list[Call], ex: ExecutorClient, rows: list[wire.Row]) -> bool:
    """A burst of ``ex`` came back cut short, its next sub-step carried into
    the step that cut it (executor_service.carry): that step's call, the first
    of ``ex`` among ``calls`` (those back after the burst, then those in
    flight), gets ``rows``, whose samples come back after its own. False:
    there is none (the carried samples would never come)."""
    behind = next((c for c in calls if c.ex is ex), None)
    if behind is None:
        return False
    behind.rows.extend(rows)
    return True
