"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client
(and plain httpx for the SSE bytes and error bodies) against the real stack
on the demo model: models, completions and chat, streaming and not, n = 2
with a seed, stop strings, logprobs, usage with cached tokens, echo,
tokenize, health, metrics — every block back afterwards."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "test-api-key"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=96, block_size=4, max_waiting=6, http={"api_key": KEY})
    yield s
    await s.stop()


@pytest.fixture
def client(stack):
    return openai.AsyncOpenAI(base_url=stack.gateway.http_url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def name(stack):
    return stack.gateway.http_context.served_model_name


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


async def test_models_lists_the_served_model(client, stack, name, model):
    models = await client.models.list()
    [card] = models.data
    assert card.id == name == model.rstrip("/").rsplit("/", 1)[-1]
    assert card.model_extra["max_model_len"] == stack.gateway.engine.limits.max_model_len == 256
    assert (await client.models.retrieve(name)).id == name


async def test_completion_is_the_grpc_generation(client, stack, name):
    prompt = "Once upon a time"
    res = await client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    grpc_out = await generate(stack.gw, prompt=prompt, max_tokens=8, ignore_eos=True, skip_special_tokens=True)
    [choice] = res.choices
    assert choice.text == grpc_out[0][1] and choice.finish_reason == "length" and choice.index == 0
    ids = stack.gateway.tokenizer.encode(prompt)
    assert res.usage.prompt_tokens == len(ids) and res.usage.completion_tokens == 8
    assert res.usage.total_tokens == len(ids) + 8 and res.object == "text_completion" and res.model == name
    # the default max_tokens is OpenAI's 16; token-id prompts and echo
    res = await client.completions.create(model=name, prompt=ids, temperature=0, echo=True,
                                          extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 16 and res.choices[0].text.startswith(prompt)
    await stack.wait_idle()


async def test_streamed_completion_and_chat_match_unstreamed(client, stack, name):
    kw = dict(model=name, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = await client.completions.create(prompt="The scientist", **kw)
    chunks = [c async for c in await client.completions.create(prompt="The scientist", stream=True,
                                                                 stream_options={"include_usage": True}, **kw)]
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    chat = await client.chat.completions.create(messages=messages, **kw)
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    stream = [c async for c in await client.chat.completions.create(messages=messages, stream=True, **kw)]
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in stream)
    # the chat template rendered the messages (the demo checkpoint ships one)
    rendered = stack.gateway.http_context.chat.render(messages)
    assert rendered.endswith("user: What is the capital?\nassistant:")
    assert chat.usage.prompt_tokens == len(stack.gateway.tokenizer.encode(rendered, add_special_tokens=False))
    await stack.wait_idle()


async def test_n2_with_a_seed_is_reproducible_and_chat_n2_streams_both(client, stack, name):
    kw = dict(model=name, prompt="Hello, world!", max_tokens=8, n=2, seed=42, temperature=1.0)
    a, b = await client.completions.create(**kw), await client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1] and a.choices[0].text != a.choices[1].text
    assert a.usage.prompt_tokens == len(stack.gateway.tokenizer.encode("Hello, world!"))  # once, not per choice
    assert 2 <= a.usage.completion_tokens <= 16
    stream = [c async for c in await client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, seed=7, stream=True)]
    roles = [c.choices[0].index for c in stream if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    finishes = {c.choices[0].index for c in stream if c.choices[0].finish_reason}
    assert finishes == {0, 1}
    # several prompts: choices prompt_index * n + i
    res = await client.completions.create(model=name, prompt=["one", "two"], max_tokens=3, n=2, seed=1)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    await stack.wait_idle()


async def test_stop_strings_cut_the_text(client, stack, name):
    kw = dict(model=name, prompt="Count from one to ten.", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = (await client.completions.create(**kw)).choices[0].text
    stop = full[3:5]
    cut = (await client.completions.create(stop=[stop, "never-here"], **kw)).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]
    await stack.wait_idle()


async def test_logprobs_top_n_with_the_sampled_token(client, stack, name):
    res = await client.completions.create(model=name, prompt="The quick brown fox", max_tokens=5, temperature=0,
                                          logprobs=3, extra_body={"ignore_eos": True})
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and top[tok] == pytest.approx(value)  # the sampled token's, always
        assert max(top.values()) == pytest.approx(value)  # greedy: the top-1
        assert value <= 0
    chat = await client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode())
    await stack.wait_idle()


async def test_usage_reports_cached_tokens_on_a_repeated_prompt(client, stack, name):
    prompt = list(range(40, 100))  # 15 full blocks of 4
    first = await client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    second = await client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 56  # 14 blocks: the last token is recomputed
    await stack.wait_idle()


async def test_penalties_and_bias_over_http_are_the_engine_s(client, stack, name, oracle):
    ids = [17, 30, 44, 30, 91, 17, 120, 5]
    res = await client.completions.create(model=name, prompt=ids, max_tokens=8, temperature=0,
                                          extra_body={"repetition_penalty": 1.8})
    want = oracle.greedy(ids, 8, repetition_penalty=1.8)
    assert res.choices[0].text == stack.gateway.tokenizer.decode(want, skip_special_tokens=True)
    word = stack.gateway.tokenizer.encode(" the", add_special_tokens=False)[-1]
    biased = await client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0,
                                             logit_bias={str(word): 30}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == stack.gateway.tokenizer.decode([word] * 4)
    await stack.wait_idle()


async def test_sse_bytes_as_the_clients_parse_them(stack, name):
    async with httpx.AsyncClient(base_url=stack.gateway.http_url, headers=auth(), timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    bodies = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert bodies[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert bodies[-2]["choices"][0]["finish_reason"] == "length" and bodies[-1]["choices"] == []
    assert bodies[-1]["usage"]["completion_tokens"] == 3
    assert {b["id"] for b in bodies} == {bodies[0]["id"]} and bodies[0]["object"] == "chat.completion.chunk"
    await stack.wait_idle()


async def test_tokenize_detokenize_health_metrics_version(stack, name):
    async with httpx.AsyncClient(base_url=stack.gateway.http_url, headers=auth(), timeout=30) as http:
        r = (await http.post("/tokenize", json={"model": name, "prompt": "Hello, world!"})).json()
        assert r["tokens"] == stack.gateway.tokenizer.encode("Hello, world!") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 256
        messages = [{"role": "user", "content": "hi"}]
        chat = (await http.post("/tokenize", json={"messages": messages})).json()
        rendered = stack.gateway.http_context.chat.render(messages)
        assert chat["tokens"] == stack.gateway.tokenizer.encode(rendered, add_special_tokens=False)
        back = (await http.post("/detokenize", json={"model": name, "tokens": r["tokens"]})).json()
        assert back == {"prompt": "Hello, world!"}
        assert (await http.get("/health")).status_code == 200
        metrics = (await http.get("/metrics")).text
        assert "kvpager_gateway_http_requests_total" in metrics and "kvpager_gateway_requests_in_flight" in metrics
        assert (await http.get("/version")).json()["version"]
        # open without the key: health, metrics, version; not the API
        assert (await httpx.AsyncClient(base_url=stack.gateway.http_url).get("/health")).status_code == 200


async def test_client_disconnect_mid_stream_frees_the_blocks(stack, name):
    before = await stack.accounting()
    async with httpx.AsyncClient(base_url=stack.gateway.http_url, headers=auth(), timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json={
                "model": name, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            seen = 0
            async for _ in r.aiter_lines():
                seen += 1
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
        assert len(stack.gateway.engine.requests) <= 1
    t = await stack.wait_idle(timeout_s=5)
    assert t.used_blocks == before.used_blocks == 0 and not stack.gateway.engine.requests
    # a client that gives up on a non-streamed request aborts it too: it waits half
    # of what 64 tokens take here, for 240 (a fixed 0.1 s had a 4x margin on a fast machine)
    async with httpx.AsyncClient(base_url=stack.gateway.http_url, headers=auth(), timeout=30) as http:
        t0 = asyncio.get_running_loop().time()
        r = await http.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 64,
                                                     "ignore_eos": True})
        assert r.status_code == 200
        wait = (asyncio.get_running_loop().time() - t0) / 2
    async with httpx.AsyncClient(base_url=stack.gateway.http_url, headers=auth(), timeout=wait) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 240,
                                                     "ignore_eos": True})
    await stack.wait_idle(timeout_s=5)
    assert not stack.gateway.engine.requests


async def test_chat_without_a_template_is_a_400_that_says_so(client, stack, name, tmp_path):
    chat = stack.gateway.http_context.chat
    saved, chat.template = chat.template, None
    try:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        assert "no chat template" in err.value.message and "--chat-template" in err.value.message
    finally:
        chat.template = saved
    # --chat-template FILE overrides the tokenizer's
    from gateway.http.chat import ChatTemplate

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    assert ChatTemplate(stack.gateway.tokenizer, str(path)).render([{"role": "user", "content": "hi"}]) == "[user] hi"


async def test_concurrent_streams_each_complete_or_get_429(stack, name):
    """A small version of `kvpager drill http-load`: more streams than the queue takes."""
    from kvpager_tools.drills.http_load import run_streams

    result = await run_streams(stack.gateway.http_url, name, num_requests=24, max_tokens=6, api_key=KEY)
    assert result["completed"] + result["rejected_429"] == 24 and result["completed"] >= 6
    assert result["server_errors"] == 0 and result["other_errors"] == 0 and result["rejected_429"] > 0
    await stack.wait_idle(timeout_s=10)
