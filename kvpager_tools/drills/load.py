"""load: many concurrent streams; all complete or get RESOURCE_EXHAUSTED.

Reports throughput, p50/p99 time to first token and end-to-end latency,
peak block use, and RSS (current and peak) of every service. Prompts share
a few block-aligned prefixes, so the prefix cache and copy-on-write work under
load; a sample of streams is compared with its undisturbed greedy output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from kvpager_tools.drills.common import DrillEnv, DrillResult, children_memory, greedy_request, random_prompt
from kvpager_tools.drills.runner import Needs
from kvpager_tools.stats import percentile

NEEDS = Needs(executors=1)
ALLOWED = frozenset({"RESOURCE_EXHAUSTED"})


@dataclasses.dataclass
class Options:
    streams: int = dataclasses.field(default=1000, metadata={"help": "concurrent Generate streams"})
    max_tokens: int = 32
    prompt_tokens: int = dataclasses.field(default=48, metadata={"help": "longest prompt (shortest: 8)"})
    shared_prefixes: int = dataclasses.field(default=4, metadata={"help": "distinct 2-block prefixes"})
    compare_outputs: int = dataclasses.field(default=16, metadata={"help": "streams checked against a reference"})
    stream_timeout_s: float = 900.0
    sample_interval_s: float = 0.1


async def _sample(env: DrillEnv, figures: dict, stop: asyncio.Event, interval_s: float) -> None:
    """Peak block use and RSS while the load runs."""
    peak_used = peak_seqs = 0
    peak_rss: dict[str, float] = {}
    while not stop.is_set():
        try:
            t = (await env.clients.accounting()).total
            peak_used, peak_seqs = max(peak_used, t.used_blocks), max(peak_seqs, t.num_sequences)
        except Exception:  # noqa: BLE001 - sampling is best effort
            pass
        for name, mem in children_memory(env.stack).items():
            peak_rss[name] = max(peak_rss.get(name, 0.0), mem["rss_mib"])
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass
    figures["peak_used_blocks"] = peak_used
    figures["peak_sequences"] = peak_seqs
    figures["sampled_peak_rss_mib"] = peak_rss


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("load")
    c = env.clients
    info = await c.model_info()
    rng = env.rng
    bs = info.block_size or 16
    prefixes = [random_prompt(rng, info.vocab_size, 2 * bs) for _ in range(max(1, opts.shared_prefixes))]
    limit = min(opts.prompt_tokens, info.max_model_len - opts.max_tokens)
    prompts = [random_prompt(rng, info.vocab_size, rng.randint(max(8, 2 * bs + 1) if limit > 2 * bs else 8, limit),
                             prefix=rng.choice(prefixes) if limit > 2 * bs else ())
               for _ in range(opts.streams)]
    compared = set(range(min(opts.compare_outputs, len(prompts))))
    for i in sorted(compared):  # undisturbed references first (this also warms the shared prefixes)
        await env.reference(prompts[i], opts.max_tokens)
    before = await c.accounting()

    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample(env, result.figures, stop, opts.sample_interval_s))
    t0 = time.monotonic()
    outs = await asyncio.gather(*(c.generate(greedy_request(p, opts.max_tokens), timeout_s=opts.stream_timeout_s)
                                  for p in prompts))
    wall_s = time.monotonic() - t0
    stop.set()
    await sampler

    tokens = 0
    for i, out in enumerate(outs):
        result.record(out.status)
        if out.status == "OK":
            tokens += len(out.first)
            if len(out.first) != opts.max_tokens:
                result.violation(f"stream {i} completed with {len(out.first)} of {opts.max_tokens} tokens")
            if i in compared:
                env.check_output(result, prompts[i], opts.max_tokens, out)
        elif out.status == "RESOURCE_EXHAUSTED" and out.retry_after_s is None:
            result.violation("RESOURCE_EXHAUSTED without a retry-after-s hint")
    result.forbid(ALLOWED, "streams")
    ok = [o for o in outs if o.status == "OK"]
    after = await c.accounting()
    ms = lambda v: round(v * 1000, 1) if v is not None else None  # noqa: E731
    result.figures.update({
        "streams": opts.streams,
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 2) if wall_s else None,
        "completion_tokens_per_s": round(tokens / wall_s, 1) if wall_s else None,
        "ttft_p50_ms": ms(percentile([o.ttft_s for o in ok if o.ttft_s is not None], 50)),
        "ttft_p99_ms": ms(percentile([o.ttft_s for o in ok if o.ttft_s is not None], 99)),
        "latency_p50_ms": ms(percentile([o.total_s for o in ok], 50)),
        "latency_p99_ms": ms(percentile([o.total_s for o in ok], 99)),
        "prefix_hit_tokens": after.total.prefix_hit_tokens - before.total.prefix_hit_tokens,
        "preemptions": after.total.preemptions - before.total.preemptions,
        "memory": children_memory(env.stack),
    })
    return result
