"""Steps planned ahead (docs/architecture.md): decodes fed with the token the
executor's step before is still sampling give exactly what a gateway that
waits for every token gives — greedy against transformers' generate, seeded
sampling, penalties, logprobs and stops against a stack with planning ahead
off — and a sequence that a stop ends mid-pipeline returns every block."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from gateway_harness import (check_cancel_mid_stream, check_stop_string_and_short_limits, check_stop_token_mid_completion,
                             generate, greedy_batch_exact, start_stack)
from gateway_harness import on_each as both
from gateway_harness import random_prompts as prompts

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


def fed_ahead() -> float:
    return metrics.ROWS_FED_AHEAD._value.get()


async def test_greedy_batch_is_fed_ahead_and_matches_generate(stacks, oracle):
    before = fed_ahead()
    await greedy_batch_exact(stacks[0], oracle, prompts(6, seed=1), 12)
    assert fed_ahead() - before >= 6  # the decodes did run planned ahead


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
    await check_stop_token_mid_completion(stacks, oracle, prompts(4, seed=4), 10, first=2)


async def test_stop_string_and_short_limits(stacks):
    await check_stop_string_and_short_limits(stacks, prompts(3, seed=5))


async def test_cancel_while_a_step_is_planned_ahead_returns_blocks(stacks):
    await check_cancel_mid_stream(stacks[0], prompts(4, seed=6))


async def test_a_step_finished_under_one_planned_ahead_streams_before_the_next_plan(stacks):
    """Its executor already runs the next step: the tokens go to their
    streams at once, not after the memory round trip of the step after.
    No settle time: by default the step behind a lone prompt's prefill waits
    3 ms for other arrivals (gateway.arrivals), and the demo model's prefill
    often ends sooner, so that no step would finish under one planned ahead."""
    engine = stacks[0].gateway.engine
    events: list[str] = []
    step, flush, whole, settle_s = engine.memory.step, engine.outbox.flush, engine.results.whole, engine.arrivals.settle_s

    async def logged_step(*a, **kw):
        events.append("step")
        return await step(*a, **kw)

    def logged_flush():
        events.append("flush" if engine.outbox._items else "flush-empty")
        flush()

    def logged_whole(rows, out):
        running = any(call.rows is not rows and not call.task.done() for call in engine._inflight)
        events.append("ahead" if running else "idle")
        return whole(rows, out)

    engine.memory.step, engine.outbox.flush, engine.results.whole = logged_step, logged_flush, logged_whole
    engine.arrivals.settle_s = 0.0
    try:
        await generate(stacks[0].gw, prompts(1, seed=7)[0], max_tokens=8, ignore_eos=True)
    finally:
        del engine.memory.step, engine.outbox.flush, engine.results.whole
        engine.arrivals.settle_s = settle_s
    after_ahead = [next((e for e in events[i + 1:] if e != "flush-empty"), None)
                   for i, e in enumerate(events) if e == "ahead"]
    assert after_ahead and set(after_ahead) == {"flush"}, events
