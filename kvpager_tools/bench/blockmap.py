"""`kvpager bench blockmap --json`: what the live block map costs at a large pool.

The real in-process stack on the demo model with one executor of
``--num-blocks`` blocks (100,000 by default) and the block map on; load
with distinct prompts (their blocks stay cached, scattered over the pool by
LRU age) runs while headless Chromium (Playwright; Debian's ``chromium``)
shows the page. Prints:

* the bytes of the first (full) update and of the later ones (median, p95,
  max): what the stream sends;
* the page's frame time per update (applying it and repainting the grid:
  median, p95) and the updates per second it saw;
* the memory service's time to build an update (a full frame and a delta),
  measured on its own state after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time

NAME = "blockmap"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="block map payload and page frame time at a large pool (headless chromium)")
    p.add_argument("--num-blocks", type=int, default=100_000)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--interval-ms", type=int, default=250)
    p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    p.add_argument("--screenshot", default=None, help="save the page here at the end (PNG)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def run(args: argparse.Namespace) -> dict:
    import random

    from playwright.async_api import async_playwright

    from kvpager.v1 import gateway_pb2
    from kvpager_tools.demo_model import ensure_demo_model
    from kvpager_tools.generate import stream_generate
    from kvpager_tools.stack import start_in_process
    from memory_service.blockmap.frames import Subscriber

    stack = await start_in_process(str(ensure_demo_model()), num_blocks=args.num_blocks, block_size=args.block_size,
                                   swap_blocks=256, memory_kw={"http_port": 0}, max_running=args.concurrency)
    rng = random.Random(0)
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = await browser.new_page(viewport={"width": 1300, "height": 1100})
            await page.goto(f"{stack.memory.blockmap_url}?interval_ms={args.interval_ms}")
            while not await page.evaluate("window.blockmap.stats().updates >= 1"):
                await asyncio.sleep(0.05)
            sem = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                ids = [rng.randrange(3, 300) for _ in range(args.prompt_tokens)]
                req = gateway_pb2.GenerateRequest(prompt_token_ids=ids, request_id=f"bench-{i}", sampling_params={
                    "max_tokens": args.max_tokens, "ignore_eos": True})
                async with sem:
                    await stream_generate(stack.gw, req, timeout_s=600)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.requests)))
            load_s = time.perf_counter() - t0
            await asyncio.sleep(1.0)
            page_stats = await page.evaluate("""() => { const s = window.blockmap.S.stats;
                return {bytes: s.bytes, frameMs: s.frameMs, all: window.blockmap.stats()}; }""")
            if args.screenshot:
                await page.screenshot(path=args.screenshot, full_page=False)
            await browser.close()
        manager = stack.memory.state.manager
        sub = Subscriber()
        full_ms, delta_ms = [], []
        for _ in range(5):
            t = time.perf_counter()
            Subscriber().update(manager, 0)
            full_ms.append((time.perf_counter() - t) * 1000)
        sub.update(manager, 0)
        for _ in range(5):
            t = time.perf_counter()
            sub.update(manager, 0)
            delta_ms.append((time.perf_counter() - t) * 1000)
        acct = (await stack.accounting())
    finally:
        await stack.stop()
    later = page_stats["bytes"][1:]
    return {
        "num_blocks": args.num_blocks, "block_size": args.block_size, "requests": args.requests,
        "load_s": round(load_s, 2), "cached_blocks_after": acct.cached_blocks,
        "updates_seen": page_stats["all"]["updates"],
        "updates_per_s": round(page_stats["all"]["updatesPerSec"], 2),
        "first_update_bytes": page_stats["bytes"][0] if page_stats["bytes"] else 0,
        "update_bytes": {"median": statistics.median(later) if later else 0, "p95": _pct(later, 0.95),
                         "max": max(later, default=0)},
        "page_frame_ms": {"median": round(statistics.median(page_stats["frameMs"]), 2),
                          "p95": round(_pct(page_stats["frameMs"], 0.95), 2)},
        "server_update_ms": {"full": round(statistics.median(full_ms), 2),
                             "delta": round(statistics.median(delta_ms), 2)},
        "note": "the page keeps the last 200 updates; bytes are the JSON of one SSE event",
    }


def _main(args: argparse.Namespace) -> int:
    from kvpager.telemetry import configure_logging

    configure_logging("bench", "WARNING")  # the services' logs to stderr; stdout is the JSON
    out = asyncio.run(run(args))
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    add_bench_parser(sub)
    a = p.parse_args([NAME, *sys.argv[1:]])
    sys.exit(a.func(a))
