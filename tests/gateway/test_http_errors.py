"""Every error of the HTTP API: OpenAI's JSON shape, the status a client
expects (400 for every invalid parameter, with gRPC's messages; 401, 404,
413, 429, 503), never a 500 for a bad request, nothing allocated or left
behind."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

from kvpager.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "errors-key"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=64, block_size=4, max_waiting=3, max_n=4, http={"api_key": KEY},
                          gateway_kw={"max_message_bytes": 1 << 20})
    yield s
    await s.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http(stack):
    async with httpx.AsyncClient(base_url=stack.gateway.http_url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=60) as client:
        yield client


def client(stack, key: str | None = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway.http_url + "/v1", api_key=key or "none", max_retries=0)


def _shape(body: dict, status: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 429 else
                           "rate_limit_error" if status == 429 else "server_error")
    return err


C = "/v1/completions"
H = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD = [  # (name, path, body, the param named)
    ("negative temperature", C, {"prompt": "x", "temperature": -1}, "temperature"),
    ("temperature not a number", C, {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("top_p 0", C, {"prompt": "x", "top_p": 0}, "top_p"),
    ("top_p above 1", C, {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("n 0", C, {"prompt": "x", "n": 0}, "n"),
    ("n above the cap", C, {"prompt": "x", "n": 99}, "n"),
    ("max_tokens 0", C, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("max_tokens past the context", C, {"prompt": "x", "max_tokens": 300}, "max_tokens"),
    ("max_tokens not an integer", C, {"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ("empty prompt", C, {"prompt": ""}, "prompt"),
    ("empty prompt list", C, {"prompt": []}, "prompt"),
    ("mixed prompt list", C, {"prompt": ["a", 3]}, "prompt"),
    ("no prompt", C, {"max_tokens": 2}, "prompt"),
    ("prompt at the context limit", C, {"prompt": [5] * 256}, "prompt"),
    ("token id outside the vocabulary", C, {"prompt": [1, 99999]}, "prompt"),
    ("logit_bias key not a token id", C, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias outside the vocabulary", C, {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("logit_bias above 100", C, {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ("presence_penalty above 2", C, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("frequency_penalty below -2", C, {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("repetition_penalty 0", C, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("min_p above 1", C, {"prompt": "x", "min_p": 2}, "min_p"),
    ("logprobs above 20", C, {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("empty stop string", C, {"prompt": "x", "stop": [""]}, "stop"),
    ("stop not a string", C, {"prompt": "x", "stop": 5}, "stop"),
    ("stop token outside the vocabulary", C, {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("top_k below -1", C, {"prompt": "x", "top_k": -2}, "top_k"),
    ("min_tokens above max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("seed not an integer", C, {"prompt": "x", "seed": "x"}, "seed"),
    ("priority not an integer", C, {"prompt": "x", "priority": "high"}, "priority"),
    ("stream_options without stream", C, {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("suffix", C, {"prompt": "x", "suffix": "y"}, "suffix"),
    ("best_of above n", C, {"prompt": "x", "best_of": 3}, "best_of"),
    ("echo with logprobs", C, {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("no messages", H, {"max_tokens": 2}, "messages"),
    ("empty messages", H, {"messages": []}, "messages"),
    ("a message without a role", H, {"messages": [{"content": "x"}]}, "messages"),
    ("an image part", H, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ("top_logprobs without logprobs", H, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs above 20", H, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("logprobs not a boolean", H, {"messages": MSG, "logprobs": 3}, "logprobs"),
    ("tools", H, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("json response format", H, {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format"),
    ("max_completion_tokens 0", H, {"messages": MSG, "max_completion_tokens": 0}, "max_tokens"),
    ("streamed bad temperature", H, {"messages": MSG, "stream": True, "temperature": -3}, "temperature"),
    ("tokenize with neither", "/tokenize", {"model": None}, "prompt"),
    # What one request may ask (issue 20): refused before tokenizing or matching.
    ("text prompt over max_prompt_bytes", C, {"prompt": "ab " * 30_000}, "prompt"),
    ("prompts over max_prompt_bytes together", C, {"prompt": ["ab " * 12_000] * 3}, "prompt"),
    ("chat messages over max_prompt_bytes", H, {"messages": [{"role": "user", "content": "ab " * 30_000}]},
     "messages"),
    ("tokenize over max_prompt_bytes", "/tokenize", {"prompt": "ab " * 30_000}, "prompt"),
    ("65 stop strings", C, {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("stop strings over 4096 bytes", C, {"prompt": "x", "stop": ["y" * 4097]}, "stop"),
    ("1025 stop token ids", C, {"prompt": "x", "stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ("cache_salt over 256 bytes", C, {"prompt": "x", "cache_salt": "s" * 257}, "cache_salt"),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [99999]}, "tokens"),
]


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
async def test_every_bad_parameter_is_a_400_and_leaves_nothing(stack, http, name, path, body, param):
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = _shape(r.json(), 400)
    assert err["param"] == param, err
    t = await stack.accounting()
    assert (t.used_blocks, t.num_sequences) == (0, 0) and not stack.gateway.engine.requests


async def test_malformed_bodies_are_400(http):
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = await http.post(C, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (content, r.text)
        _shape(r.json(), 400)


async def test_the_messages_are_grpc_s(stack, http):
    """The same validation, the same words, on both APIs."""
    cases = [({"temperature": -1.0}, {"temperature": -1.0}), ({"top_k": -2}, {"top_k": -2}),
             ({"min_p": 1.5}, {"min_p": 1.5}), ({"logit_bias": {"99999": 1.0}}, {"logit_bias": {99999: 1.0}})]
    for body, sp in cases:
        r = await http.post(C, json={"prompt": [5, 6, 7], "max_tokens": 4, **body})
        req = gateway_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7],
                                          sampling_params=common_pb2.SamplingParams(max_tokens=4, **sp))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stack.gw.Generate(req):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert r.json()["error"]["message"] == err.value.details()


async def test_401_without_the_key(stack, http):
    for key in (None, "wrong"):
        with pytest.raises(openai.AuthenticationError) as err:
            await client(stack, key).models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as anonymous:
        r = await anonymous.post("/tokenize", json={"prompt": "x"})
        assert r.status_code == 401
        _shape(r.json(), 401)
        assert (await anonymous.get("/health")).status_code == 200


async def test_404_unknown_model_and_route(stack, http):
    with pytest.raises(openai.NotFoundError) as err:
        await client(stack).completions.create(model="gpt-unknown", prompt="x", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    r = await http.get("/v1/nothing-here")
    assert r.status_code == 404
    _shape(r.json(), 404)
    assert not stack.gateway.engine.requests


async def test_413_oversized_body(stack, http):
    r = await http.post(C, json={"prompt": "x" * (2 << 20)})
    assert r.status_code == 413
    assert _shape(r.json(), 413)["code"] == "request_too_large"
    assert not stack.gateway.engine.requests


async def test_429_when_the_queue_is_full(stack, http):
    long = [asyncio.ensure_future(generate(stack.gw, [7, 8, 9 + i], max_tokens=60, ignore_eos=True))
            for i in range(3)]
    while len(stack.gateway.engine.requests) < 3:
        await asyncio.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as err:
        await client(stack).completions.create(model=stack.gateway.http_context.served_model_name, prompt="x",
                                               max_tokens=2)
    assert err.value.response.headers["retry-after"] == "1"
    _shape(err.value.response.json(), 429)
    r = await http.post(C, json={"prompt": "x", "max_tokens": 2, "stream": True})  # streamed: the same status
    assert r.status_code == 429
    for res in await asyncio.gather(*long):
        assert len(res[0][0]) == 60  # the queued requests were not harmed
    await stack.wait_idle()


async def test_503_without_an_executor(model):
    from gateway.http.server import HttpConfig
    from gateway.service import GatewayConfig, GatewayServer
    from memory_service.service import MemoryConfig, MemoryServer

    memory = await MemoryServer(MemoryConfig(port=0)).start()
    gateway = await GatewayServer(GatewayConfig(model=model, memory_address=memory.address, port=0,
                                                http=HttpConfig(port=0))).start()
    try:
        async with httpx.AsyncClient(base_url=gateway.http_url) as http:
            assert (await http.get("/health")).status_code == 503
            r = await http.post(C, json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            _shape(r.json(), 503)
            assert (await http.get("/v1/models")).status_code == 200  # the model is still named
        with pytest.raises(openai.InternalServerError) as err:
            await openai.AsyncOpenAI(base_url=gateway.http_url + "/v1", api_key="x", max_retries=0
                                     ).chat.completions.create(model="demo", messages=MSG)
        assert err.value.status_code == 503
    finally:
        await gateway.stop(0)
        await memory.stop(0)
