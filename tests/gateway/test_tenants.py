"""Tenants end to end on the real stack: the tenant is the authenticated
token's, the body's cache_salt only narrows it, two tenants with the same
prompt never hit each other's blocks (and one tenant does hit its own),
and a tenant flooding the pool waits at its quota while another is served."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

from kvpager.channel import make_channel
from kvpager.v1 import gateway_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENS = {"alice": "alice-secret-1", "bob": "bob-secret-22"}
PROMPT = [5 + i % 50 for i in range(24)]  # 6 full blocks of 4


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=32, block_size=4, max_batch_tokens=64, http={},
                          gateway_kw={"tenant_tokens": {t: n for n, t in TOKENS.items()}},
                          memory_kw={"tenant_max_blocks": 0.5})
    channels = {n: make_channel(s.gateway.address, token=t) for n, t in TOKENS.items()}
    s.as_tenant = {n: gateway_pb2_grpc.GatewayStub(ch) for n, ch in channels.items()}
    yield s
    for ch in channels.values():
        await ch.close()
    await s.stop()


async def cached(stub, prompt, **kw) -> int:
    out = await generate(stub, prompt, max_tokens=2, ignore_eos=True, **kw)
    return out[0][3].cached_prompt_tokens


async def test_a_tenant_hits_its_own_prefix_and_never_anothers(stack):
    alice, bob = stack.as_tenant["alice"], stack.as_tenant["bob"]
    assert await cached(alice, PROMPT) == 0
    await stack.wait_idle()
    assert await cached(alice, PROMPT) == 20          # its own blocks (the last token is always computed)
    assert await cached(bob, PROMPT) == 0             # the same prompt, another tenant: no hit
    # bob cannot name alice's namespace: the salt narrows bob's own
    for salt in ("alice", "tenant:5:alice:", "", "x"):
        assert await cached(bob, PROMPT, cache_salt=salt) == (20 if salt == "" else 0), salt
    assert await cached(alice, PROMPT, cache_salt="x") == 0   # alice's own narrower namespace: a fresh one
    await stack.wait_idle()


async def test_no_tenant_token_no_service(stack):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stack.gw, PROMPT, max_tokens=2)
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_a_flooding_tenant_waits_at_its_quota_while_another_is_served(stack):
    alice, bob = stack.as_tenant["alice"], stack.as_tenant["bob"]
    # alice's quota is 16 of 32 blocks; her 8 requests want 8 x 10 = 80
    flood = [asyncio.ensure_future(generate(alice, [100 + i] * 12, max_tokens=28, ignore_eos=True, cache_salt="f"))
             for i in range(8)]
    kv = stack.memory.state.manager.executors["executor-0"]
    seqs = stack.memory.state.manager.seqs

    def alice_holds() -> int:
        return len({b for s in list(kv.seq_ids) if seqs[s].tenant == "alice" for b in seqs[s].block_ids})

    # Blocks held are watched for the flood's whole life (a fixed 0.3 s wait
    # found a fast machine done with all eight).
    peak = 0

    async def watch():
        nonlocal peak
        while not all(f.done() for f in flood):
            peak = max(peak, alice_holds())
            await asyncio.sleep(0.002)

    watcher = asyncio.ensure_future(watch())
    while not alice_holds():
        await asyncio.sleep(0.002)
    out = await generate(bob, [7] * 12, max_tokens=8, ignore_eos=True)   # served while alice floods
    assert len(out[0][0]) == 8
    assert not all(f.done() for f in flood)
    for res in await asyncio.gather(*flood):
        assert len(res[0][0]) == 28
    await watcher
    assert 0 < peak <= 16
    # a request that alone is over the quota is refused, and nothing leaks
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(bob, [9] * 40, max_tokens=40, ignore_eos=True)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in e.value.details()
    await stack.wait_idle()


async def test_retention_requested_by_a_request_pins_its_prompt(stack):
    from kvpager.v1 import common_pb2, gateway_pb2
    from kvpager_tools.generate import stream_generate

    alice = stack.as_tenant["alice"]
    prompt = [200 + i for i in range(17)]  # 4 full blocks
    req = gateway_pb2.GenerateRequest(prompt_token_ids=prompt, retention_s=60.0, cache_salt="pin",
                                      sampling_params=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True))
    out = await stream_generate(alice, req, timeout_s=60)
    assert out.status == "OK"
    t = await stack.wait_idle()
    assert t.pinned_blocks >= 4
    bad = gateway_pb2.GenerateRequest(prompt_token_ids=prompt, retention_s=-1.0,
                                      sampling_params=common_pb2.SamplingParams(max_tokens=2))
    out = await stream_generate(alice, bad, timeout_s=60, raise_errors=False)
    assert out.status == "INVALID_ARGUMENT" and "retention_s" in out.details


async def test_over_http_the_api_key_is_the_tenant(stack):
    import openai

    name = stack.gateway.http_context.served_model_name
    prompt = [250 + i for i in range(21)]  # 5 full blocks

    async def cached_of(key, **extra) -> int:
        client = openai.AsyncOpenAI(base_url=stack.gateway.http_url + "/v1", api_key=key, max_retries=0)
        res = await client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0,
                                              extra_body=extra)
        return res.usage.prompt_tokens_details.cached_tokens

    assert await cached_of(TOKENS["alice"]) == 0
    assert await cached_of(TOKENS["alice"]) == 20
    assert await cached_of(TOKENS["bob"]) == 0
    assert await cached_of(TOKENS["bob"], cache_salt="tenant:5:alice:") == 0
    with pytest.raises(openai.AuthenticationError):
        await cached_of("not-a-tenant-token")
    await stack.wait_idle()
