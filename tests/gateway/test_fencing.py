"""A gateway another one replaced is fenced (gateway/engine.py ``_fence``).

Step ids start from a gateway's clock, so a gateway started later steps the
memory service with ids ahead of an older one's; the memory service refuses
an older id (ABORTED). The older gateway must then stop at once, say why,
and leave nothing behind: before, it took the refusal for a lost memory
service, rewound its streams again and again, and ended them only after the
recovery timeout with a generic message, its health still SERVING."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
from gateway_harness import generate, start_stack
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpager.channel import make_channel
from kvpager.v1 import common_pb2, gateway_pb2, memory_pb2
from kvpager_tools.generate import stream_generate

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _fenced_gauge() -> float:
    from gateway.metrics import REGISTRY

    return REGISTRY.get_sample_value("kvpager_gateway_fenced")


async def _health(address: str) -> int:
    async with make_channel(address) as channel:
        return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def test_a_replaced_gateway_ends_its_streams_at_once_says_why_and_frees_their_blocks(model):
    import openai

    s = await start_stack(model, executors=1, num_blocks=96, block_size=4, http={})
    try:
        assert _fenced_gauge() == 0
        assert len((await generate(s.gw, [5, 6, 7], max_tokens=4, ignore_eos=True))[0][0]) == 4  # serving
        started = asyncio.Event()
        sp = common_pb2.SamplingParams(max_tokens=150, ignore_eos=True)
        stream = asyncio.ensure_future(stream_generate(
            s.gw, gateway_pb2.GenerateRequest(prompt_token_ids=list(range(40, 70)), sampling_params=sp),
            timeout_s=120, raise_errors=False, on_chunk=lambda *_: started.set()))
        await asyncio.wait_for(started.wait(), 60)
        assert (await s.accounting()).num_sequences == 1

        # Another gateway's Step: its ids come from a later clock.
        t0 = time.perf_counter()
        await s.mem.Step(memory_pb2.StepRequest(step_id=s.gateway.engine._step_id + (10**6 << 8)))
        out = await stream
        assert out.status == "UNAVAILABLE", (out.status, out.details)
        assert "fenced" in out.details and "another gateway" in out.details
        assert time.perf_counter() - t0 < 10  # not after the recovery timeout (30 s)
        assert 0 < sum(len(c) for c in out.tokens.values()) < 150

        # Its sequences are freed at the memory service: nothing leaks to the other gateway.
        await s.wait_idle()
        assert _fenced_gauge() == 1

        # New requests are refused at once with the reason, on both front doors.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(s.gw, [5, 6, 7], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "fenced" in err.value.details()
        client = openai.AsyncOpenAI(base_url=s.gateway.http_url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as http_err:
            await client.completions.create(model=s.gateway.engine.model_id, prompt="hello", max_tokens=4)
        assert http_err.value.status_code == 503 and "fenced" in http_err.value.message
        await client.close()
        async with httpx.AsyncClient() as http:
            health = await http.get(s.gateway.http_url + "/health")
        assert health.status_code == 503 and "fenced" in health.text
        for _ in range(50):  # the readiness watch polls every 0.1 s
            if await _health(s.gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.1)
        assert await _health(s.gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING

        # The memory service kept serving the newer writer: its ids are accepted, ours are not.
        await s.mem.Step(memory_pb2.StepRequest(step_id=s.gateway.engine._step_id + (10**6 << 8) + 1))
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await s.mem.Step(memory_pb2.StepRequest(step_id=s.gateway.engine._step_id + 1))
        assert stale.value.code() == grpc.StatusCode.ABORTED
        assert "another gateway" in stale.value.details()
    finally:
        await s.stop()


async def test_an_idle_gateway_learns_it_was_replaced_from_the_registry_listing(model):
    """No request needed: the memory service's listing carries its last step,
    so an idle replaced gateway turns NOT_SERVING within a refresh (a load
    balancer stops sending it clients)."""
    s = await start_stack(model, executors=1, num_blocks=32, block_size=4, executor_refresh_s=0.2)
    try:
        assert await _health(s.gateway.address) == health_pb2.HealthCheckResponse.SERVING
        listing = await s.mem.ListExecutors(memory_pb2.ListExecutorsRequest())
        assert listing.last_step_id <= s.gateway.engine._step_id  # none, or our own
        ahead = s.gateway.engine._step_id + (10**6 << 8)
        await s.mem.Step(memory_pb2.StepRequest(step_id=ahead))
        assert (await s.mem.ListExecutors(memory_pb2.ListExecutorsRequest())).last_step_id == ahead
        for _ in range(50):
            if s.gateway.engine.fenced:
                break
            await asyncio.sleep(0.1)
        assert "another gateway" in s.gateway.engine.fenced
        assert _fenced_gauge() == 1
        for _ in range(50):
            if await _health(s.gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.1)
        assert await _health(s.gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(s.gw, [5, 6, 7], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "fenced" in err.value.details()
    finally:
        await s.stop()
