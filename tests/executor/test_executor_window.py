"""Sliding-window models through the real executor are token-for-token
identical to transformers' ``generate`` (fp32, eager, with its sliding-window
mask): Mistral (every layer sliding), Qwen2 (layers from max_window_layers
sliding), Gemma 2 (alternating, soft-capped) and Gemma 3 (two local layers
with their own RoPE to one global), with prompts of 3-4x the
window and 40+ new tokens, ragged batches and chunked prefill; the context
limit is the model's own, not the window."""

from __future__ import annotations

import pytest
import torch
from executor_harness import WINDOW, Plan, prompts

FAMILIES = ["mistral_swa", "qwen2_swa", "gemma2", "gemma3"]
NEW = 42
ENGINES = {"cpu": ("cpu", "auto"), "torch": ("torch", "transformers")}


@pytest.fixture(params=sorted(ENGINES))
def serve_engine(request, serve):
    backend, impl = ENGINES[request.param]
    if backend == "cpu":
        from kvpager_kernels import cpu_attention

        if not cpu_attention.available():
            pytest.skip("the C++ CPU attention kernel did not build here")
    return lambda name: serve(name, backend, model_impl=impl)


@pytest.mark.parametrize("ckpt", FAMILIES)
def test_long_prompts_match_generate(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    assert served.info.max_model_len == 256  # max_position_embeddings, not the window
    plan = Plan(served)
    seqs = [plan.new_seq(p) for p in prompts(3, [3 * WINDOW + 5, 4 * WINDOW, 7], seed=21)]
    plan.prefill(seqs)
    plan.decode(seqs, NEW - 1)
    for s in seqs:
        assert s.generated == oracle(ckpt).greedy(s.tokens[: s.prompt_len], NEW)


@pytest.mark.parametrize("ckpt", FAMILIES)
def test_chunked_prefill_across_windows_matches_generate(serve_engine, oracle, ckpt):
    served = serve_engine(ckpt)
    plan = Plan(served)
    [prompt] = prompts(1, [4 * WINDOW - 3], seed=22)
    seq = plan.new_seq(prompt)
    other = plan.new_seq(prompts(1, [2 * WINDOW + 1], seed=23)[0])
    plan.prefill([other])
    for chunk in (5, WINDOW + 3, 2 * WINDOW):  # chunks beside a decode, spanning windows
        plan.step([(seq, chunk), (other, 1)])
    plan.step([(seq, len(prompt) - seq.num_computed), (other, 1)])
    plan.decode([seq, other], NEW - 1)
    assert seq.generated == oracle(ckpt).greedy(prompt, NEW)


@pytest.mark.parametrize("ckpt", FAMILIES)
def test_the_window_changes_generate(checkpoints, oracle, ckpt):
    """The tests above can fail: the same weights under full attention give other tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoints(ckpt), local_files_only=True)
    config.sliding_window = 10**6  # wider than any prompt here: full attention
    full = AutoModelForCausalLM.from_pretrained(checkpoints(ckpt), config=config, local_files_only=True,
                                                dtype=torch.float32, attn_implementation="eager").eval()
    [prompt] = prompts(1, [4 * WINDOW], seed=21)
    with torch.no_grad():
        out = full.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=2)
    assert out[0, len(prompt):].tolist() != oracle(ckpt).greedy(prompt, NEW)


def test_windows_and_groups_come_from_the_config(serve):
    layer_windows = {name: serve(name, "torch").executor.runner.layer_windows for name in FAMILIES}
    assert layer_windows == {"mistral_swa": [WINDOW, WINDOW], "qwen2_swa": [None, WINDOW, WINDOW],
                             "gemma2": [WINDOW, None, WINDOW], "gemma3": [WINDOW, WINDOW, None]}
    groups = serve("gemma2", "torch").executor.runner.kv_groups
    assert [(g.window, g.layers) for g in groups] == [(None, (1,)), (WINDOW, (0, 2))]
