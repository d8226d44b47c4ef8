"""A bug while processing one request's results ends that request with
INTERNAL; the other requests in the same step stream on, token-exact, and
every block comes back. (The fault is injected into the engine's own
per-request code; the model, gRPC and the memory service are real.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=96, block_size=4)
    yield s
    await s.stop()


def _break_request(engine, method: str, victim: str, after_calls: int = 2):
    """Make engine.completions.<method> raise for the victim request from its Nth call on."""
    engine = engine.completions
    real = getattr(engine, method)
    calls = {"n": 0}

    def broken(seq, *args):
        if seq.request.request_id == victim:
            calls["n"] += 1
            if calls["n"] > after_calls:
                raise RuntimeError("injected bug")
        return real(seq, *args)

    setattr(engine, method, broken)
    return lambda: setattr(engine, method, real)


@pytest.mark.parametrize("kind", ["greedy", "n2"])
async def test_one_request_bug_leaves_the_others_streaming(stack, oracle, kind):
    engine = stack.gateway.engine
    victim = f"victim-{kind}"
    restore = _break_request(engine, "accept" if kind == "greedy" else "fan_out", victim,
                             after_calls=2 if kind == "greedy" else 0)
    others = [[40 + i, 41, 42, 43, 44 + i] for i in range(3)]
    extra = {"n": 2, "temperature": 0.8, "seed": 7} if kind == "n2" else {}
    try:
        victim_call = asyncio.ensure_future(generate(stack.gw, [9, 8, 7, 6], max_tokens=12, ignore_eos=True,
                                                     request_id=victim, **extra))
        results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=12, ignore_eos=True) for p in others))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await victim_call
    finally:
        restore()
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert victim in err.value.details()
    for p, res in zip(others, results):
        assert res[0][0] == oracle.greedy(p, 12, min_new_tokens=12)
    await stack.wait_idle()


async def test_one_beam_search_bug_leaves_the_others_streaming(stack, oracle):
    engine = stack.gateway.engine
    real = engine.beams._advance
    victim = "victim-beam"

    def broken(req, state):
        if req.request_id == victim:
            raise RuntimeError("injected bug")
        return real(req, state)

    engine.beams._advance = broken
    try:
        victim_call = asyncio.ensure_future(generate(stack.gw, [9, 8, 7, 6], max_tokens=6, beam_width=2,
                                                     request_id=victim))
        ok = await generate(stack.gw, [5, 6, 7, 8, 9], max_tokens=8, ignore_eos=True)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await victim_call
    finally:
        engine.beams._advance = real
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert ok[0][0] == oracle.greedy([5, 6, 7, 8, 9], 8, min_new_tokens=8)
    await stack.wait_idle()
