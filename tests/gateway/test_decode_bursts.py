"""Decode bursts (--num-scheduler-steps, gateway.bursts): an executor running
only decodes computes several tokens per sequence in one step. What clients
get is exactly what a stack without bursts gives — greedy against
transformers' generate, seeded sampling, logprobs, penalties and top
logprobs (those rows step one at a time), stop tokens and strings mid-burst,
short limits, min_tokens, n > 1 — and every block comes back, including when
a stop or a cancel lands mid-burst and when requests arrive while bursts run."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import pytest_asyncio
from gateway_harness import (check_cancel_mid_stream, check_stop_string_and_short_limits, check_stop_token_mid_completion,
                             generate, greedy_batch_exact, params, start_stack)
from gateway_harness import on_each as both
from gateway_harness import random_prompts as prompts

from gateway import metrics

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stacks(model):
    # Requests that set no stream_interval get their completion in deltas of 64 (in one piece, here).
    bursts = await start_stack(model, num_blocks=160, block_size=4, num_scheduler_steps=4, stream_interval=64)
    plain = await start_stack(model, num_blocks=160, block_size=4, num_scheduler_steps=1)
    assert bursts.gateway.engine.scheduler.num_steps == 4 and plain.gateway.engine.scheduler.num_steps == 1
    yield bursts, plain
    await bursts.stop()
    await plain.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def streamed(stacks, model):
    """Bursts whose clients read every token: each sub-step's tokens come back as it ends (ExecuteStream)."""
    stack = await start_stack(model, num_blocks=160, block_size=4, num_scheduler_steps=4, stream_interval=1)
    await generate(stack.gw, prompts(1, seed=20)[0], max_tokens=8, ignore_eos=True)  # the forwards timed
    assert stack.gateway.engine.scheduler.clock.seconds
    yield stack, stacks[1]
    await stack.stop()


def streamed_mid_burst() -> float:
    return metrics.TOKENS_STREAMED_MID_BURST._value.get()


def sampled_ahead() -> float:
    return metrics.TOKENS_SAMPLED_AHEAD._value.get()


def discarded() -> float:
    return metrics.TOKENS_SAMPLED_AHEAD_DISCARDED._value.get()


async def test_greedy_batch_bursts_and_matches_generate(stacks, oracle):
    before = sampled_ahead()
    await greedy_batch_exact(stacks[0], oracle, prompts(6, seed=1), 13)
    assert sampled_ahead() - before >= 6 * 3  # the decodes did run in bursts


@pytest.mark.parametrize("kw", [
    dict(temperature=0.9, top_p=0.9, seed=7),
    dict(temperature=0.8, seed=11, logprobs=1),
    dict(temperature=0.7, top_k=20, seed=3, frequency_penalty=0.8, presence_penalty=0.5),
    dict(temperature=0.8, seed=5, logprobs=1, top_logprobs=3),
    dict(temperature=0.8, seed=9, min_tokens=6, logit_bias={7: 2.0}),
    dict(temperature=0.9, seed=13, n=2),
], ids=["seeded", "logprobs", "penalties", "top-logprobs", "min-tokens-bias", "n2"])
async def test_sampling_is_the_same_in_bursts(stacks, kw):
    await same_as_single_steps(stacks, prompts(4, seed=3), kw)


async def same_as_single_steps(pair, batch, kw) -> None:
    """``pair``: (a stack that bursts, one that steps one token at a time): the same tokens and text."""
    got_bursts, got_plain = await both(pair, batch, max_tokens=10, ignore_eos=True, **kw)
    for a, b in zip(got_bursts, got_plain):
        assert a.keys() == b.keys()
        for i in a:
            assert a[i][0] == b[i][0] and a[i][1] == b[i][1]
            assert len(a[i][0]) == 10


async def test_stop_token_mid_burst_ends_there_and_frees_blocks(stacks, oracle):
    """The burst computed past the stop: those tokens are discarded, never streamed."""
    await stop_token_discards(stacks, oracle, seed=4)


async def stop_token_discards(pair, oracle, seed: int) -> None:
    before = discarded()
    await check_stop_token_mid_completion(pair, oracle, prompts(4, seed=seed), 12, first=3)
    assert discarded() > before


async def test_stop_string_and_short_limits(stacks):
    await check_stop_string_and_short_limits(stacks, prompts(3, seed=5))


async def test_requests_arriving_while_bursts_run(stacks, oracle):
    """A new request waits for the burst in flight, then prefills (no burst
    beside it); everyone gets generate's tokens and every block returns."""
    bursts, _ = stacks
    batch = prompts(8, seed=6)
    tasks = []
    for p in batch:
        tasks.append(asyncio.ensure_future(generate(bursts.gw, p, max_tokens=16, ignore_eos=True)))
        await asyncio.sleep(0.03)
    for p, res in zip(batch, await asyncio.gather(*tasks)):
        assert res[0][0] == oracle.greedy(p, 16, min_new_tokens=16), p
    await bursts.wait_idle()


async def test_bursts_never_delay_a_streamed_delta(stacks, oracle):
    """A client reading every token, or every 3 (after its first, streamed at
    once), gets its deltas as it would one step at a time: the burst's
    sub-steps come back as they end and their tokens are streamed then."""
    bursts, _ = stacks
    engine = bursts.gateway.engine
    p = prompts(1, seed=8)[0]
    await generate(bursts.gw, p, max_tokens=8, ignore_eos=True)  # the executor's forwards timed
    executor = bursts.executors[0].executor
    forward = executor._run

    def slow(*args):  # 20 ms per forward: a sub-step's message is apart from the next one's
        time.sleep(0.02)
        return forward(*args)

    executor._run = slow
    engine.scheduler.max_burst_s = 1.0  # measured at the tiny model's speed: still bursts of 4
    try:
        await _deltas_on_time(bursts, engine, p, oracle)
    finally:
        executor._run = forward
        engine.scheduler.max_burst_s = 0.03


async def _deltas_on_time(bursts, engine, p, oracle) -> None:
    from kvpager.v1 import gateway_pb2
    from kvpager_tools.generate import stream_generate

    for interval in (1, 3):
        before, streamed_before = sampled_ahead(), streamed_mid_burst()
        sizes, taken_whole = [], []
        whole = engine.results.whole

        def spy(rows, resp):  # the tokens each whole response still brings
            taken_whole.append(sum(1 + r.burst - r.taken for r in rows if r.burst))
            return whole(rows, resp)

        engine.results.whole = spy
        req = gateway_pb2.GenerateRequest(prompt_token_ids=p, stream_interval=interval,
                                          sampling_params=params(max_tokens=10, ignore_eos=True))
        try:
            out = await stream_generate(bursts.gw, req, timeout_s=60,
                                        on_chunk=lambda resp, _: sizes.append(len(resp.token_ids)))
        finally:
            engine.results.whole = whole
        assert out.completions[0].token_ids == oracle.greedy(p, 10, min_new_tokens=10)
        rest = 10 - 1  # the first token goes at once, then deltas of the interval
        assert sizes == [1] + [interval] * (rest // interval) + ([rest % interval] if rest % interval else [])
        assert sampled_ahead() > before  # it did burst
        # every burst token but each burst's last came as its sub-step ended
        assert streamed_mid_burst() - streamed_before == sampled_ahead() - before
        assert all(n <= 1 for n in taken_whole), taken_whole
        await bursts.wait_idle()


async def test_streamed_bursts_match_generate(streamed, oracle):
    before, mid = sampled_ahead(), streamed_mid_burst()
    await greedy_batch_exact(streamed[0], oracle, prompts(6, seed=23), 13)
    assert sampled_ahead() - before >= 6 * 3 and streamed_mid_burst() - mid >= 6 * 3


@pytest.mark.parametrize("kw", [
    dict(temperature=0.9, top_p=0.9, seed=7),
    dict(temperature=0.8, seed=11, logprobs=1),
    dict(temperature=0.9, seed=13, n=2),
], ids=["seeded", "logprobs", "n2"])
async def test_sampling_is_the_same_in_streamed_bursts(streamed, kw):
    mid = streamed_mid_burst()
    await same_as_single_steps(streamed, prompts(4, seed=24), kw)
    assert streamed_mid_burst() > mid


async def test_stop_token_mid_streamed_burst(streamed, oracle):
    """The stop comes in a sub-step: the request ends there, the rest of the burst is discarded."""
    await stop_token_discards(streamed, oracle, seed=25)


async def test_stop_string_and_cancel_in_streamed_bursts(streamed):
    await check_stop_string_and_short_limits(streamed, prompts(3, seed=26))
    await check_cancel_mid_stream(streamed[0], prompts(4, seed=27))


async def test_cancel_mid_burst_returns_blocks(stacks):
    await check_cancel_mid_stream(stacks[0], prompts(4, seed=7))


async def test_preempted_while_its_burst_runs(model):
    """A more important request arrives while a burst runs and takes the
    bursting sequences' blocks (the plan is made during the burst; the
    executor runs it after): the burst's tokens still count, the preempted
    sequences recompute, everyone gets generate's tokens, every block returns."""
    from oracle import Oracle

    oracle = Oracle(model, fixed_length=True)  # EOS may come up: ignore_eos streams it, as generate to the length
    stack = await start_stack(model, num_blocks=60, block_size=4, num_scheduler_steps=8, stream_interval=64,
                              swap_blocks=0)
    try:
        rng = random.Random(9)
        batch = [[rng.randrange(3, 300) for _ in range(24)] for _ in range(4)]  # 4 x 21 blocks at the end
        tasks = [asyncio.ensure_future(generate(stack.gw, p, max_tokens=60, ignore_eos=True)) for p in batch]
        before = sampled_ahead()
        while sampled_ahead() == before:  # a burst is running or has run
            await asyncio.sleep(0.01)
        urgent = [random.Random(10).randrange(3, 300) for _ in range(120)]
        first = await generate(stack.gw, urgent, max_tokens=8, ignore_eos=True, priority=-5)
        assert first[0][0] == oracle.greedy(urgent, 8)
        for p, res in zip(batch, await asyncio.gather(*tasks)):
            assert res[0][0] == oracle.greedy(p, 60), p
        acct = await stack.wait_idle()
        assert acct.used_blocks == 0 and acct.preemptions_recompute >= 1
    finally:
        await stack.stop()


async def test_a_step_that_schedules_nothing_streams_first(stacks):
    """With a burst planned behind a prefill, the first token comes back while
    the burst runs; the next Step only carries that token's append. It must not
    hold the token back: the outbox is flushed before such a Step."""
    from kvpager.v1 import gateway_pb2
    from kvpager_tools.generate import stream_generate

    bursts, _ = stacks
    engine = bursts.gateway.engine
    await generate(bursts.gw, prompts(1, seed=21)[0], max_tokens=8, ignore_eos=True)  # the executor's forwards timed
    assert engine.scheduler.clock.seconds
    seen = []
    step = engine.memory.step

    async def spy(request, timeout_s=None):
        seen.append((bool(request.schedule_seq_ids), len(engine.outbox._items)))
        return await step(request, timeout_s)

    engine.memory.step = spy
    try:
        req = gateway_pb2.GenerateRequest(prompt_token_ids=prompts(1, seed=22)[0], stream_interval=4,
                                          sampling_params=params(max_tokens=16, ignore_eos=True))
        out = await stream_generate(bursts.gw, req, timeout_s=60)
    finally:
        engine.memory.step = step
    assert len(out.completions[0].token_ids) == 16
    idle = [pending for scheduled, pending in seen if not scheduled]
    assert idle and not any(idle), seen  # such Steps happened, and none held a delta back
    await bursts.wait_idle()


async def arrival_mid_burst(stack, oracle, seed: int, forward_s: float, pause_s: float = 0.0) -> list:
    """A request of 24 tokens decoding in bursts on an executor slowed by
    ``forward_s`` a forward, and a second one sent once a burst is out (and
    ``pause_s`` more); both get generate's tokens, and the memory service's
    invariants hold while the first still runs. Returns every Execute as
    (step id, prev step id, decode steps, cut_prev, streamed, sub-steps run,
    next sub-step carried)."""
    engine = stack.gateway.engine
    executor = stack.executors[0].executor
    runner = executor.runner
    forward = runner.forward
    ex = engine.executors["executor-0"]
    real_execute = ex.execute
    sent = []

    async def spy(request, timeout_s=None, on_part=None):
        row = [request.step_id, request.prev_step_id, request.decode_steps, request.cut_prev, on_part is not None, 0,
               False]
        sent.append(row)
        resp = await real_execute(request, timeout_s, on_part)
        row[5], row[6] = resp.sub_steps_run, resp.sub_step_carried
        return resp

    def slow(*args):  # inside the executor's forward timer: the gateway's clock sees it
        time.sleep(forward_s)
        return forward(*args)

    ex.execute, runner.forward = spy, slow
    engine.scheduler.max_burst_s = 1.0
    engine.scheduler.clock.seconds["executor-0"] = forward_s  # (a burst's next step is planned near its end)
    try:
        first, second = prompts(2, seed=seed)
        a = asyncio.ensure_future(generate(stack.gw, first, max_tokens=24, ignore_eos=True))
        while not any(row[2] > 1 for row in sent):
            await asyncio.sleep(0.005)
        await asyncio.sleep(pause_s)
        b = await generate(stack.gw, second, max_tokens=4, ignore_eos=True)
        assert stack.memory.state.manager.check_invariants() == []
        assert (await a)[0][0] == oracle.greedy(first, 24, min_new_tokens=24)
        assert b[0][0] == oracle.greedy(second, 4, min_new_tokens=4)
    finally:
        ex.execute, runner.forward = real_execute, forward
        engine.scheduler.max_burst_s = 0.03
    await stack.wait_idle()
    return sent


async def test_a_step_planned_while_a_burst_runs_names_it(streamed, oracle):
    """A request arriving mid-burst is prefilled in a step planned while the
    burst runs: that Execute names the burst (prev_step_id) though it feeds no
    placeholder, so the executor runs it after the burst whatever the order
    the two calls reach it (a streamed burst's handler is a stream)."""
    sent = await arrival_mid_burst(streamed[0], oracle, seed=28, forward_s=0.01)
    bursts = {step for step, _, steps, _, is_streamed, *_ in sent if steps > 1 and is_streamed}
    assert bursts and any(prev in bursts and steps == 0 for _, prev, steps, *_ in sent), sent


@pytest.mark.parametrize("which", ["whole", "streamed"])
async def test_a_request_arriving_mid_burst_cuts_it_short(stacks, streamed, oracle, which):
    """The step that admits a request arriving mid-burst names the burst and
    cuts it short: the executor ends it where it is (between sub-steps, or
    before the next layer of a forward) and runs the prefill next. Both requests get generate's tokens, the cut sequence
    goes on from where the burst stopped, every block comes back, and the
    tokens it never sampled are counted."""
    given_back = metrics.TOKENS_SAMPLED_AHEAD_CUT._value.get()
    sent = await arrival_mid_burst(stacks[0] if which == "whole" else streamed[0], oracle, seed=41,
                                   forward_s=0.03, pause_s=0.04)  # a sub-step or so in
    cuts = [(step, steps, ran, carried) for step, _, steps, _, _, ran, carried in sent if ran]
    assert cuts, sent
    # Never sampled: the sub-steps neither run nor carried into the step behind (which samples the carried one).
    assert metrics.TOKENS_SAMPLED_AHEAD_CUT._value.get() - given_back == \
        sum(steps - ran - carried for _, steps, ran, carried in cuts)
    for step, steps, ran, carried in cuts:
        assert 1 <= ran < steps and carried
        assert any(prev == step and cut for _, prev, _, cut, *_ in sent), (step, sent)  # by the step behind it


async def bursts_timed(stack, body, forward_s: float = 0.02, lead_ms: float | None = None) -> list:
    """Runs ``body()`` on ``stack`` with its executor's forwards ``forward_s``
    slower (inside the executor's timer: the gateway's clock knows) and bursts
    of 4 whatever that time; returns every Execute as [step id, prev step id,
    decode steps, sent, returned] (perf_counter seconds)."""
    engine = stack.gateway.engine
    runner = stack.executors[0].executor.runner
    forward = runner.forward
    ex = engine.executors["executor-0"]
    real_execute = ex.execute
    lead = engine.config.burst_plan_lead_ms
    sent = []

    async def spy(request, timeout_s=None, on_part=None):
        row = [request.step_id, request.prev_step_id, request.decode_steps, time.perf_counter(), 0.0]
        sent.append(row)
        try:
            return await real_execute(request, timeout_s, on_part)
        finally:
            row[4] = time.perf_counter()

    def slow(*args):
        time.sleep(forward_s)
        return forward(*args)

    ex.execute, runner.forward = spy, slow
    engine.scheduler.max_burst_s = 1.0
    engine.scheduler.clock.seconds["executor-0"] = forward_s
    if lead_ms is not None:
        engine.config.burst_plan_lead_ms = lead_ms
    try:
        await body()
        assert stack.memory.state.manager.check_invariants() == []
    finally:
        ex.execute, runner.forward = real_execute, forward
        engine.scheduler.max_burst_s = 0.03
        engine.config.burst_plan_lead_ms = lead
    await stack.wait_idle()
    return sent


def bursts_planned_ahead(sent: list) -> list[tuple[list, list]]:
    """(burst, the burst after it) pairs where the second was sent before the first returned."""
    by_id = {row[0]: row for row in sent}
    return [(by_id[b[1]], b) for b in sent
            if b[2] > 1 and b[1] in by_id and by_id[b[1]][2] > 1 and b[3] < by_id[b[1]][4]]


async def test_a_bursts_next_one_is_planned_near_its_end(stacks, oracle):
    """With plan-ahead a burst's next burst is planned and sent while it runs,
    fed its last sample, so the executor does not idle between them; not at
    once but near its end by the executor's measured forwards (a request
    arriving before then still cuts it). generate's tokens; every block back."""
    bursts, _ = stacks
    p = prompts(1, seed=51)[0]
    behind = metrics.STEPS_BEHIND_BURST._value.get()

    async def body():
        res = await generate(bursts.gw, p, max_tokens=24, ignore_eos=True)
        assert res[0][0] == oracle.greedy(p, 24, min_new_tokens=24)

    sent = await bursts_timed(bursts, body)
    pairs = bursts_planned_ahead(sent)
    assert pairs, sent
    assert metrics.STEPS_BEHIND_BURST._value.get() - behind >= len(pairs)
    for first, second in pairs:
        # 4 forwards of >= 20 ms: planned one forward (the lead is at least one) before the end, not at once
        assert second[3] - first[3] >= 0.045, (first, second)


async def test_a_lead_of_zero_plans_a_bursts_next_step_after_it_returns(stacks, oracle):
    bursts, _ = stacks
    p = prompts(1, seed=52)[0]

    async def body():
        res = await generate(bursts.gw, p, max_tokens=16, ignore_eos=True)
        assert res[0][0] == oracle.greedy(p, 16, min_new_tokens=16)

    behind = metrics.STEPS_BEHIND_BURST._value.get()
    sent = await bursts_timed(bursts, body, lead_ms=0.0)
    assert any(row[2] > 1 for row in sent) and not bursts_planned_ahead(sent), sent
    assert metrics.STEPS_BEHIND_BURST._value.get() == behind


async def test_a_stop_in_a_burst_whose_next_one_is_planned_discards_that_one(stacks, oracle):
    """A stop token mid-burst ends the request there; the burst planned after
    it computed past the end: its tokens are discarded, never streamed, and
    its blocks come back."""
    bursts, _ = stacks
    before = discarded()
    sent = await bursts_timed(bursts, lambda: check_stop_token_mid_completion([bursts], oracle, prompts(3, seed=53),
                                                                              16, first=6))
    assert bursts_planned_ahead(sent) and discarded() > before
