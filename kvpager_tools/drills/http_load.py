"""http-load: many concurrent streaming HTTP requests; each completes or gets 429.

1,000 streamed /v1/completions requests at once (by default) through the
gateway's OpenAI-compatible API: every one must either complete (its
max_tokens, a finish_reason, ``[DONE]``) or be refused with 429 and a
Retry-After; no 5xx, no other error, and (the common end check) every block
back. Reports throughput and TTFT / end-to-end percentiles. Run
``--gateway-args "--max-waiting 256"`` to see the 429s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from kvpager_tools.drills.common import DrillEnv, DrillResult, random_prompt
from kvpager_tools.drills.runner import Needs
from kvpager_tools.stats import percentile

NEEDS = Needs(executors=1)


@dataclasses.dataclass
class Options:
    streams: int = dataclasses.field(default=1000, metadata={"help": "concurrent streaming HTTP requests"})
    max_tokens: int = 16
    prompt_tokens: int = dataclasses.field(default=24, metadata={"help": "prompt length"})
    stream_timeout_s: float = 900.0


async def run_streams(base_url: str, model: str, *, num_requests: int, max_tokens: int, api_key: str | None = None,
                      prompts: list[list[int]] | None = None, timeout_s: float = 900.0) -> dict:
    """All at once; counts by outcome and the latencies of the completed ones."""
    from kvpager_tools.bench.http_client import HttpClient, HttpClientError, Response

    prompts = prompts or [[5 + (i % 200), 7, 9, 11] for i in range(num_requests)]
    client = HttpClient(base_url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                        timeout_s=timeout_s)
    counts = {"completed": 0, "rejected_429": 0, "server_errors": 0, "other_errors": 0, "bad_streams": 0}
    ttft, e2e, statuses, errors = [], [], {}, []
    tokens = 0

    async def one(prompt: list[int]) -> None:
        nonlocal tokens
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = None
        finish = usage = None
        done = False
        try:
            async for item in client.stream_events("/v1/completions", body):
                if isinstance(item, Response):
                    statuses[item.status] = statuses.get(item.status, 0) + 1
                    if item.status == 429 and item.headers.get("retry-after"):
                        counts["rejected_429"] += 1
                    elif item.status >= 500:
                        counts["server_errors"] += 1
                        errors.append(f"HTTP {item.status}: {item.body[:120]!r}")
                    else:
                        counts["other_errors"] += 1
                        errors.append(f"HTTP {item.status}: {item.body[:120]!r}")
                    return
                arrived, data = item
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    counts["other_errors"] += 1
                    errors.append(f"in-stream error: {chunk['error']}")
                    return
                first = first or arrived
                for choice in chunk.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        except HttpClientError as exc:
            counts["other_errors"] += 1
            errors.append(f"connection: {exc}")
            return
        statuses[200] = statuses.get(200, 0) + 1
        ok = done and finish == "length" and usage and usage["completion_tokens"] == max_tokens
        if not ok:
            counts["bad_streams"] += 1
            errors.append(f"incomplete stream: done={done} finish={finish} usage={usage}")
            return
        counts["completed"] += 1
        tokens += usage["completion_tokens"]
        ttft.append(first - t0)
        e2e.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(p) for p in prompts[:num_requests]))
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    ms = lambda v: round(v * 1000, 1) if v is not None else None  # noqa: E731
    return {**counts, "requests": num_requests, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "errors": errors[:5], "wall_s": round(wall, 3), "completion_tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "e2e_p50_ms": ms(percentile(e2e, 50)), "e2e_p99_ms": ms(percentile(e2e, 99))}


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    from kvpager_tools.bench.http_client import HttpClient
    from kvpager_tools.bench.openai_load import served_model

    result = DrillResult("http-load")
    base = env.stack.addresses.http
    if base is None:
        result.violation("the gateway serves no HTTP API (the stack runs it without --no-http)")
        return result
    sec = env.security
    key = sec.auth_token if sec is not None else None
    probe = HttpClient(base, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        model = await served_model(probe)
    finally:
        await probe.close()
    info = await env.clients.model_info()
    prompts = [random_prompt(env.rng, info.vocab_size, opts.prompt_tokens) for _ in range(opts.streams)]
    figures = await run_streams(base, model, num_requests=opts.streams, max_tokens=opts.max_tokens, api_key=key,
                                prompts=prompts, timeout_s=opts.stream_timeout_s)
    result.figures.update(figures)
    for name in ("completed", "rejected_429"):
        for _ in range(figures[name]):
            result.record("OK" if name == "completed" else "RESOURCE_EXHAUSTED")
    if figures["server_errors"]:
        result.violation(f"{figures['server_errors']} requests answered 5xx: {figures['errors']}")
    if figures["other_errors"] or figures["bad_streams"]:
        result.violation(f"{figures['other_errors']} failed, {figures['bad_streams']} incomplete: {figures['errors']}")
    return result
