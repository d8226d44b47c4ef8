"""Every bad request gets its status code before anything is allocated."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

from kvpager.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvpager_tools.demo_model import build_demo_model

    return str(build_demo_model(tmp_path_factory.mktemp("gwv") / "demo", vocab_size=320,
                                max_position_embeddings=128))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=64, block_size=4, max_waiting=3, max_n=4)
    yield s
    await s.stop()


S = grpc.StatusCode


def req(ids=(1, 2, 3), prompt="", **sp):
    sp.setdefault("max_tokens", 4)
    return gateway_pb2.GenerateRequest(prompt_token_ids=list(ids), prompt=prompt,
                                       sampling_params=common_pb2.SamplingParams(**sp))


CASES = [
    ("empty prompt", req(ids=()), S.INVALID_ARGUMENT),
    ("empty text prompt", req(ids=(), prompt=""), S.INVALID_ARGUMENT),
    ("both prompt and ids", req(ids=(1,), prompt="hi"), S.INVALID_ARGUMENT),
    ("prompt at context limit", req(ids=[1] * 128), S.INVALID_ARGUMENT),
    ("prompt + max_tokens over limit", req(ids=[1] * 100, max_tokens=29), S.INVALID_ARGUMENT),
    ("min_tokens above the rest of the context (max_tokens 0)", req(ids=[1] * 120, max_tokens=0, min_tokens=9),
     S.INVALID_ARGUMENT),
    ("presence penalty out of range", req(presence_penalty=2.5), S.INVALID_ARGUMENT),
    ("nan frequency penalty", req(frequency_penalty=math.nan), S.INVALID_ARGUMENT),
    ("negative repetition penalty", req(repetition_penalty=-1.0), S.INVALID_ARGUMENT),
    ("min_p above 1", req(min_p=1.5), S.INVALID_ARGUMENT),
    ("logit bias outside the vocabulary", req(logit_bias={100000: 1.0}), S.INVALID_ARGUMENT),
    ("logit bias above 100", req(logit_bias={5: 101.0}), S.INVALID_ARGUMENT),
    ("top_logprobs above 20", req(logprobs=1, top_logprobs=21), S.INVALID_ARGUMENT),
    ("beam search with a penalty", req(beam_width=2, repetition_penalty=1.2), S.INVALID_ARGUMENT),
    ("negative temperature", req(temperature=-0.5), S.INVALID_ARGUMENT),
    ("nan temperature", req(temperature=math.nan), S.INVALID_ARGUMENT),
    ("inf temperature", req(temperature=math.inf), S.INVALID_ARGUMENT),
    ("top_p above 1", req(top_p=1.5), S.INVALID_ARGUMENT),
    ("negative top_p", req(top_p=-0.1), S.INVALID_ARGUMENT),
    ("top_k below -1", req(top_k=-2), S.INVALID_ARGUMENT),
    ("n above cap", req(n=5), S.INVALID_ARGUMENT),
    ("beam above cap", req(beam_width=9), S.INVALID_ARGUMENT),
    ("token id outside vocabulary", req(ids=(1, 100000)), S.INVALID_ARGUMENT),
    ("negative token id", req(ids=(1, -4)), S.INVALID_ARGUMENT),
    ("empty stop string", req(stop=["ok", ""]), S.INVALID_ARGUMENT),
    ("stop token outside vocabulary", req(stop_token_ids=[99999]), S.INVALID_ARGUMENT),
    ("oversize message", req(ids=(), prompt="x" * (17 * 2**20)), S.RESOURCE_EXHAUSTED),
]


@pytest.mark.parametrize("name,request_,code", CASES, ids=[c[0] for c in CASES])
async def test_bad_request_status_and_no_leak(stack, name, request_, code):
    before = await stack.accounting()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stack.gw.Generate(request_, timeout=30):
            pass
    assert err.value.code() == code, err.value.details()
    assert err.value.details()
    after = await stack.accounting()
    assert (after.used_blocks, after.num_sequences) == (before.used_blocks, before.num_sequences) == (0, 0)
    assert not stack.gateway.engine.requests
    # the service is still fine
    res = await generate(stack.gw, [3, 4, 5], max_tokens=2, ignore_eos=True)
    assert len(res[0][0]) == 2


async def test_max_tokens_0_is_the_rest_of_the_context(stack):
    """proto3's unset max_tokens generates until the context is full (128 here)."""
    res = await generate(stack.gw, [5] * 120, max_tokens=0, ignore_eos=True)
    tokens, _, finish, usage = res[0]
    assert len(tokens) == 8 and finish == common_pb2.FINISH_REASON_LENGTH
    assert usage.prompt_tokens + usage.completion_tokens == 128
    await stack.wait_idle()


async def test_queue_full_is_resource_exhausted_with_retry_hint(stack):
    long = [asyncio.ensure_future(generate(stack.gw, [7, 8, 9 + i], max_tokens=100, ignore_eos=True))
            for i in range(3)]
    while len(stack.gateway.engine.requests) < 3:
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stack.gw, [1, 2], max_tokens=2)
    assert err.value.code() == S.RESOURCE_EXHAUSTED
    assert dict(err.value.trailing_metadata()).get("retry-after-s")
    for r in await asyncio.gather(*long):
        assert len(r[0][0]) == 100  # the queued requests were not harmed
    await stack.wait_idle()


async def test_model_info(stack):
    info = await stack.gw.GetModelInfo(gateway_pb2.GetModelInfoRequest())
    assert info.max_model_len == 128 and info.vocab_size > 0 and info.num_executors == 1
    assert info.block_size == 4 and info.max_n == 4 and list(info.eos_token_ids)
