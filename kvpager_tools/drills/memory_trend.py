"""Each service's resident memory over a long drill, and whether it climbs.

A leak under a steady mix of work shows as resident memory that keeps rising
after the first episodes (the last sitting's oneDNN primitives grew one
process from 0.6 to 4.5 GB). ``MemoryTrend.sample`` reads every live child's
RSS from /proc after each episode; a series belongs to one process (pid), so
a restarted service starts a new series and its fresh start is not a drop
or a climb.

The verdict compares the early and the late part of a series: ``baseline``
is the highest of its first third (caches, the prefix index and the
allocator's arenas fill during the first episodes), ``end`` the lowest of
its last third (a transient peak at the end is not a leak; memory a leak
holds never comes back). ``growth = end - baseline``; a series of fewer than
``MIN_SAMPLES`` samples gets no verdict.
"""

from __future__ import annotations

import dataclasses
import time

from kvpager_tools.drills.common import rss_bytes

MIN_SAMPLES = 4
MIN_SLOPE_SPAN_S = 60.0  # a slope over a shorter window extrapolates noise to an hour
MIB = 2**20


@dataclasses.dataclass
class Series:
    """One process's RSS samples (bytes), at monotonic times."""

    pid: int
    times: list[float] = dataclasses.field(default_factory=list)
    rss: list[int] = dataclasses.field(default_factory=list)

    def growth_bytes(self) -> int | None:
        """``end - baseline`` (module docstring); None below MIN_SAMPLES."""
        n = len(self.rss)
        if n < MIN_SAMPLES:
            return None
        third = max(1, n // 3)
        return min(self.rss[-third:]) - max(self.rss[:third])

    def mib_per_hour(self) -> float | None:
        """The least-squares slope of the samples after the first third, in
        MiB an hour; None over less than MIN_SLOPE_SPAN_S."""
        third = max(1, len(self.rss) // 3)
        t, y = self.times[third:], self.rss[third:]
        if len(t) < 2 or t[-1] - t[0] < MIN_SLOPE_SPAN_S:
            return None
        mt, my = sum(t) / len(t), sum(y) / len(y)
        var = sum((a - mt) ** 2 for a in t)
        return sum((a - mt) * (b - my) for a, b in zip(t, y)) / var * 3600 / MIB

    def summary(self) -> dict:
        growth = self.growth_bytes()
        slope = self.mib_per_hour()
        return {"pid": self.pid, "samples": len(self.rss), "start_mib": round(self.rss[0] / MIB, 1),
                "end_mib": round(self.rss[-1] / MIB, 1), "peak_mib": round(max(self.rss) / MIB, 1),
                "growth_mib": None if growth is None else round(growth / MIB, 1),
                "mib_per_hour": None if slope is None else round(slope, 1)}


class MemoryTrend:
    """RSS series of a stack's children (``stack.procs``: name -> Popen)."""

    def __init__(self, stack) -> None:
        self.stack = stack
        self.series: dict[str, list[Series]] = {}  # child name -> its processes' series, oldest first

    def sample(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for name, proc in self.stack.procs.items():
            if proc.poll() is not None:
                continue
            rss, _ = rss_bytes(proc.pid)
            if rss:
                self.add(name, proc.pid, rss, now)

    def add(self, name: str, pid: int, rss: int, now: float) -> None:
        runs = self.series.setdefault(name, [])
        if not runs or runs[-1].pid != pid:
            runs.append(Series(pid))
        runs[-1].times.append(now)
        runs[-1].rss.append(rss)

    def check(self, max_growth_mib: float) -> tuple[dict, list[str]]:
        """(figures per child: its latest process's summary and how many
        processes it had; violations: every series that grew by more than
        ``max_growth_mib``)."""
        figures, violations = {}, []
        for name, runs in sorted(self.series.items()):
            for run in runs:
                growth = run.growth_bytes()
                if growth is not None and growth > max_growth_mib * MIB:
                    violations.append(
                        f"{name} (pid {run.pid}) resident memory grew {growth / MIB:.0f} MiB over {len(run.rss)} "
                        f"samples ({max(run.rss[:max(1, len(run.rss) // 3)]) / MIB:.0f} -> "
                        f"{run.rss[-1] / MIB:.0f} MiB), more than {max_growth_mib:g}")
            figures[name] = {**runs[-1].summary(), "processes": len(runs)}
        return figures, violations
