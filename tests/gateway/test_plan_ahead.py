"""Steps planned ahead (docs/architecture.md): decodes fed with the token the
executor's step before is still sampling give exactly what a gateway that
waits for every token gives — greedy against transformers' generate, seeded
sampling, penalties, logprobs and stops against a stack with planning ahead
off — and a sequence that a stop ends mid-pipeline returns every block."""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

from gateway import metrics

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stacks(model):
    ahead = await start_stack(model, num_blocks=128, block_size=4)
    lockstep = await start_stack(model, num_blocks=128, block_size=4, plan_ahead=False)
    assert ahead.gateway.engine.config.plan_ahead and not lockstep.gateway.engine.config.plan_ahead
    yield ahead, lockstep
    await ahead.stop()
    await lockstep.stop()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def fed_ahead() -> float:
    return metrics.ROWS_FED_AHEAD._value.get()


async def both(stacks, prompt_list, **kw):
    """Each prompt's completions on the planning-ahead stack and on the lockstep one."""
    out = []
    for s in stacks:
        out.append(await asyncio.gather(*(generate(s.gw, p, **kw) for p in prompt_list)))
        await s.wait_idle()
    return out


async def test_greedy_batch_is_fed_ahead_and_matches_generate(stacks, oracle):
    ahead, _ = stacks
    batch = prompts(6, seed=1)
    before = fed_ahead()
    results = await asyncio.gather(*(generate(ahead.gw, p, max_tokens=12, ignore_eos=True) for p in batch))
    assert fed_ahead() - before >= 6  # the decodes did run planned ahead
    for p, res in zip(batch, results):
        assert res[0][0] == oracle.greedy(p, 12, min_new_tokens=12), p
    await ahead.wait_idle()


async def test_lockstep_stack_feeds_nothing_ahead(stacks):
    _, lockstep = stacks
    before = fed_ahead()
    await asyncio.gather(*(generate(lockstep.gw, p, max_tokens=8, ignore_eos=True) for p in prompts(3, seed=2)))
    assert fed_ahead() == before
    await lockstep.wait_idle()


@pytest.mark.parametrize("kw", [
    dict(temperature=0.9, top_p=0.9, seed=7),
    dict(temperature=0.7, top_k=20, seed=3, frequency_penalty=0.8, presence_penalty=0.5),
    dict(temperature=0, repetition_penalty=1.5),
    dict(temperature=0.8, seed=11, logprobs=1, top_logprobs=3),
], ids=["seeded", "penalties", "repetition", "logprobs"])
async def test_sampling_is_the_same_planned_ahead(stacks, kw):
    got_ahead, got_lockstep = await both(stacks, prompts(4, seed=3), max_tokens=10, ignore_eos=True, **kw)
    for a, b in zip(got_ahead, got_lockstep):
        assert a[0][0] == b[0][0]
        assert len(a[0][0]) == 10


async def test_stop_token_mid_pipeline_ends_there_and_frees_blocks(stacks, oracle):
    """The step fed with the stop token was already planned: its row is wasted
    and its blocks go back with the sequence."""
    batch = prompts(4, seed=4)
    stops = []
    for p in batch:
        greedy = oracle.greedy(p, 10, min_new_tokens=10)
        stops.append(next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i]))
    for s in stacks:
        results = await asyncio.gather(*(generate(s.gw, p, max_tokens=10, ignore_eos=True, stop_token_ids=[t])
                                         for p, t in zip(batch, stops)))
        for p, t, res in zip(batch, stops, results):
            greedy = oracle.greedy(p, 10, min_new_tokens=10)
            assert res[0][0] == greedy[:greedy.index(t) + 1]
        await s.wait_idle()


async def test_stop_string_and_short_limits(stacks):
    batch = prompts(3, seed=5)
    for max_tokens in (1, 2, 3):
        a, b = await both(stacks, batch, max_tokens=max_tokens, ignore_eos=True)
        assert [r[0][0] for r in a] == [r[0][0] for r in b]
        assert all(len(r[0][0]) == max_tokens for r in a)
    text = (await generate(stacks[1].gw, batch[0], max_tokens=12, ignore_eos=True))[0][1]
    stop = text[len(text) // 2:len(text) // 2 + 2] or text[:1]
    a, b = await both(stacks, batch[:1], max_tokens=12, ignore_eos=True, stop=[stop])
    assert a[0][0][0] == b[0][0][0] and a[0][0][1] == b[0][0][1]  # tokens and text up to the stop
    assert stop not in a[0][0][1] and len(a[0][0][1]) < len(text)


async def test_cancel_while_a_step_is_planned_ahead_returns_blocks(stacks):
    ahead, _ = stacks
    tasks = [asyncio.ensure_future(generate(ahead.gw, p, max_tokens=200, ignore_eos=True))
             for p in prompts(4, seed=6)]
    await asyncio.sleep(0.3)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await ahead.wait_idle()
    # and the stack serves on
    res = await generate(ahead.gw, [5, 6, 7], max_tokens=4, ignore_eos=True)
    assert len(res[0][0]) == 4
    await ahead.wait_idle()
