"""Arrivals settling (gateway.arrivals, --arrival-settle-ms): the step planned
ahead behind a running prefill, while requests are still arriving and it is
not full, waits until they pause, so prompts sent together go out in one
step instead of one step each; a request arriving at an idle executor, or
behind a decode, is planned at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack
from gateway_harness import random_prompts as prompts

from gateway import metrics, wire
from gateway.arrivals import ArrivalSettle
from gateway.inflight import Call


def call(executor_id: str, *token_counts: int, burst: int = 0, planned: float = 0.0) -> Call:
    rows = [wire.Row(seq=None, start=0, token_ids=[5] * n, burst=burst) for n in token_counts]
    return Call(SimpleNamespace(executor_id=executor_id), None, rows, sent=planned, step_start=planned)


def test_a_step_behind_a_prefill_waits_while_requests_arrive():
    settle = ArrivalSettle(0.003, max_batch_tokens=64, max_running=4)
    settle.admitted(10.0)
    prefill = [call("e0", 20)]
    assert settle.waiting(10.001, prefill, [("e0", 1), ("e0", 12)]) == {"e0"}
    assert settle.settles_at == pytest.approx(10.003)
    assert settle.waiting(10.003, prefill, [("e0", 1), ("e0", 12)]) == set()  # settled
    settle.admitted(10.004)  # another came: waiting again
    assert settle.waiting(10.005, prefill, [("e0", 1), ("e0", 12)]) == {"e0"}


def test_a_full_step_a_decode_or_nothing_planned_does_not_wait():
    settle = ArrivalSettle(0.003, max_batch_tokens=64, max_running=4)
    settle.admitted(10.0)
    prefill = [call("e0", 20)]
    assert settle.waiting(10.001, prefill, [("e0", 60), ("e0", 4)]) == set()  # the token budget is full
    assert settle.waiting(10.001, prefill, [("e0", 1)] * 4) == set()  # as many sequences as it runs
    assert settle.waiting(10.001, prefill, [("e1", 5)]) == set()  # nothing planned for e0
    assert settle.waiting(10.001, [call("e0", 1, 1)], [("e0", 5)]) == set()  # behind decodes
    assert settle.waiting(10.001, [call("e0", 5, burst=4)], [("e0", 5)]) == set()  # behind a decode burst
    # e0 runs a prefill then a planned-ahead decode step: its latest call decides
    assert settle.waiting(10.001, [call("e0", 20), call("e0", 1)], [("e0", 5)]) == set()
    assert settle.waiting(10.001, [call("e0", 20), call("e1", 1)], [("e0", 5), ("e1", 5)]) == {"e0"}
    # A prefill planned after the latest arrival (a lone request's own) waits all the same.
    assert settle.waiting(10.001, [call("e0", 20, planned=10.0005)], [("e0", 1)]) == {"e0"}


def test_no_settle_time_never_waits():
    settle = ArrivalSettle(0.0, max_batch_tokens=64, max_running=4)
    settle.admitted(10.0)
    assert settle.waiting(10.0, [call("e0", 20)], [("e0", 5)]) == set()
    with pytest.raises(ValueError):
        ArrivalSettle(-0.001, 64, 4)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    stack = await start_stack(model, num_blocks=160, block_size=4)
    assert stack.gateway.engine.arrivals.settle_s == 0.003  # the default
    yield stack
    await stack.stop()


async def steps_of(stack, settle_ms: float, first: list[int], others: list[list[int]], oracle,
                   planned: list[float] | None = None) -> list[list[int]]:
    """Sends ``first``, then ``others`` 5 ms apart (each forward 0.4 s slower,
    in the executor's step thread: the first prefill runs while they come);
    returns each Execute's rows as their token counts, in order (and when
    each was planned into ``planned``). With others, ``first`` asks for one
    token: no decode of its own is planned behind its prefill before they come."""
    engine = stack.gateway.engine
    runner = stack.executors[0].executor.runner
    forward, rows_of, settle_s = runner.forward, engine._rows, engine.arrivals.settle_s
    steps: list[list[int]] = []

    def slow(*args):
        time.sleep(0.4)
        return forward(*args)

    def spy(ep):
        rows = rows_of(ep)
        steps.append([len(row.token_ids) for row in rows])
        if planned is not None:
            planned.append(time.perf_counter())
        return rows

    async def one(p, n=2):
        res = await generate(stack.gw, p, max_tokens=n, ignore_eos=True)
        assert res[0][0] == oracle.greedy(p, n, min_new_tokens=n)

    runner.forward, engine._rows, engine.arrivals.settle_s = slow, spy, settle_ms / 1e3
    try:
        tasks = []
        for i, p in enumerate((first, *others)):
            tasks.append(asyncio.ensure_future(one(p, 1 if i == 0 and others else 2)))
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
        assert stack.memory.state.manager.check_invariants() == []
    finally:
        runner.forward, engine._rows, engine.arrivals.settle_s = forward, rows_of, settle_s
    await stack.wait_idle()
    return steps


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("settle_ms", [100.0, 0.0])
async def test_prompts_arriving_during_a_prefill_go_out_in_one_step(stack, oracle, settle_ms):
    """100 ms: arrivals 5 ms apart settle whatever the machine's load (the
    prefill runs 400 ms). 0, the control: the step behind the first prefill
    is planned as soon as the first of them comes."""
    first, *others = prompts(4, seed=61 if settle_ms else 62)  # no prefix shared with the other run
    held = metrics.STEPS_HELD_FOR_ARRIVALS._value.get()
    steps = await steps_of(stack, settle_ms, first, others, oracle)
    assert steps[0] == [len(first)]
    if settle_ms:  # the three prompts that came, together
        assert sorted(steps[1]) == sorted(map(len, others)), steps
        assert metrics.STEPS_HELD_FOR_ARRIVALS._value.get() > held
    else:  # the first that came, planned as it came (maybe with the next)
        assert steps[1] in ([len(others[0])], [len(others[0]), len(others[1])]), steps
        assert metrics.STEPS_HELD_FOR_ARRIVALS._value.get() == held


@pytest.mark.asyncio(loop_scope="module")
async def test_a_lone_requests_decode_waits_the_settle_time_and_no_longer(stack, oracle):
    """Its own arrival holds the step behind its prefill (another may be
    coming) for the settle time, 100 ms here; it is then planned while the
    0.4 s prefill still runs, so the executor does not wait for it."""
    held = metrics.STEPS_HELD_FOR_ARRIVALS._value.get()
    planned: list[float] = []
    steps = await steps_of(stack, 100.0, prompts(1, seed=63)[0], [], oracle, planned)
    assert [len(step) for step in steps[:2]] == [1, 1] and steps[1] == [1], steps
    assert 0.05 < planned[1] - planned[0] < 0.3, planned  # held ~0.1 s, planned before the prefill ends
    assert metrics.STEPS_HELD_FOR_ARRIVALS._value.get() > held
