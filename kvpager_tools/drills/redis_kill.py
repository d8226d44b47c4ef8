"""redis-kill: kill and restart Redis under load.

Workers keep streaming greedy requests while Redis is SIGKILLed, left down
for ``down_s`` and started again (empty, on the same port). Serving must
never fail (the memory service's own state is authoritative; Redis is a
mirror), every output must equal its undisturbed reference, the snapshot
must show the mirror stale while Redis is gone (``mirror_stale``) and in
sync again after the restart (the mirror resyncs fully into the empty Redis).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from kvpager_tools.drills.common import DrillEnv, DrillResult, greedy_request, random_prompt
from kvpager_tools.drills.runner import Needs

NEEDS = Needs(executors=1, redis=True)
ALLOWED: frozenset[str] = frozenset()  # serving never fails


@dataclasses.dataclass
class Options:
    workers: int = dataclasses.field(default=8, metadata={"help": "concurrent request loops"})
    max_tokens: int = 24
    distinct_prompts: int = 12
    down_s: float = dataclasses.field(default=3.0, metadata={"help": "how long Redis stays dead"})
    stale_within_s: float = dataclasses.field(default=10.0, metadata={"help": "mirror_stale must show by then"})
    resync_within_s: float = dataclasses.field(default=30.0, metadata={"help": "in sync again by then"})


async def wait_mirror(env: DrillEnv, *, stale: bool, timeout_s: float) -> float | None:
    """Seconds until the snapshot's mirror_stale equals ``stale`` (and, for
    in sync, no lag); None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        snap = await env.clients.accounting()
        if snap.mirror_stale == stale and (stale or snap.mirror_lag_events == 0):
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return None


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("redis-kill")
    c = env.clients
    if env.redis is None:
        result.violation("redis-kill needs a stack with the Redis mirror")
        return result
    rng = env.rng
    info = await c.model_info()
    prompts = [random_prompt(rng, info.vocab_size, rng.randint(16, 48)) for _ in range(opts.distinct_prompts)]
    for p in prompts:
        await env.reference(p, opts.max_tokens)
    snap = await c.accounting()
    if not snap.mirror_enabled:
        result.violation("the memory service reports the mirror off")
        return result
    if await wait_mirror(env, stale=False, timeout_s=opts.resync_within_s) is None:
        result.violation("mirror not in sync before the drill")
    keys_before = env.redis.dbsize()

    stop = asyncio.Event()

    async def worker(w: int) -> None:
        i = w
        while not stop.is_set():
            p = prompts[i % len(prompts)]
            i += opts.workers
            out = await c.generate(greedy_request(p, opts.max_tokens))
            result.record(out.status)
            env.check_output(result, p, opts.max_tokens, out)

    workers = [asyncio.ensure_future(worker(w)) for w in range(opts.workers)]
    try:
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        env.redis.kill()
        stale_s = await wait_mirror(env, stale=True, timeout_s=opts.stale_within_s)
        if stale_s is None:
            result.violation(f"mirror_stale not set {opts.stale_within_s:g}s after Redis died")
        await asyncio.sleep(max(0.0, opts.down_s - (time.monotonic() - t_kill)))
        served_while_down = result.completions
        await asyncio.to_thread(env.redis.start)
        resync_s = await wait_mirror(env, stale=False, timeout_s=opts.resync_within_s)
        if resync_s is None:
            result.violation(f"mirror still stale {opts.resync_within_s:g}s after Redis came back")
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    keys_after = env.redis.dbsize()
    if keys_before and not keys_after:
        result.violation("Redis is empty after the resync")
    result.forbid(ALLOWED, "requests")
    result.figures.update({
        "stale_after_kill_s": round(stale_s, 3) if stale_s is not None else None,
        "resync_after_restart_s": round(resync_s, 3) if resync_s is not None else None,
        "completions_before_restart": served_while_down,
        "redis_keys_before": keys_before, "redis_keys_after_resync": keys_after,
    })
    return result
