"""Streams that must survive a restart: the drills' shared part.

A drill that restarts a service under load (memory-restart, executor-kill)
runs greedy and seeded-sampling streams, measures each once on the
undisturbed stack, disturbs it, and then checks that every stream completed
with exactly its undisturbed tokens. ``tally`` gives the figures
docs/reliability.md records per drill: streams started, completed, paused
(and the longest pause), failed.
"""

from __future__ import annotations

import asyncio
import statistics

from kvpager.v1 import gateway_pb2
from kvpager_tools.drills.common import Clients, DrillResult, sampling
from kvpager_tools.generate import Stream

# A stream paused when the gap between its chunks around the disturbance is
# over this, and over PAUSE_FACTOR times its median gap (a slow step is no pause).
PAUSE_MIN_S = 0.1
PAUSE_FACTOR = 5.0


def mixed_requests(prompts: list[list[int]], max_tokens: int, seed: int = 0) -> list[gateway_pb2.GenerateRequest]:
    """Greedy for even indices, seeded sampling for odd ones (every fourth with n=2):
    each one's output is fixed by the request alone."""
    out = []
    for i, p in enumerate(prompts):
        kw = dict(max_tokens=max_tokens, ignore_eos=True)
        if i % 2:
            kw.update(temperature=1.0, top_p=0.95, seed=seed * 1000 + i, n=2 if i % 4 == 3 else 1)
        out.append(gateway_pb2.GenerateRequest(prompt_token_ids=list(p), sampling_params=sampling(**kw)))
    return out


async def references(clients: Clients, requests: list[gateway_pb2.GenerateRequest]) -> list[dict[int, list[int]]]:
    """Every request's tokens per completion on the undisturbed stack."""
    refs = []
    for r in requests:
        out = await clients.generate(r, timeout_s=120)
        if out.status != "OK":
            raise RuntimeError(f"reference request failed: {out.status}: {out.details}")
        refs.append(out.tokens)
    return refs


async def start(clients: Clients, requests: list[gateway_pb2.GenerateRequest],
                timeout_s: float = 60.0) -> tuple[list[asyncio.Future], int]:
    """The streams, waited on until every one has its first tokens (or
    ``timeout_s``). -> (the stream tasks, how many had started)."""
    started = asyncio.Event()
    num_started = 0

    def on_first() -> None:
        nonlocal num_started
        num_started += 1
        if num_started == len(requests):
            started.set()

    tasks = [asyncio.ensure_future(clients.generate(r, on_first=on_first)) for r in requests]
    try:
        await asyncio.wait_for(started.wait(), timeout_s)
    except TimeoutError:
        pass
    return tasks, num_started


def pause_s(out: Stream, t_disturbed: float) -> float:
    """The stream's longest gap between chunks that ends after ``t_disturbed``
    (perf_counter; the steps in flight may still stream before the pause),
    when that is a pause (else 0)."""
    worst = 0.0
    for c in out.completions.values():
        times = c.chunk_times
        gaps = [b - a for a, b in zip(times, times[1:])]
        if not gaps:
            continue
        typical = statistics.median(gaps)
        for a, b in zip(times, times[1:]):
            if b > t_disturbed and b - a > max(PAUSE_MIN_S, PAUSE_FACTOR * typical):
                worst = max(worst, b - a)
    return worst


def tally(result: DrillResult, outs: list[Stream], refs: list[dict[int, list[int]]], num_started: int,
          t_disturbed: float, *, expect_ok: bool = True, exact: bool = True) -> dict:
    """Records every stream's status, checks completed ones against their
    references, and returns the drill's stream figures. ``expect_ok``: any
    failed stream is a violation; ``exact`` False (``DrillEnv.exact``): the
    outputs are counted as not compared."""
    pauses = []
    for out, ref in zip(outs, refs):
        result.record(out.status)
        if out.status != "OK":
            if expect_ok:
                result.violation(f"a stream failed: {out.status}: {out.details}")
            continue
        result.add("outputs_compared" if exact else "outputs_not_compared")
        if exact and out.tokens != ref:
            first = next(i for i in sorted(ref) if out.tokens.get(i) != ref[i])
            result.violation(f"completion {first} differs from its undisturbed run: got "
                             f"{out.tokens.get(first, [])[:8]}... want {ref[first][:8]}...")
        pauses.append(pause_s(out, t_disturbed))
    paused = [p for p in pauses if p > 0]
    return {"started": num_started, "completed": sum(o.status == "OK" for o in outs), "paused": len(paused),
            "longest_pause_s": round(max(paused, default=0.0), 3), "failed": sum(o.status != "OK" for o in outs)}
