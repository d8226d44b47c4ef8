"""What the sliding-window stack tests share (per-layer layout in
test_gateway_sliding.py, a table per KV group in test_gateway_hybrid.py):
the window, the prompts, and the long-prompt exactness case both layouts
must pass."""

from __future__ import annotations

import asyncio
import random

from gateway_harness import generate

WINDOW = 32


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` random prompts of lo <= length < hi tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


async def check_long_prompts_exact(stack, oracle) -> None:
    """Concurrent prompts of 3-4x the window, then the same 96-token prefix
    again (a prefix hit), then n=2: every completion token-exact."""
    long = prompts(3, 3 * WINDOW, 4 * WINDOW, seed=1)
    results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=40, ignore_eos=True) for p in long))
    for p, res in zip(long, results):
        assert res[0][0] == oracle.greedy(p, 40)
    again = long[0][: 3 * WINDOW] + [11, 12, 13]
    res = await generate(stack.gw, again, max_tokens=40, ignore_eos=True)
    assert res[0][0] == oracle.greedy(again, 40)
    assert res[0][3].cached_prompt_tokens == 3 * WINDOW
    res = await generate(stack.gw, long[1], max_tokens=40, n=2, ignore_eos=True)
    assert res[0][0] == res[1][0] == oracle.greedy(long[1], 40)
