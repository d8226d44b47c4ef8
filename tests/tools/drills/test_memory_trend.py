"""The soak's memory verdict (kvpager_tools.drills.memory_trend): a climb is a
leak, a restart starts a new series, a transient peak or a warm-up is not, and
the samples are real RSS of real processes."""

from __future__ import annotations

import subprocess
import sys

from kvpager_tools.drills.memory_trend import MIB, MemoryTrend, Series


def trend(name_pid_mib: list[tuple[str, int, float]]) -> MemoryTrend:
    t = MemoryTrend(stack=None)
    for i, (name, pid, mib) in enumerate(name_pid_mib):
        t.add(name, pid, int(mib * MIB), now=float(i * 60))
    return t


def test_a_steady_climb_is_a_leak_and_names_the_service():
    t = trend([("executor-0", 7, 600 + 100 * i) for i in range(9)])  # 100 MiB an episode
    figures, violations = t.check(max_growth_mib=256)
    assert len(violations) == 1 and violations[0].startswith("executor-0 (pid 7) resident memory grew")
    f = figures["executor-0"]
    assert f["growth_mib"] == 1200 - 800 and f["start_mib"] == 600 and f["end_mib"] == 1400
    assert f["peak_mib"] == 1400 and f["processes"] == 1 and f["samples"] == 9
    assert abs(f["mib_per_hour"] - 6000) < 1e-6  # 100 MiB a minute


def test_a_warm_up_then_flat_and_a_passing_peak_are_not_leaks():
    warm = [300, 900, 950] + [940, 945, 2000, 950, 948, 944]  # fills early, one spike mid-run
    t = trend([("gateway", 5, m) for m in warm])
    figures, violations = t.check(max_growth_mib=256)
    assert violations == [] and figures["gateway"]["growth_mib"] <= 0
    assert figures["gateway"]["peak_mib"] == 2000


def test_the_bound_is_the_option():
    t = trend([("memory", 3, 100 + 10 * i) for i in range(9)])  # the last third's low 160, the first third's peak 120: +40 MiB
    assert t.check(max_growth_mib=256)[1] == []
    assert len(t.check(max_growth_mib=30)[1]) == 1


def test_a_restarted_service_starts_a_new_series():
    # the old process climbed but was killed early (3 samples: no verdict); the new one is flat
    t = trend([("executor-1", 10, 500), ("executor-1", 10, 900), ("executor-1", 10, 1300)]
              + [("executor-1", 11, 400)] * 6)
    figures, violations = t.check(max_growth_mib=256)
    assert violations == []
    assert figures["executor-1"]["processes"] == 2 and figures["executor-1"]["pid"] == 11
    assert [len(s.rss) for s in t.series["executor-1"]] == [3, 6]
    assert Series(1, [0.0] * 3, [1, 2, 3]).growth_bytes() is None
    assert Series(1, [0.0, 10.0, 20.0, 30.0], [1, 2, 3, 4]).mib_per_hour() is None  # 20 s after the first third


class _Stack:
    def __init__(self, procs):
        self.procs = procs


def test_samples_are_the_real_resident_memory_of_live_children():
    grow = ("import time, sys\nhold = []\nsys.stdout.write('ready\\n'); sys.stdout.flush()\n"
            "for line in sys.stdin:\n    hold.append(bytearray(64 * 2**20))\n"
            "    sys.stdout.write('ok\\n'); sys.stdout.flush()\n")
    proc = subprocess.Popen([sys.executable, "-c", grow], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    try:
        assert proc.stdout.readline() == "ready\n"
        t = MemoryTrend(_Stack({"leaky": proc, "gone": done}))
        for _ in range(6):
            t.sample()
            proc.stdin.write("more\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "ok\n"
        figures, violations = t.check(max_growth_mib=100)
    finally:
        proc.kill()
        proc.wait()
    assert set(figures) == {"leaky"}  # an exited child is not sampled
    # 64 MiB touched per sample: early peak (sample 1 of 6 after 1 allocation) vs the end's low (after 4)
    assert 150 < figures["leaky"]["growth_mib"] < 250, figures
    assert len(violations) == 1 and "leaky" in violations[0]
