"""Sliding-window models (Gemma 2, Qwen2 with max_window_layers, Mistral)
served with a table per KV group (the executor's ``kv_layout`` "hybrid",
kept by the memory service's group allocator): every
completion token-exact against transformers' ``generate`` (fp32) through the
whole stack — long prompts in prefill chunks, a prefix hit, n=2 forks,
preemption by recompute and by swap — while the sliding groups really give
back what the window passed (GetAccounting's per-group figures)."""

from __future__ import annotations

import asyncio

import pytest
from gateway_harness import generate, start_stack
from oracle import Oracle
from sliding_cases import WINDOW, check_long_prompts_exact, prompts

from kvpager.v1 import memory_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

BS = 4
BOUND = -(-WINDOW // BS) + 1  # the most blocks a sequence holds in a sliding group between decode steps
# alternating local / global layers, sliding above max_window_layers (2 groups each), all sliding (1 group)
FAMILIES = ("gemma2", "qwen2", "mistral")
HYBRID = {"kv_layout": "hybrid"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from kvpager_tools.demo_model import build_demo_model

    path = str(build_demo_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param,
                                vocab_size=320, max_position_embeddings=256, sliding_window=WINDOW, seed=9))
    return request.param, path, Oracle(path, fixed_length=True)


async def _executor_accounting(stack):
    snap = await stack.mem.GetAccounting(memory_pb2.AccountingRequest())
    (ex,) = snap.executors
    return ex


async def test_window_frees_chunked_prefix_hit_and_n2(family):
    name, model, oracle = family
    # The default kv_layout (auto) is a table per KV group for a model with sliding layers.
    # One token per step: a burst holds its lookahead's slots too (bursts: the test below).
    stack = await start_stack(model, num_blocks=400, block_size=BS, max_batch_tokens=48, num_scheduler_steps=1)
    try:
        groups = [g.window for g in (await _executor_accounting(stack)).kv_groups]
        assert groups == ([WINDOW] if name == "mistral" else [0, WINDOW]), groups
        # One sequence of 4x the window, prefilled in 48-token chunks, then decoding: each sliding
        # group holds at most ceil(W / block_size) + 1 of its blocks, a full group all of them.
        prompt = prompts(1, 4 * WINDOW, 4 * WINDOW + 1, seed=3)[0]
        task = asyncio.ensure_future(generate(stack.gw, prompt, max_tokens=40, ignore_eos=True))
        seen = []
        while not task.done():
            ex = await _executor_accounting(stack)
            # past its prompt by a decode step: its tables cover more than the prompt's blocks
            if ex.num_sequences == 1 and ex.kv_groups[0].full_attention_blocks > len(prompt) // BS:
                seen.append(ex)
            await asyncio.sleep(0.01)
        res = await task
        assert res[0][0] == oracle.greedy(prompt, 40)
        assert seen, "no accounting snapshot while it decoded"
        for ex in seen:
            full_blocks = ex.kv_groups[0].full_attention_blocks
            for g in ex.kv_groups:
                assert g.full_attention_blocks == full_blocks
                if g.window:
                    assert g.max_seq_blocks <= BOUND, (g, BOUND)
                    assert g.window_saved_blocks == full_blocks - g.logical_blocks >= full_blocks - BOUND
                else:
                    assert g.max_seq_blocks == g.logical_blocks == full_blocks
        # Concurrent long prompts (3-4x the window), a prefix hit in every group (the sliding
        # ones hold its last window), n=2: exact.
        await check_long_prompts_exact(stack, oracle)
        t = await stack.wait_idle()
        assert t.used_blocks == 0
    finally:
        await stack.stop()


@pytest.mark.parametrize("mode,swap_min_tokens", [("recompute", 10**6), ("swap", 1)])
async def test_preemption_keeps_grouped_outputs_exact(family, mode, swap_min_tokens):
    name, model, oracle = family
    # 4 requests growing to ~130 tokens on a pool too small for all of them: someone is preempted.
    stack = await start_stack(model, num_blocks=28 if name == "mistral" else 48, block_size=BS, swap_blocks=160,
                              swap_min_tokens=swap_min_tokens, max_batch_tokens=64, executor_kw=HYBRID)
    try:
        batch = prompts(4, 2 * WINDOW, 3 * WINDOW, seed=2)
        results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=40, ignore_eos=True) for p in batch))
        for p, res in zip(batch, results):
            assert res[0][0] == oracle.greedy(p, 40)
        t = await stack.wait_idle()
        assert getattr(t, f"preemptions_{mode}") > 0, t
    finally:
        await stack.stop()


async def test_decode_bursts_across_the_window_are_exact(family):
    """Bursts of 8 (--num-scheduler-steps) past the window: each group's slots
    for the whole burst come in one plan, and what the window frees never
    includes what a burst's earlier forwards still read."""
    name, model, oracle = family
    from gateway import metrics

    stack = await start_stack(model, num_blocks=400, block_size=BS, num_scheduler_steps=8, stream_interval=64)
    try:
        before = metrics.TOKENS_SAMPLED_AHEAD._value.get()
        batch = prompts(3, WINDOW - 5, 2 * WINDOW, seed=5)
        results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=2 * WINDOW, ignore_eos=True)
                                         for p in batch))
        for p, res in zip(batch, results):
            assert res[0][0] == oracle.greedy(p, 2 * WINDOW), (name, p)
        assert metrics.TOKENS_SAMPLED_AHEAD._value.get() - before >= 3 * WINDOW  # in bursts
        await stack.wait_idle()
    finally:
        await stack.stop()
