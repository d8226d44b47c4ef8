"""The whole stack over loopback gRPC: token-exact against transformers'
generate, prefix hits, preemption by both modes, n>1, beam search,
cancellation — every block back afterwards."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

from kvpager.v1 import gateway_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=128, block_size=4)
    yield s
    await s.stop()


def ragged_prompts(n: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


async def test_ragged_prompts_match_generate(stack, oracle):
    prompts = ragged_prompts(6)
    results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=10) for p in prompts))
    for p, res in zip(prompts, results):
        tokens, _, finish, usage = res[0]
        assert tokens == oracle.greedy(p, 10), p
        assert usage.prompt_tokens == len(p) and usage.completion_tokens == len(tokens)
        assert finish in (gateway_pb2.GenerateResponse.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
                          .values_by_name["FINISH_REASON_STOP"].number,
                          gateway_pb2.GenerateResponse.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
                          .values_by_name["FINISH_REASON_LENGTH"].number)
    await stack.wait_idle()


async def test_text_prompt_streams_text(stack, oracle):
    res = await generate(stack.gw, prompt="The quick brown fox", max_tokens=6, ignore_eos=True)
    tokens, text, _, usage = res[0]
    ids = stack.gateway.tokenizer.encode("The quick brown fox")
    assert tokens == oracle.greedy(ids, 6, min_new_tokens=6)
    assert text == stack.gateway.tokenizer.decode(tokens)
    assert usage.prompt_tokens == len(ids)
    await stack.wait_idle()


async def test_shared_system_prompt_second_wave_hits_cache(stack, oracle):
    system = list(range(100, 132))  # 8 full blocks of 4
    wave = [system + [7 + i, 9, 11] for i in range(3)]
    first = await asyncio.gather(*(generate(stack.gw, p, max_tokens=4, cache_salt="sys") for p in wave[:1]))
    rest = await asyncio.gather(*(generate(stack.gw, p, max_tokens=4, cache_salt="sys") for p in wave[1:]))
    assert first[0][0][3].cached_prompt_tokens == 0
    for p, res in zip(wave[1:], rest):
        tokens, _, _, usage = res[0]
        assert usage.cached_prompt_tokens == len(system)
        assert tokens == oracle.greedy(p, 4)
    # another tenant's salt never shares those blocks
    other = await generate(stack.gw, wave[2], max_tokens=4, cache_salt="other-tenant")
    assert other[0][3].cached_prompt_tokens == 0
    t = await stack.wait_idle()
    assert t.prefix_hit_tokens >= 2 * len(system)


async def test_parallel_sampling_n4_shares_prompt_and_each_matches_its_seed(stack):
    prompt = list(range(50, 75))
    res = await generate(stack.gw, prompt, max_tokens=8, n=4, temperature=0.9, seed=1234, ignore_eos=True)
    assert sorted(res) == [0, 1, 2, 3]
    for i in range(4):
        alone = await generate(stack.gw, prompt, max_tokens=8, temperature=0.9, seed=1234 + i, ignore_eos=True)
        assert res[i][0] == alone[0][0], f"completion {i}"
    assert len({tuple(res[i][0]) for i in range(4)}) > 1
    t = await stack.wait_idle()
    assert t.copy_on_write_copies >= 3  # three children diverged inside the shared partial block


@pytest.mark.parametrize("k", [2, 4])
async def test_beam_search_matches_generate_and_beams_share_blocks(stack, oracle, k):
    prompt = [11, 23, 35, 47, 59, 61, 73]
    watcher_max = 0

    async def watch():
        nonlocal watcher_max
        while True:
            t = await stack.accounting()
            watcher_max = max(watcher_max, t.sharing_saved_blocks)
            await asyncio.sleep(0.005)

    task = asyncio.get_running_loop().create_task(watch())
    try:
        res = await generate(stack.gw, prompt, max_tokens=16, beam_width=k)
    finally:
        task.cancel()
    assert res[0][0] == oracle.beams(prompt, 16, k)
    assert watcher_max > 0, "beams never shared a block"
    await stack.wait_idle()


async def test_cancel_mid_stream_returns_every_block(stack):
    prompts = ragged_prompts(4, seed=3)
    calls = [stack.gw.Generate(gateway_pb2.GenerateRequest(
        prompt_token_ids=p, sampling_params=dict(max_tokens=200, ignore_eos=True))) for p in prompts]
    for call in calls:  # read a couple of tokens, then hang up
        got = 0
        async for r in call:
            got += len(r.token_ids)
            if got >= 2:
                break
        call.cancel()
    await stack.wait_idle(10)


async def test_abort_rpc_ends_stream_with_abort(stack):
    call = stack.gw.Generate(gateway_pb2.GenerateRequest(
        request_id="to-abort", prompt_token_ids=[5, 6, 7], sampling_params=dict(max_tokens=200, ignore_eos=True)))
    finish = None
    async for r in call:
        if finish is None and r.token_ids:
            found = await stack.gw.Abort(gateway_pb2.AbortRequest(request_id="to-abort"))
            assert found.found
            finish = -1
        if r.finish_reason:
            finish = r.finish_reason
    assert finish == 3  # FINISH_REASON_ABORT
    assert not (await stack.gw.Abort(gateway_pb2.AbortRequest(request_id="to-abort"))).found
    await stack.wait_idle()


async def test_deadline_frees_blocks(stack):
    # The deadline must land mid-generation on any machine (a fixed 0.3 s let
    # a fast one finish 240 tokens first): 1.5 times what 64 tokens take
    # (their first token included), for a request of 250 (the model's context
    # is 256).
    t0 = asyncio.get_running_loop().time()
    await generate(stack.gw, [1, 2, 3, 4], max_tokens=64, ignore_eos=True)
    deadline = 1.5 * (asyncio.get_running_loop().time() - t0)
    call = stack.gw.Generate(gateway_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3, 4], sampling_params=dict(max_tokens=250, ignore_eos=True)), timeout=deadline)
    got = 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for r in call:
            got += len(r.token_ids)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < got < 250  # it held blocks when the deadline passed
    await stack.wait_idle(10)
