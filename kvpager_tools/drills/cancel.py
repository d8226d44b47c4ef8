"""cancel: many streams cancelled, aborted or timed out at random points.

Each stream picks one fate: the client cancels it after a random number of
tokens, an ``Abort`` RPC ends it, its deadline passes, or it completes. Some
use n > 1 (forked sequences). Every token any stream received must be a
prefix of that prompt's undisturbed greedy output, and every block must be
back within one step of a mass Abort of long streams (``steps_to_release``
counts from the step the memory service had last planned when the Abort
calls returned).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from kvpager_tools.drills.common import DrillEnv, DrillResult, greedy_request, random_prompt
from kvpager_tools.drills.runner import Needs
from kvpager.v1 import gateway_pb2

NEEDS = Needs(executors=1)
FATES = ("cancel", "abort", "deadline", "complete")
# CANCELLED is the client's own cancel; DEADLINE_EXCEEDED its deadline.
ALLOWED = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})


@dataclasses.dataclass
class Options:
    streams: int = dataclasses.field(default=300, metadata={"help": "streams, all started at once"})
    max_tokens: int = 48
    distinct_prompts: int = dataclasses.field(default=12, metadata={"help": "prompts reused across streams"})
    fork_share: float = dataclasses.field(default=0.2, metadata={"help": "share of streams with n = 2"})
    mass_abort_streams: int = dataclasses.field(default=32, metadata={
        "help": "long streams aborted all at once at the end"})
    max_release_steps: int = dataclasses.field(default=2, metadata={
        "help": "steps after the mass abort by which every block must be back (the step in flight + one)"})


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("cancel")
    c = env.clients
    rng = env.rng
    info = await c.model_info()
    prompts = [random_prompt(rng, info.vocab_size, rng.randint(8, 40)) for _ in range(opts.distinct_prompts)]
    refs = [await env.reference(p, opts.max_tokens) for p in prompts]

    async def one(i: int):
        k = rng.randrange(len(prompts))
        fate = rng.choice(FATES)
        n = 2 if rng.random() < opts.fork_share else 1
        # n = 2 with a seed: completion 0 is sampled with temperature 0 -> greedy too.
        request = greedy_request(prompts[k], opts.max_tokens, n=n, request_id=f"drill-cancel-{uuid.uuid4().hex}")
        at = rng.randint(1, opts.max_tokens - 1)
        if fate == "cancel":
            out = await c.generate(request, cancel_after_tokens=at)
        elif fate == "deadline":
            out = await c.generate(request, timeout_s=rng.uniform(0.02, 1.5))
        elif fate == "abort":
            async def abort_later():
                await asyncio.sleep(rng.uniform(0.0, 0.8))
                await c.gateway.Abort(gateway_pb2.AbortRequest(request_id=request.request_id), timeout=10)

            task = asyncio.ensure_future(abort_later())
            out = await c.generate(request)
            await task
        else:
            out = await c.generate(request)
        return k, fate, n, out

    t0 = time.monotonic()
    outs = await asyncio.gather(*(one(i) for i in range(opts.streams)))
    end_snapshot = await c.accounting()
    t_end = time.monotonic()
    by_fate = {f: 0 for f in FATES}
    for k, fate, n, out in outs:
        by_fate[fate] += 1
        result.record(out.status)
        result.add("outputs_compared" if env.exact else "outputs_not_compared", len(out.tokens))
        for index, tokens in out.tokens.items() if env.exact else ():
            if tokens != refs[k][:len(tokens)]:
                at = next(i for i, (g, w) in enumerate(zip(tokens, refs[k])) if g != w)
                result.violation(f"{fate} stream (n={n}) completion {index} served tokens that are not the "
                                 f"greedy output's prefix: first difference at token {at}, got {list(tokens)} "
                                 f"want {refs[k][:len(tokens)]} prompt {prompts[k]}")
        if out.status == "OK" and fate == "complete" and len(out.first) != opts.max_tokens:
            result.violation(f"completed stream has {len(out.first)} tokens, want {opts.max_tokens}")
    result.forbid(ALLOWED, "streams")

    await env.wait_baseline(10.0)

    # Then all at once: long streams, every one aborted (Abort RPC) mid-
    # generation. When Abort returns the engine has the abort, so the blocks
    # must be back in the next step (a client's cancel takes as long as the
    # RST_STREAM takes to reach the gateway, which a loaded machine delays).
    started = asyncio.Event()
    num_started = 0

    def on_first() -> None:
        nonlocal num_started
        num_started += 1
        if num_started == opts.mass_abort_streams:
            started.set()

    ids = [f"drill-mass-{uuid.uuid4().hex}" for _ in range(opts.mass_abort_streams)]
    tasks = [asyncio.ensure_future(c.generate(greedy_request(prompts[i % len(prompts)], opts.max_tokens * 4,
                                                             request_id=rid), on_first=on_first))
             for i, rid in enumerate(ids)]
    try:
        await asyncio.wait_for(started.wait(), 60)
    except TimeoutError:
        result.violation(f"only {num_started} of {opts.mass_abort_streams} long streams started")
    held = (await c.accounting()).total.used_blocks
    replies = await asyncio.gather(*(c.gateway.Abort(gateway_pb2.AbortRequest(request_id=rid), timeout=10)
                                     for rid in ids))
    aborted_at = await c.accounting()
    for out in await asyncio.gather(*tasks):
        result.record(out.status)
    snap, waited = await env.wait_baseline(10.0)
    steps = snap.step_id - aborted_at.step_id
    if steps > opts.max_release_steps:
        result.violation(f"blocks came back {steps} steps after the streams were aborted "
                         f"(allowed {opts.max_release_steps})")
    result.figures.update({
        "fates": by_fate,
        "wall_s": round(t_end - t0, 3),
        "used_blocks_when_last_stream_ended": end_snapshot.total.used_blocks,
        "mass_abort": {"streams": len(tasks), "found": sum(r.found for r in replies), "blocks_held": held,
                       "steps_to_release": steps, "release_s": round(waited, 3)},
    })
    return result
