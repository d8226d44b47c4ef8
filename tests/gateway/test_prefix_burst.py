"""Requests that arrive together with a shared prompt prefix compute it once:
the scheduler gives the first all the step's tokens until its prompt is done,
and the others, admitted in the step that finishes it, hit the blocks it
commits in that same step (and still match transformers' generate token for
token). Also: prefix routing spreads distinct new prefixes over the executors."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

SYSTEM = list(range(100, 148))  # 12 full blocks of 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, executors=2, num_blocks=128, block_size=4, max_batch_tokens=16)
    yield s
    await s.stop()


@pytest.mark.parametrize("batch_tokens", ["chunked", "whole"])
async def test_burst_with_shared_prefix_computes_it_once(stack, oracle, batch_tokens):
    # 16 tokens a step: the 51-token prompts take four steps; or all in one step
    stack.gateway.engine.config.max_batch_tokens = 16 if batch_tokens == "chunked" else 512
    prompts = [SYSTEM + [7 + i, 9, 11] for i in range(3)]
    salt = f"burst-{batch_tokens}"
    before = await stack.accounting()
    results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=4, cache_salt=salt) for p in prompts))
    for p, res in zip(prompts, results):
        assert res[0][0] == oracle.greedy(p, 4)
    after = await stack.wait_idle()
    assert sorted(res[0][3].cached_prompt_tokens for res in results) == [0, len(SYSTEM), len(SYSTEM)]
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 2 * len(SYSTEM)


async def test_new_prefixes_spread_over_executors_by_footprint(stack):
    router = stack.gateway.router
    stack.gateway.engine.config.max_batch_tokens = 512
    prefixes = [[200 + 10 * j + i % 7 for i in range(40)] for j in range(4)]
    chosen = []
    for j in (0, 1, 2, 3, 0, 1, 2, 3):
        # one at a time, so load is equal (zero) at every choice: only footprint separates them
        chosen.append(await router.choose(prefixes[j] + [5, 6], "spread"))
    assert sorted(chosen[:4]) == ["executor-0", "executor-0", "executor-1", "executor-1"]
    assert chosen[4:] == chosen[:4]  # a prefix seen before goes where it went
    fp = router.routed.footprint
    assert fp["executor-0"] == fp["executor-1"]


async def test_token_budget_is_per_executor_and_executors_step_independently(stack, oracle):
    """Two long prompts on two executors prefill side by side: each executor
    gets max_batch_tokens a step (one shared budget ran them one after the
    other), and neither waits for the other's Execute to plan its next step."""
    engine, router = stack.gateway.engine, stack.gateway.router
    engine.config.max_batch_tokens = 16
    prompts = {"executor-0": [30 + i % 50 for i in range(60)], "executor-1": [90 + i % 40 for i in range(60)]}
    steps = []  # per Step: [(executor, tokens)] scheduled
    real_step, real_choose = engine.memory.step, router.choose

    async def step(request, timeout_s=None):
        from kvpager.packed import unpack_i32, unpack_i64

        ids, nums = unpack_i64(request.schedule_seq_ids), unpack_i32(request.schedule_num_tokens)
        steps.append([(engine.seqs[i].executor_id, n) for i, n in zip(ids, nums) if i in engine.seqs])
        return await real_step(request, timeout_s)

    async def choose(prompt_ids, cache_salt, deadline=None, chain=None):
        return next(e for e, p in prompts.items() if p == prompt_ids)

    engine.memory.step, router.choose = step, choose
    try:
        results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=3, ignore_eos=True)
                                         for p in prompts.values()))
    finally:
        engine.memory.step, router.choose = real_step, real_choose
        engine.config.max_batch_tokens = 512
    for p, res in zip(prompts.values(), results):
        assert res[0][0] == oracle.greedy(p, 3, min_new_tokens=3)
    for s in steps:
        for eid in prompts:
            assert sum(n for e, n in s if e == eid) <= 16
    chunks = {eid: [i for i, s in enumerate(steps) if (eid, 16) in s] for eid in prompts}
    assert all(len(c) >= 3 for c in chunks.values())
    # the prefills overlap: each executor's first chunk comes before the other's last one
    assert chunks["executor-1"][0] < chunks["executor-0"][-1] and chunks["executor-0"][0] < chunks["executor-1"][-1]
    await stack.wait_idle()


async def test_a_slow_executor_does_not_hold_up_the_other(stack, oracle):
    """Executor-0's every Execute is delayed 0.3 s (injected in the gateway's
    client for it); a request on executor-1 still streams at its own pace
    (stepped in lockstep it would wait 0.3 s a token)."""
    import time

    engine, router = stack.gateway.engine, stack.gateway.router
    slow = engine.executors["executor-0"]
    real_execute, real_choose = slow.execute, router.choose
    slow_p, fast_p = [11, 12, 13, 14, 15], [21, 22, 23, 24, 25]

    async def delayed(request, timeout_s=None, on_part=None):
        await asyncio.sleep(0.3)
        return await real_execute(request, timeout_s, on_part)

    async def choose(prompt_ids, cache_salt, deadline=None, chain=None):
        return "executor-0" if prompt_ids == slow_p else "executor-1"

    slow.execute, router.choose = delayed, choose
    try:
        slow_call = asyncio.ensure_future(generate(stack.gw, slow_p, max_tokens=8, ignore_eos=True))
        await asyncio.sleep(0.1)  # executor-0 is busy now
        t0 = time.monotonic()
        fast = await generate(stack.gw, fast_p, max_tokens=12, ignore_eos=True)
        fast_s = time.monotonic() - t0
        assert not slow_call.done()
        slow_res = await slow_call
    finally:
        slow.execute, router.choose = real_execute, real_choose
    assert fast_s < 12 * 0.3 / 2, f"the fast request took {fast_s:.2f} s"
    assert fast[0][0] == oracle.greedy(fast_p, 12, min_new_tokens=12)
    assert slow_res[0][0] == oracle.greedy(slow_p, 8, min_new_tokens=8)
    await stack.wait_idle()


async def test_scoring_gives_up_by_the_request_deadline(stack, monkeypatch):
    """Prefix scores that never come (a Redis that accepts and never answers)
    cost a request at most its remaining time, then it routes by load."""
    import socket

    from gateway import router as router_mod

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        router = router_mod.PrefixAwareRouter(stack.gateway.engine,
                                              redis_url=f"redis://127.0.0.1:{hole.getsockname()[1]}")
        loop = asyncio.get_running_loop()
        try:
            t0 = loop.time()
            chosen = await router.choose(list(range(10, 40)), "", deadline=t0 + 0.3)
            assert 0.25 < loop.time() - t0 < 2.0
            assert chosen in stack.gateway.engine.executors
            monkeypatch.setattr(router_mod, "SCORE_TIMEOUT_S", 0.2)  # no deadline: the cap applies
            t0 = loop.time()
            await router.choose(list(range(10, 40)), "")
            assert loop.time() - t0 < 1.5
            assert await router.choose([1, 2], "", deadline=loop.time() - 1) in stack.gateway.engine.executors
        finally:
            if router.prefix_reader is not None:
                await router.prefix_reader.aclose()
