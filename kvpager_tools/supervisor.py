"""`kvpager up`'s supervisor: a child that exits unexpectedly is started
again after a backoff; the stack itself only stops when told to (then it
drains, ``Stack.stop``).

Mechanism and policy apart: ``Backoff`` decides how long a child waits
before its next start (doubling from ``initial_s`` up to ``max_s``, back to
``initial_s`` once a start has stayed up ``stable_s``); ``Supervisor`` polls
the children, counts each restart (log line and the Prometheus counter
``kvpager_supervisor_restarts_total{child}``) and respawns them with their
original command line. A restarted child is not waited for: the services
wait for each other themselves (executors re-register with a restarted
memory service, the gateway learns executors from its registry).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, ProcessCollector

from kvpager_tools.stack import Stack


@dataclasses.dataclass(frozen=True, slots=True)
class Backoff:
    """How long a child that exited waits before its next start."""

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0   # a start that lasted this long resets the delay to initial_s

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("--restart-backoff-s must be > 0 and <= --restart-backoff-max-s")

    def delay_s(self, previous_delay_s: float | None, uptime_s: float) -> float:
        """The wait before the next start, given the last one (None: none yet)
        and how long the child just ended had run."""
        if previous_delay_s is None or uptime_s >= self.stable_s:
            return self.initial_s
        return min(previous_delay_s * 2, self.max_s)


@dataclasses.dataclass(slots=True)
class _ChildState:
    started_at: float                  # time.monotonic() of its current (or last) start
    delay_s: float | None = None       # the wait before its last restart
    restart_at: float | None = None    # when it starts again (None: running)
    num_restarts: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RestartEvent:
    child: str
    exit_code: int
    delay_s: float
    num_restarts: int                  # this child's restarts, this one included


class SupervisorMetrics:
    """The supervisor's Prometheus families, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # `kvpager up`'s own process (docs/metrics.md)
        self.restarts = Counter("kvpager_supervisor_restarts", "children restarted after an unexpected exit",
                                ["child"], registry=self.registry)
        self.up = Gauge("kvpager_supervisor_child_up", "1 while the child process runs", ["child"],
                        registry=self.registry)


class Supervisor:
    """Keeps a started ``Stack``'s children running; call ``tick`` often.

    Args:
        stack: started (``Stack.start`` returned).
        backoff: the restart delays.
        on_exit: told of each unexpected exit and the restart it schedules.
        on_restart: told once a child has been started again.
    """

    def __init__(self, stack: Stack, backoff: Backoff = Backoff(), *,
                 on_exit: Callable[[RestartEvent], None] = lambda event: None,
                 on_restart: Callable[[str], None] = lambda name: None,
                 metrics: SupervisorMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stack = stack
        self.backoff = backoff
        self.on_exit, self.on_restart = on_exit, on_restart
        self.metrics = metrics or SupervisorMetrics()
        self.clock = clock
        now = clock()
        self.children = {c.name: _ChildState(started_at=now) for c in stack.children}
        for name in self.children:
            self.metrics.restarts.labels(name)  # every child's series exists from the start, at 0
            self.metrics.up.labels(name).set(1)

    def num_restarts(self, name: str) -> int:
        return self.children[name].num_restarts

    def tick(self) -> None:
        """Notices exits and schedules their restarts; starts the children whose wait is over."""
        now = self.clock()
        for name, state in self.children.items():
            proc = self.stack.procs[name]
            if state.restart_at is None:
                code = proc.poll()
                if code is None:
                    continue
                state.delay_s = self.backoff.delay_s(state.delay_s, now - state.started_at)
                state.restart_at = now + state.delay_s
                state.num_restarts += 1
                self.metrics.up.labels(name).set(0)
                self.on_exit(RestartEvent(name, code, state.delay_s, state.num_restarts))
            elif now >= state.restart_at:
                self.stack.restart(name, wait_ready=False)
                state.restart_at, state.started_at = None, now
                self.metrics.restarts.labels(name).inc()
                self.metrics.up.labels(name).set(1)
                self.on_restart(name)

    def run(self, interval_s: float = 0.2) -> None:
        """Ticks until interrupted (KeyboardInterrupt: Ctrl-C, or SIGTERM mapped to it)."""
        while True:
            self.tick()
            time.sleep(interval_s)
