"""Sliding-window models served by the whole stack (the issue's first report:
a Mistral with ``sliding_window: 32`` was capped at 32 tokens and refused a
100-token prompt). Now the limit is the model's own and every completion is
token-exact against transformers' ``generate``: long prompts in prefill
chunks, a prefix hit, n=2 and preemption by recompute and by swap — every
block back afterwards. Here with the per-layer KV layout (one table, every
block of a sliding layer kept); the default for sliding models, a table per
KV group, is tests/gateway/test_gateway_hybrid.py."""

from __future__ import annotations

import asyncio

import pytest
from gateway_harness import generate, start_stack
from oracle import Oracle
from sliding_cases import WINDOW, check_long_prompts_exact, prompts

pytestmark = pytest.mark.asyncio(loop_scope="module")

PER_LAYER = {"kv_layout": "per-layer"}
FAMILIES = {"mistral": {}, "gemma2": {"num_layers": 3}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    from kvpager_tools.demo_model import build_demo_model

    path = str(build_demo_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param,
                                vocab_size=320, max_position_embeddings=256, sliding_window=WINDOW, seed=9,
                                **FAMILIES[request.param]))
    return path, Oracle(path, fixed_length=True)  # EOS is argmax sometimes: ignore_eos keeps it, so must the oracle


async def test_long_prompts_chunked_prefix_hit_and_n2(family):
    model, oracle = family
    stack = await start_stack(model, num_blocks=160, block_size=4, max_batch_tokens=48,  # 100 tokens: 3 chunks
                              executor_kw=PER_LAYER)
    try:
        assert stack.gateway.engine.executors.limits.max_model_len == 256  # the model's, not the window
        await check_long_prompts_exact(stack, oracle)
        await stack.wait_idle()
    finally:
        await stack.stop()


@pytest.mark.parametrize("mode,swap_min_tokens", [("recompute", 10**6), ("swap", 1)])
async def test_preemption_keeps_sliding_outputs_exact(family, mode, swap_min_tokens):
    model, oracle = family
    # 48 blocks of 4 for 4 requests that each grow to ~120 tokens: someone is preempted.
    stack = await start_stack(model, num_blocks=48, block_size=4, swap_blocks=160, swap_min_tokens=swap_min_tokens,
                              max_batch_tokens=64, executor_kw=PER_LAYER)
    try:
        batch = prompts(4, 2 * WINDOW, 3 * WINDOW, seed=2)
        results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=40, ignore_eos=True) for p in batch))
        for p, res in zip(batch, results):
            assert res[0][0] == oracle.greedy(p, 40)
        t = await stack.wait_idle()
        assert getattr(t, f"preemptions_{mode}") > 0, t
    finally:
        await stack.stop()
