"""Streams that outlive a memory-service restart (gateway/recovery.py): the
services in this process, the memory service stopped and a fresh one started
on the same port (cold: no mirror). The streams pause and go on with exactly
the tokens of an undisturbed run (beam searches too, also across a restart
rebuilt from Redis); the bounds (--max-retries, the recovery
timeout) end them UNAVAILABLE."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import pytest_asyncio
from gateway_harness import start_stack

from gateway.beam import Beam, BeamSearch, BeamState
from gateway.params import SamplingSpec
from gateway.recovery import Recovery, RecoveryConfig
from gateway.sequences import SequenceTable
from gateway.state import Request
from kvpager.v1 import common_pb2, gateway_pb2
from kvpager_tools.generate import stream_generate

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(4)]
MAX_TOKENS = 48


def _request(prompt, i: int) -> gateway_pb2.GenerateRequest:
    """Even ones greedy (the third with penalties: the executor's token history
    must be rebuilt), odd ones seeded sampling (n=2 for the last)."""
    sp = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    if i % 2:
        sp.temperature, sp.top_p, sp.seed = 1.0, 0.9, 1234 + i
        if i == 3:
            sp.n = 2
    elif i == 2:
        sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty = 1.3, 0.4, 0.2
    return gateway_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=sp)


async def _restart_memory(stack, down_s: float = 0.3, stop: bool = True) -> None:
    """Stop the memory service (no grace: a crash, as far as its peers go) and start a cold one on its port."""
    from memory_service.service import MemoryServer

    old = stack.memory
    port = int(old.address.rsplit(":", 1)[1])
    if stop:
        await old.stop(0)
    await asyncio.sleep(down_s)
    stack.memory = await MemoryServer(dataclasses.replace(old.config, port=port)).start()


def _readmitted() -> float:
    from gateway.metrics import REGISTRY

    return REGISTRY.get_sample_value("kvpager_gateway_sequences_readmitted_total") or 0.0


async def _streams(stack, started: int):
    """Start the streams; returns their tasks once every one has ``started`` tokens."""
    counts = [0] * len(PROMPTS)
    ready = asyncio.Event()

    def on_chunk(i):
        def seen(resp, _c):
            counts[i] += len(resp.token_ids)
            if all(c >= started for c in counts):
                ready.set()
        return seen

    tasks = [asyncio.ensure_future(stream_generate(stack.gw, _request(p, i), timeout_s=120, raise_errors=False,
                                                   on_chunk=on_chunk(i))) for i, p in enumerate(PROMPTS)]
    await asyncio.wait_for(ready.wait(), 60)
    return tasks


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    # A long lease: the executor's next heartbeat (lease / 3 = 20 s) would come long after
    # the gateway registered it again with a fresh memory service.
    s = await start_stack(model, executors=1, num_blocks=128, block_size=4, memory_kw={"lease_s": 60.0}, http={})
    yield s
    await s.stop()


@pytest.fixture
def recovery_config(stack):
    """The gateway's bounds, changed by a test and restored after it."""
    engine = stack.gateway.engine
    saved = engine.recovery.config
    engine.recovery.config = dataclasses.replace(saved)
    yield engine.recovery.config
    engine.recovery.config = saved


async def test_streams_continue_token_exact_across_a_cold_memory_restart(stack):
    refs = [await stream_generate(stack.gw, _request(p, i), timeout_s=120) for i, p in enumerate(PROMPTS)]
    before = _readmitted()
    tasks = await _streams(stack, 4)
    t_kill = time.perf_counter()
    await _restart_memory(stack)
    outs = await asyncio.gather(*tasks)
    for ref, out in zip(refs, outs):
        assert out.status == "OK", (out.status, out.details)
        assert out.tokens == ref.tokens
        assert all(len(t) == MAX_TOKENS for t in out.tokens.values())
    gaps = [b - a for o in outs for c in o.completions.values()
            for a, b in zip(c.chunk_times, c.chunk_times[1:]) if b > t_kill]
    assert gaps and max(gaps) < 10, gaps  # paused, then went on (before the executor's own heartbeat)
    # 4 requests, the last with n=2: every sequence at least once (twice when a listing read
    # before the executor was registered again arrived after their re-admission)
    assert _readmitted() - before in (5, 10)
    assert stack.gateway.engine.recovery.pending is False
    await stack.wait_idle()
    assert (await stack.accounting()).num_sequences == 0


async def test_an_http_stream_continues_across_a_memory_restart(stack):
    """The OpenAI API streams through the same engine: the real ``openai``
    client sees a pause, then the text of the undisturbed run."""
    import openai

    client = openai.AsyncOpenAI(base_url=stack.gateway.http_url + "/v1", api_key="none", max_retries=0)
    name = stack.gateway.http_context.served_model_name
    kw = dict(model=name, prompt="The scientist said", max_tokens=64, temperature=0.9, seed=99, stream=True,
              extra_body={"ignore_eos": True})
    want = "".join([c.choices[0].text async for c in await client.completions.create(**kw)])
    before = _readmitted()
    stream = await client.completions.create(**kw)
    got, restarted = [], None
    async for chunk in stream:
        got.append(chunk.choices[0].text)
        if restarted is None and len(got) >= 4:
            restarted = asyncio.ensure_future(_restart_memory(stack))
    await restarted
    assert "".join(got) == want
    assert chunk.choices[0].finish_reason == "length"
    assert _readmitted() - before in (1, 2)  # it was mid-stream when the memory service went (see above)
    await stack.wait_idle()


async def test_max_retries_zero_ends_the_streams_unavailable(stack, recovery_config):
    recovery_config.max_retries = 0
    tasks = await _streams(stack, 2)
    await _restart_memory(stack)
    outs = await asyncio.gather(*tasks)
    assert {o.status for o in outs} == {"UNAVAILABLE"}
    assert all("--max-retries" in o.details for o in outs), [o.details for o in outs]
    out = await stream_generate(stack.gw, _request(PROMPTS[0], 0), timeout_s=60)  # and it serves on
    assert len(out.first) == MAX_TOKENS
    await stack.wait_idle()


async def test_a_memory_service_that_stays_down_ends_the_streams_after_the_timeout(stack, recovery_config):
    recovery_config.timeout_s = 1.5
    tasks = await _streams(stack, 2)
    t0 = time.monotonic()
    await stack.memory.stop(0)
    try:
        outs = await asyncio.gather(*tasks)
        took = time.monotonic() - t0
        assert {o.status for o in outs} == {"UNAVAILABLE"}
        assert all("--recovery-timeout-s" in o.details for o in outs), [o.details for o in outs]
        assert 1.5 <= took < 8, took
        assert not stack.gateway.engine.seqs and not stack.gateway.engine.recovery.pending
    finally:
        await _restart_memory(stack, 0, stop=False)  # stopped already: a fresh one
    out = await stream_generate(stack.gw, _request(PROMPTS[1], 1), timeout_s=60)  # and it serves on
    assert out.status == "OK"
    await stack.wait_idle()


async def test_readmit_gives_new_ids_and_drops_the_changes_naming_the_old_ones():
    table = SequenceTable()
    req = Request("r", [1, 2, 3], SamplingSpec(max_tokens=8), seed=0)
    parent = table.start(req, None)
    parent.created = True
    other = table.start(Request("o", [4], SamplingSpec(max_tokens=8), seed=0), None)
    other.created = True
    table.append(parent, 7)
    table.append(other, 8)
    (child,) = table.fork(parent, [None])
    table.changes.free.append(other.seq_id)
    old_parent, old_child = parent.seq_id, child.seq_id
    assert table.readmit([parent, child], "e1") == [old_parent, old_child]
    assert old_parent not in table and old_child not in table
    assert table.get(parent.seq_id) is parent and table.get(child.seq_id) is child
    assert parent.seq_id > other.seq_id and child.seq_id > parent.seq_id
    for s in (parent, child):
        assert (s.executor_id, s.num_computed, s.created, s.placeholders, s.tokens) == ("e1", 0, False, 0, [1, 2, 3, 7])
    assert table.changes.forks == [] and list(table.changes.appends) == [other.seq_id]
    assert table.changes.free == [other.seq_id]


def _beam_request(prompt) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=common_pb2.SamplingParams(
        max_tokens=BEAM_TOKENS, beam_width=3))


BEAM_TOKENS = 24


async def _beams_at(stack, generated: int) -> None:
    """Wait until the one beam request in flight has ``generated`` tokens in its beams."""
    for _ in range(20000):
        reqs = [r for r in stack.gateway.engine.requests.values() if r.beam is not None]
        if reqs and reqs[0].beam.running and len(reqs[0].beam.running[0].generated) >= generated:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the beam request never got that far")


async def test_beam_search_resumes_token_exact_across_a_cold_memory_restart(stack, oracle):
    """Every running beam is rewound; scores, finished hypotheses and the
    early-stop flag stay in the gateway: the result is transformers' beam search."""
    prompt = [11, 23, 35, 47, 59, 61, 73]
    ref = await stream_generate(stack.gw, _beam_request(prompt), timeout_s=120)
    assert ref.first == oracle.beams(prompt, BEAM_TOKENS, 3)
    before = _readmitted()
    task = asyncio.ensure_future(stream_generate(stack.gw, _beam_request(prompt), timeout_s=120,
                                                 raise_errors=False))
    await _beams_at(stack, 4)
    await _restart_memory(stack)
    out = await task
    assert out.status == "OK", (out.status, out.details)
    assert out.tokens == ref.tokens
    assert _readmitted() - before >= 3  # every beam (more when a stale listing came after them, see above)
    assert stack.gateway.engine.recovery.pending is False
    await stack.wait_idle()
    assert (await stack.accounting()).num_sequences == 0


async def test_max_retries_bounds_a_beam_search(stack, recovery_config):
    recovery_config.max_retries = 0
    task = asyncio.ensure_future(stream_generate(stack.gw, _beam_request([5, 9, 13, 17]), timeout_s=120,
                                                 raise_errors=False))
    await _beams_at(stack, 3)
    await _restart_memory(stack)
    out = await task
    assert out.status == "UNAVAILABLE" and "--max-retries" in out.details, (out.status, out.details)
    again = await stream_generate(stack.gw, _beam_request([5, 9, 13, 17]), timeout_s=60)  # and it serves on
    assert again.status == "OK" and len(again.tokens) == 1
    await stack.wait_idle()
    assert (await stack.accounting()).num_sequences == 0


async def test_a_rewound_beam_search_keeps_its_state_and_drops_the_lost_steps_candidates():
    """A step half gathered (one beam preempted) when the loss came: the
    candidates under the old ids go, so the search waits for every rewound
    beam's recompute and takes each beam's candidates once."""
    table = SequenceTable()
    req = Request("b", [1, 2, 3], SamplingSpec(max_tokens=8, beam_width=2), seed=0)
    first = table.start(req, None)
    first.created, first.retries = True, 1
    (second,) = table.fork(first, [None])
    assert second.retries == 1  # a fork inherits its parent's rewinds: --max-retries bounds the lineage
    table.append(first, 7)
    table.append(second, 8)
    state = BeamState(2, 4, 3, 11, running=[Beam(first, -1.0, [7]), Beam(second, -2.0, [8])],
                      finished=[(-3.0, [9])], heuristic_unsatisfied=True)
    req.beam = state
    search = BeamSearch(ops=None)  # only ever waits here: the ops are never reached
    search.candidates(first, [5, 6], [-0.1, -0.2])
    search.finish_step()
    old = [first.seq_id, second.seq_id]
    assert list(state.pending) == old[:1]
    assert Recovery(RecoveryConfig(), table, None, None, None)._rewind([first, second], "e1") == old
    assert state.pending == {} and {first.seq_id, second.seq_id}.isdisjoint(old)
    assert [(b.seq, b.score, b.generated) for b in state.running] == [(first, -1.0, [7]), (second, -2.0, [8])]
    assert state.finished == [(-3.0, [9])] and (first.tokens, second.tokens) == ([1, 2, 3, 7], [1, 2, 3, 8])
    assert (first.retries, second.retries) == (2, 2)
    search.candidates(first, [5, 6], [-0.1, -0.2])  # the recompute of one beam: still waiting for the other
    search.finish_step()
    assert list(state.pending) == [first.seq_id]


async def test_beam_search_resumes_across_a_restart_rebuilt_from_redis(model, oracle):
    """The restarted memory service rebuilds its prefix cache from the mirror:
    the rewound beams hit it, and the result is still the undisturbed one."""
    from kvpager_tools.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server not installed")
    redis = RedisServer().start()
    mirrored = await start_stack(model, executors=1, num_blocks=128, block_size=4, memory_kw={"lease_s": 60.0},
                                 redis_url=redis.url)
    try:
        prompt = [31, 41, 59, 26, 53, 58, 97, 93]
        before = _readmitted()
        task = asyncio.ensure_future(stream_generate(mirrored.gw, _beam_request(prompt), timeout_s=120,
                                                     raise_errors=False))
        await _beams_at(mirrored, 4)
        await _restart_memory(mirrored)
        out = await task
        assert out.status == "OK", (out.status, out.details)
        assert out.first == oracle.beams(prompt, BEAM_TOKENS, 3)
        assert _readmitted() - before >= 3
        await mirrored.wait_idle()
    finally:
        await mirrored.stop()
        redis.close()
