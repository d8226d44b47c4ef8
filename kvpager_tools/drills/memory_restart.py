"""memory-restart: restart the memory service under load, with or without the Redis mirror.

Prompts sharing a block-aligned prefix warm the cache; greedy and seeded
sampling streams run; the memory service is stopped (SIGTERM by default;
SIGKILL with ``--kill-signal KILL``) and started again. Every in-flight
stream must complete (the gateway admits its sequences again: a pause, not
an error) with exactly the tokens of its undisturbed run. With the mirror
(the default; ``--no-mirror``: a cold restart) the restarted service must
rebuild the confirmed cached prefixes from it: a probe whose prefix no stream
shares (the re-admitted streams recompute theirs) is a prefix hit after the
restart; after a cold one it must be a miss. After a
SIGKILL under load the executor has usually applied a step whose events never
reached Redis; the step fence (docs/mirror.md) then leaves out the blocks
those steps wrote and rebuilds the rest, so a crash must rebuild too
(``fenced`` is true when the probe found nothing rebuilt).

With ``--unconfirmed-round`` the drill then kills the memory service *and*
an executor, starts the memory service while that executor is down (its
pool cannot be confirmed) and the executor after it (a new incarnation):
nothing of the old pool may be restored or served, so the same request is a
prefix miss and still gives its reference output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

from kvpager_tools.drills import survival
from kvpager_tools.drills.common import DrillEnv, DrillResult, greedy_request, random_prompt
from kvpager_tools.drills.redis_kill import wait_mirror
from kvpager_tools.drills.runner import Needs
from kvpager_tools.stack import wait_routed

NEEDS = Needs(executors=1, redis=True)
# Only requests sent while the gateway routes to no executor (the probes after the restart) may be refused.
ALLOWED = frozenset({"UNAVAILABLE"})


@dataclasses.dataclass
class Options:
    streams: int = dataclasses.field(default=12, metadata={"help": "streams in flight at the kill"})
    max_tokens: int = 96
    prefix_blocks: int = dataclasses.field(default=4, metadata={"help": "full blocks of the shared prefix"})
    kill_signal: str = dataclasses.field(default="TERM", metadata={
        "help": "TERM (a restart: the mirror is flushed) or KILL (a crash: the mirror may lag the executor by "
                "a few steps, whose blocks the step fence leaves out); either way recovery must rebuild"})
    end_within_s: float = dataclasses.field(default=30.0, metadata={
        "help": "in-flight streams complete by then after the kill"})
    mirror: bool = dataclasses.field(default=True, metadata={
        "help": "the memory service mirrors to Redis (recovery rebuilds the prefix cache); off: a cold restart"})
    unconfirmed_round: bool = dataclasses.field(default=True, metadata={
        "help": "also restart with an executor whose pool cannot be confirmed (with the mirror)"})


def needs(opts: Options) -> Needs:
    return Needs(executors=1, redis=opts.mirror)


async def _first_ok(env: DrillEnv, result: DrillResult, request, timeout_s: float = 10.0):
    """Retries ``request`` while the gateway reconnects to the restarted
    service (UNAVAILABLE meanwhile); (last outcome, seconds until OK)."""
    t0 = time.monotonic()
    while True:
        out = await env.clients.generate(request)
        result.record(out.status)
        if out.status == "OK" or out.status != "UNAVAILABLE" or time.monotonic() - t0 > timeout_s:
            return out, round(time.monotonic() - t0, 3)
        await asyncio.sleep(0.05)


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("memory-restart")
    c = env.clients
    if opts.mirror and env.redis is None:
        result.violation("memory-restart with the mirror needs a stack with Redis")
        return result
    rng = env.rng
    info = await c.model_info()
    bs = info.block_size or 16
    prefix = random_prompt(rng, info.vocab_size, opts.prefix_blocks * bs)
    # The probe's prefix is its own: the streams re-admitted after the restart
    # recompute theirs, so only the mirror can make the probe's a hit.
    probe = random_prompt(rng, info.vocab_size, opts.prefix_blocks * bs + 5)
    prompts = [[*prefix, *random_prompt(rng, info.vocab_size, rng.randint(3, 12))] for _ in range(opts.streams)]
    short = 16
    await env.reference(probe, short)  # computes and caches the probe's prefix blocks
    for p in prompts:
        await env.reference(p, opts.max_tokens)
    requests = survival.mixed_requests(prompts, opts.max_tokens, env.seed)
    refs = await survival.references(c, requests)
    # The probe's blocks the most recently freed again: the streams' blocks are evicted before them.
    result.record((await c.generate(greedy_request(probe, short))).status)
    if opts.mirror:
        if not (await c.accounting()).mirror_enabled:
            result.violation("the memory service reports the mirror off")
            return result
        if await wait_mirror(env, stale=False, timeout_s=30) is None:
            result.violation("mirror not in sync before the restart")
    figures: dict = {"mirror": opts.mirror, "kill_signal": opts.kill_signal}

    # Round 1: kill the memory service under load, restart it (recovering from the mirror, or cold).
    tasks, num_started = await survival.start(c, requests)
    sig = getattr(signal, f"SIG{opts.kill_signal.upper().removeprefix('SIG')}")
    t_kill = time.perf_counter()
    env.stack.kill("memory", sig)
    restart = asyncio.ensure_future(env.stack.arestart("memory"))
    restart.add_done_callback(lambda _: figures.setdefault("restart_to_serving_s",
                                                           round(time.perf_counter() - t_kill, 3)))
    outs = await asyncio.gather(*tasks)
    figures["streams"] = survival.tally(result, outs, refs, num_started, t_kill, exact=env.exact)
    last = max((o.ended_s - t_kill for o in outs), default=0.0)
    figures["streams"]["last_end_after_kill_s"] = round(last, 3)
    if last > opts.end_within_s:
        result.violation(f"an in-flight stream ended {last:.1f}s after the kill (limit {opts.end_within_s:g}s)")
    await restart
    await wait_routed(c.addresses.gateway, len(env.executor_names), tls=c.tls, token=c.auth_token, timeout_s=60)
    snap = await c.accounting()
    # Cached now: rebuilt from the mirror, plus what the re-admitted streams computed and freed.
    figures["cached_blocks_after_restart"] = snap.total.cached_blocks
    out, figures["serving_again_after_restart_s"] = await _first_ok(env, result, greedy_request(probe, short))
    env.check_output(result, probe, short, out)
    figures["prefix_hit_after_restart_tokens"] = out.cached_prompt_tokens
    figures["fenced"] = opts.mirror and out.cached_prompt_tokens == 0
    if out.status != "OK":
        result.violation(f"the first request after the restart failed: {out.status}: {out.details}")
    elif opts.mirror and out.cached_prompt_tokens < (opts.prefix_blocks - 1) * bs:
        result.violation(f"the probe's prefix was not served from the cache rebuilt from the mirror "
                         f"({out.cached_prompt_tokens} cached prompt tokens)")
    elif not opts.mirror and out.cached_prompt_tokens:
        result.violation(f"{out.cached_prompt_tokens} prompt tokens hit after a cold restart: served from "
                         "an index nobody rebuilt")
    # More traffic on the recovered cache: every output still right.
    outs = await asyncio.gather(*(c.generate(greedy_request(p, opts.max_tokens)) for p in prompts))
    for p, o in zip(prompts, outs):
        result.record(o.status)
        env.check_output(result, p, opts.max_tokens, o)

    if opts.unconfirmed_round and opts.mirror:
        await env.wait_baseline(10)
        await wait_mirror(env, stale=False, timeout_s=30)
        executor = env.executor_names[0]
        env.stack.kill("memory", sig)
        env.stack.kill(executor, signal.SIGKILL)
        await env.stack.arestart("memory")      # the executor's pool cannot be confirmed now
        restored = (await c.accounting()).total.cached_blocks
        await env.stack.arestart(executor)      # a new incarnation, an empty pool
        await wait_routed(c.addresses.gateway, len(env.executor_names), tls=c.tls, token=c.auth_token, timeout_s=60)
        snap = await c.accounting()
        figures["unconfirmed_round"] = {"cached_blocks_after_restart": restored,
                                        "cached_blocks_after_executor_rejoined": snap.total.cached_blocks}
        if restored and len(env.executor_names) == 1:
            result.violation(f"{restored} cached blocks restored for an executor that could not confirm its pool")
        out, _ = await _first_ok(env, result, greedy_request(probe, short))
        env.check_output(result, probe, short, out)
        figures["unconfirmed_round"]["prefix_hit_tokens"] = out.cached_prompt_tokens
        if out.status != "OK":
            result.violation(f"the first request after the second restart failed: {out.status}: {out.details}")
        if out.cached_prompt_tokens and len(env.executor_names) == 1:
            result.violation(f"{out.cached_prompt_tokens} prompt tokens served from an unconfirmed pool")
    result.forbid(ALLOWED, "streams")
    result.figures.update(figures)
    return result
