"""soak: a random mix of all the drills, small, on one stack for --duration-s.

Episodes are drawn at random (seeded) from load, cancel, bad-input, fuzz,
executor-kill, redis-kill and memory-restart (the last two only when the
stack has the Redis mirror), each in a small version, one after the other on
the same stack; after every episode the common check runs (blocks back,
identities, health). The summary adds up every episode and lists them.

Each service's resident memory is sampled before the first episode and after
every one (``memory_trend``): the summary gives each one's start, end, peak,
growth and slope, and a service whose memory climbed by more than
``--max-rss-growth-mib`` after the first third of the run is a violation.
"""

from __future__ import annotations

import dataclasses
import time

from kvpager_tools.drills.common import DrillEnv, DrillResult
from kvpager_tools.drills.memory_trend import MemoryTrend
from kvpager_tools.drills.runner import Needs, load

NEEDS = Needs(executors=2, redis=True)

# (drill, small options) — sized for a 2-core CPU machine: seconds each.
EPISODES = (
    ("load", {"streams": 150, "max_tokens": 24, "compare_outputs": 8}),
    ("cancel", {"streams": 80, "mass_abort_streams": 16}),
    ("bad-input", {"payloads_per_method": 4}),
    ("fuzz", {"budget_s": 15.0}),
    ("executor-kill", {"streams": 8, "max_tokens": 96, "after_requests": 4}),
    ("redis-kill", {"workers": 4, "down_s": 2.0}),
    ("memory-restart", {"streams": 6, "max_tokens": 64, "unconfirmed_round": False}),
)


@dataclasses.dataclass
class Options:
    duration_s: float = dataclasses.field(default=600.0, metadata={"help": "keep starting episodes until then"})
    episodes: str = dataclasses.field(default="", metadata={
        "help": "comma-separated subset of drills to draw from (default: all that the stack allows)"})
    max_rss_growth_mib: float = dataclasses.field(default=256.0, metadata={
        "help": "a service whose resident memory, after the first third of the run, ends more than this above "
                "its early peak fails the soak (a leak)"})


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("soak")
    wanted = {e.strip() for e in opts.episodes.split(",") if e.strip()}
    pool = [(name, o) for name, o in EPISODES
            if (not wanted or name in wanted)
            and (env.redis is not None or not load(name).NEEDS.redis)
            and len(env.executor_names) >= load(name).NEEDS.executors]
    if not pool:
        result.violation("no episode fits this stack")
        return result
    rng = env.rng
    t_end = time.monotonic() + opts.duration_s
    log = []
    trend = MemoryTrend(env.stack)
    trend.sample()
    while time.monotonic() < t_end:
        name, overrides = rng.choice(pool)
        module = load(name)
        t0 = time.monotonic()
        episode = await module.run(env, dataclasses.replace(module.Options(), **overrides))
        await env.finish(episode)
        episode.duration_s = time.monotonic() - t0
        trend.sample()
        result.merge(episode)
        for key in ("outputs_compared", "outputs_not_compared"):  # bf16/fp16: not compared (common.py)
            if key in episode.figures:
                result.add(key, episode.figures[key])
        log.append({"drill": name, "ok": episode.ok, "requests": episode.requests,
                    "duration_s": round(episode.duration_s, 1)})
    counts: dict[str, int] = {}
    for e in log:
        counts[e["drill"]] = counts.get(e["drill"], 0) + 1
    memory, leaks = trend.check(opts.max_rss_growth_mib)
    for v in leaks:
        result.violation(f"memory: {v}")
    result.figures.update({"episodes": len(log), "by_drill": counts, "memory": memory,
                           "failed_episodes": [e for e in log if not e["ok"]], "log": log})
    return result
