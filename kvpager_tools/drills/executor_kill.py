"""executor-kill: SIGKILL an executor mid-stream, then restart it.

Greedy and seeded-sampling streams spread over every executor; once each has
produced tokens, the last executor is killed. With a survivor (two executors,
the default) the killed executor's streams move to it (recompute) and
every stream completes with exactly its undisturbed tokens; with one
executor its streams end UNAVAILABLE within ``unavailable_within_s``. The
memory service drops the dead executor and every block it held; new requests
go to the survivors. Then the executor is started again (a new process: a new
incarnation), must rejoin (the gateway routes to it again) and serve correct
outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

from kvpager_tools.drills import survival
from kvpager_tools.drills.common import DrillEnv, DrillResult, greedy_request, random_prompt
from kvpager_tools.drills.runner import Needs
from kvpager_tools.stack import wait_routed
from kvpager.v1 import memory_pb2

NEEDS = Needs(executors=2)
ALLOWED = frozenset({"UNAVAILABLE"})  # with one executor only: its streams have nowhere to go


@dataclasses.dataclass
class Options:
    streams: int = dataclasses.field(default=16, metadata={"help": "streams running when the executor dies"})
    max_tokens: int = dataclasses.field(default=160, metadata={"help": "long enough to be mid-stream at the kill"})
    unavailable_within_s: float = 10.0
    after_requests: int = dataclasses.field(default=8, metadata={"help": "requests after the kill and after rejoin"})
    restart: bool = dataclasses.field(default=True, metadata={"help": "start the executor again and check it rejoins"})
    survivor: bool = dataclasses.field(default=True, metadata={
        "help": "at least 2 executors (the killed one's streams move to a survivor); --no-survivor: the stack's "
                "own count, 1 by default (they end UNAVAILABLE)"})


def needs(opts: Options) -> Needs:
    return Needs(executors=2 if opts.survivor else 1)


async def _executors(env: DrillEnv) -> dict[str, memory_pb2.ExecutorPoolInfo]:
    listed = await env.clients.memory.ListExecutors(memory_pb2.ListExecutorsRequest(), timeout=5)
    return {e.executor_id: e for e in listed.executors}


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("executor-kill")
    c = env.clients
    rng = env.rng
    names = env.executor_names
    survivors = len(names) > 1
    victim = names[-1]
    info = await c.model_info()
    before = await _executors(env)
    prompts = [random_prompt(rng, info.vocab_size, rng.randint(8, 32)) for _ in range(opts.streams)]
    after = [random_prompt(rng, info.vocab_size, rng.randint(8, 32)) for _ in range(opts.after_requests)]
    short = 16
    for p in after:
        await env.reference(p, short)
    requests = survival.mixed_requests(prompts, opts.max_tokens, env.seed)
    refs = await survival.references(c, requests)

    tasks, num_started = await survival.start(c, requests)
    if num_started < len(prompts):
        result.violation(f"only {num_started} of {len(prompts)} streams started before the kill")
    load = {p.executor_id: p.num_sequences for p in (await c.accounting()).executors}
    t_kill = time.perf_counter()
    env.stack.kill(victim, signal.SIGKILL)
    outs = await asyncio.gather(*tasks)
    streams = survival.tally(result, outs, refs, num_started, t_kill, expect_ok=survivors,
                             exact=env.exact)
    worst = max((o.ended_s - t_kill for o in outs if o.status != "OK"), default=0.0)
    if worst > opts.unavailable_within_s:
        result.violation(f"a stream of the killed executor ended {worst:.1f}s after the kill "
                         f"(limit {opts.unavailable_within_s:g}s)")
    num_unavailable = sum(o.status == "UNAVAILABLE" for o in outs)
    if not survivors and load.get(victim, 0) and not num_unavailable:
        result.violation("the only executor held sequences but no stream ended UNAVAILABLE")

    # The memory service forgot the victim and everything it held.
    deadline = time.monotonic() + opts.unavailable_within_s
    while victim in await _executors(env):
        if time.monotonic() > deadline:
            result.violation(f"{victim} still registered {opts.unavailable_within_s:g}s after the kill")
            break
        await asyncio.sleep(0.05)
    gone_s = time.monotonic() - t_kill

    # New requests go to the survivors (with none: wait for the restart below).
    outs = [] if not survivors else await asyncio.gather(*(c.generate(greedy_request(p, short)) for p in after))
    for p, out in zip(after, outs):
        result.record(out.status)
        env.check_output(result, p, short, out)
    if any(o.status != "OK" for o in outs):
        result.violation("requests after the kill failed: "
                         + ", ".join(sorted({o.status for o in outs if o.status != 'OK'})))

    figures = {"executors": len(names), "victim": victim, "victim_sequences_at_kill": load.get(victim, 0),
               "streams": streams, "streams_unavailable": num_unavailable,
               "last_unavailable_after_kill_s": round(worst, 3), "deregistered_after_s": round(gone_s, 3)}
    if opts.restart:
        t0 = time.monotonic()
        await env.stack.arestart(victim)
        await wait_routed(c.addresses.gateway, len(names), tls=c.tls, token=c.auth_token, timeout_s=60)
        figures["rejoin_s"] = round(time.monotonic() - t0, 3)
        now = await _executors(env)
        if victim not in now:
            result.violation(f"{victim} did not register again")
        elif now[victim].incarnation == before[victim].incarnation:
            result.violation(f"{victim} came back with its old incarnation")
        # Enough concurrent requests that the router sends some to the newcomer.
        reqs = after * 2
        outs = await asyncio.gather(*(c.generate(greedy_request(p, short)) for p in reqs))
        for p, out in zip(reqs, outs):
            result.record(out.status)
            env.check_output(result, p, short, out)
        served = {p.executor_id: p.prefix_query_tokens for p in (await c.accounting()).executors}
        figures["rejoined_served_prompt_tokens"] = served.get(victim, 0)
        if not served.get(victim):
            result.violation(f"{victim} rejoined but was routed no request")
    result.forbid(ALLOWED if not survivors else frozenset(), "streams")
    result.figures.update(figures)
    return result
