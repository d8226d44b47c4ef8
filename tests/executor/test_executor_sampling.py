"""Sampling through the real server: seeds reproducible across batch
compositions and orders, n > 1, logprobs, top logprobs, mid-prefill chunks."""

from __future__ import annotations

import math

import torch

from executor_harness import Plan, prompts
from kvpager import packed

CKPT = "llama_gqa"


def _sampled_run(served, order: list[int], prompt_list, seeds, steps: int = 5) -> dict[int, list[int]]:
    """Run the sequences at indices ``order`` together; return generated tokens by index."""
    plan = Plan(served)
    seqs = {i: plan.new_seq(prompt_list[i], temperature=1.0, seed=seeds[i], top_p=0.95) for i in order}
    batch = [seqs[i] for i in order]
    plan.prefill(batch)
    plan.decode(batch, steps - 1)
    return {i: s.generated for i, s in seqs.items()}


def test_seeded_sampling_is_independent_of_batch_composition_and_order(serve):
    served = serve(CKPT)
    ps = prompts(4, [5, 9, 3, 12], seed=21)
    seeds = [101, 202, 303, 404]
    alone = _sampled_run(served, [0], ps, seeds)
    mixed = _sampled_run(served, [3, 0, 1], ps, seeds)
    reordered = _sampled_run(served, [1, 2, 3, 0], ps, seeds)
    assert alone[0] == mixed[0] == reordered[0]
    assert mixed[1] == reordered[1] and mixed[3] == reordered[3]
    other_seed = _sampled_run(served, [0], ps, [999, 0, 0, 0])
    assert other_seed[0] != alone[0]


def test_n_samples_from_one_prefill(serve):
    served = serve(CKPT)
    plan = Plan(served)
    [p] = prompts(1, [6], seed=22)
    seq = plan.new_seq(p, temperature=1.0)
    req = plan.request([(seq, len(p))], num_samples=[4], seeds=[7, 8, 9, 10])
    first = list(packed.unpack_i32(served.stub.Execute(req).sampled_token_ids))
    second = list(packed.unpack_i32(served.stub.Execute(req).sampled_token_ids))
    assert len(first) == 4 and first == second
    # One seed for all four: sample_index still separates the draws, and
    # draw 0 is the same token a single-sample request with that seed gets.
    req = plan.request([(seq, len(p))], num_samples=[4], seeds=[7] * 4)
    same_seed = list(packed.unpack_i32(served.stub.Execute(req).sampled_token_ids))
    assert same_seed[0] == first[0]
    greedy = plan.new_seq(p)
    req = plan.request([(greedy, len(p))], num_samples=[3], seeds=[1, 2, 3])
    g = list(packed.unpack_i32(served.stub.Execute(req).sampled_token_ids))
    assert g[0] == g[1] == g[2]


def test_logprobs_and_top_logprobs_match_the_model(serve, oracle):
    served = serve(CKPT)
    plan = Plan(served)
    p1, p2 = prompts(2, [7, 4], seed=23)
    a, b = plan.new_seq(p1), plan.new_seq(p2)
    resp = plan.step([(a, len(p1)), (b, len(p2))], return_logprobs=True, num_top_logprobs=[3, 0])
    raw = oracle(CKPT).last_logits(p1).log_softmax(-1)
    top_vals, top_ids = raw.topk(3)
    sampled = list(packed.unpack_i32(resp.sampled_token_ids))
    lps = list(packed.unpack_f32(resp.sampled_logprobs))
    assert sampled[0] == int(top_ids[0])
    assert math.isclose(lps[0], float(top_vals[0]), abs_tol=1e-4)
    assert list(packed.unpack_i32(resp.top_offsets)) == [0, 3, 3]
    assert list(packed.unpack_i32(resp.top_token_ids)) == top_ids.tolist()
    assert torch.allclose(torch.tensor(list(packed.unpack_f32(resp.top_logprobs))), top_vals, atol=1e-4)
    raw_b = oracle(CKPT).last_logits(p2).log_softmax(-1)
    assert math.isclose(lps[1], float(raw_b[sampled[1]]), abs_tol=1e-4)
    assert resp.forward_s > 0 and resp.step_id == plan.step_id


def test_mid_prefill_chunk_samples_nothing_but_can_score(serve):
    served = serve(CKPT)
    plan = Plan(served)
    [p] = prompts(1, [10], seed=24)
    seq = plan.new_seq(p)
    resp = plan.step([(seq, 4)])
    assert resp.sampled_token_ids == b"" and list(packed.unpack_i32(resp.top_offsets)) == [0, 0]
    # Beam search scores without sampling: num_samples 0, top logprobs 5.
    resp = plan.step([(seq, 3)], num_samples=[0], num_top_logprobs=[5])
    assert resp.sampled_token_ids == b""
    assert list(packed.unpack_i32(resp.top_offsets)) == [0, 5]
