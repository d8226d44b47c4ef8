"""Sampling parameters through the whole stack (gRPC): the repetition penalty
token-exact against transformers' generate, also on a prefix hit (the
executor gets the cached tokens once) and under chunked prefill; presence and
frequency penalties, logit bias, min_tokens; seeds reproducible with
penalties across batches."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack

from kvpager.v1 import common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [17, 30, 44, 30, 91, 17, 120, 5, 66, 200, 30, 14, 8]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=96, block_size=4, max_batch_tokens=8)  # 8: prefills in chunks
    yield s
    await s.stop()


async def test_repetition_penalty_matches_generate_fresh_and_on_a_prefix_hit(stack, oracle):
    want = oracle.greedy(PROMPT, 12, repetition_penalty=1.8)
    assert want != oracle.greedy(PROMPT, 12)  # the penalty changes the output
    first = await generate(stack.gw, PROMPT, max_tokens=12, repetition_penalty=1.8)
    again = await generate(stack.gw, PROMPT, max_tokens=12, repetition_penalty=1.8)
    assert first[0][0] == want and again[0][0] == want
    assert again[0][3].cached_prompt_tokens > 0  # the second one started on cached blocks
    await stack.wait_idle()
    # drops reach the executor with its next plan (as its tables'): then every history is forgotten
    await generate(stack.gw, [5, 6], max_tokens=1)
    assert len(stack.executors[0].executor.histories) == 0


async def test_presence_frequency_bias_and_min_tokens(stack):
    eos = min(stack.gateway.engine.eos_ids)
    # min_tokens masks EOS (even a strongly biased one) until the minimum is out
    res = await generate(stack.gw, PROMPT, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0})
    tokens, _, finish, _ = res[0]
    assert len(tokens) == 4 and tokens[3] == eos and eos not in tokens[:3]
    assert finish == common_pb2.FINISH_REASON_STOP
    # a bias decides greedy decoding; a frequency penalty then pushes the token out
    res = await generate(stack.gw, PROMPT, max_tokens=6, ignore_eos=True, logit_bias={250: 12.0})
    assert res[0][0] == [250] * 6
    res = await generate(stack.gw, PROMPT, max_tokens=6, ignore_eos=True, logit_bias={250: 12.0},
                         frequency_penalty=2.0, presence_penalty=2.0)
    assert res[0][0][0] == 250 and res[0][0].count(250) < 6
    await stack.wait_idle()


async def test_seeded_penalised_sampling_is_the_same_alone_and_in_a_crowd(stack):
    kw = dict(max_tokens=8, temperature=0.9, seed=1234, repetition_penalty=1.3, presence_penalty=0.4,
              min_p=0.05, n=2)
    alone = await generate(stack.gw, PROMPT, **kw)
    crowd = await asyncio.gather(generate(stack.gw, PROMPT, **kw),
                                 *(generate(stack.gw, [9 + i, 8, 7, 6], max_tokens=8, temperature=1.0, seed=i,
                                            frequency_penalty=0.5) for i in range(3)))
    assert {i: c[0] for i, c in alone.items()} == {i: c[0] for i, c in crowd[0].items()}
    assert alone[0][0] != alone[1][0]  # n = 2: seeds seed and seed + 1
    await stack.wait_idle()
