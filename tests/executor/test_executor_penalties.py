"""Penalties through the real server: the executor keeps each penalised
sequence's tokens (history.py) across prefill chunks, decodes, prefix-hit
starts, forks and drops, and samples exactly what transformers' processor
gives on the model's own logits."""

from __future__ import annotations

import grpc
import pytest
import torch
from executor_harness import Plan, prompts
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from kvpager import packed
from kvpager.v1 import common_pb2

CKPT = "llama_gqa"


def _penalise(req, repetition: list[float], prompt_lens: list[int], history: list[list[int]] | None = None):
    req.sampling.repetition_penalty = packed.pack_f32(repetition)
    req.sampling.prompt_lens = packed.pack_i32(prompt_lens)
    if history is not None:
        offsets = [0]
        for h in history:
            offsets.append(offsets[-1] + len(h))
        req.sampling.history_offsets = packed.pack_i32(offsets)
        req.sampling.history_token_ids = packed.pack_i32([t for h in history for t in h])
    return req


def _run(plan: Plan, items, req):
    resp = plan.served.stub.Execute(req, timeout=120)
    plan.sent_tables(req, items)
    sampled = list(packed.unpack_i32(resp.sampled_token_ids))
    nums = list(packed.unpack_i32(req.sampling.num_samples))
    pos = 0
    for (seq, q), n in zip(items, nums):
        seq.num_computed += q
        if n:
            seq.tokens.append(sampled[pos])
        pos += n
    return sampled


def _want(oracle, tokens: list[int], penalty: float) -> int:
    logits = oracle.last_logits(tokens)[None]
    return int(RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([tokens]), logits).argmax())


def test_greedy_repetition_penalty_matches_transformers_over_chunks_and_decodes(serve, oracle):
    served = serve(CKPT)
    executor = served.executor
    plan = Plan(served)
    [p] = prompts(1, [10], seed=31)
    seq = plan.new_seq(p)
    other = plan.new_seq(prompts(1, [5], seed=32)[0])  # unpenalised, in the same batch
    # a prefill in two chunks: the first samples nothing, both extend the history
    items = [(seq, 6), (other, 5)]
    _run(plan, items, _penalise(plan.request(items), [3.0, 1.0], [10, 5]))
    assert executor.histories.tokens(seq.seq_id) == p[:6] and other.seq_id not in executor.histories
    for _ in range(4):
        items = [(seq, len(seq.tokens) - seq.num_computed), (other, len(other.tokens) - other.num_computed)]
        want = _want(oracle(CKPT), seq.tokens, 3.0)
        _run(plan, items, _penalise(plan.request(items), [3.0, 1.0], [10, 5]))
        assert seq.tokens[-1] == want
        assert executor.histories.tokens(seq.seq_id) == seq.tokens[:-1]  # the tokens in cache
    plan.free(seq)
    plan.free(other)
    items = [(plan.new_seq([5, 6, 7]), 3)]
    plan.step(items)
    assert seq.seq_id not in executor.histories  # the drop forgot it


def test_a_prefix_hit_start_sends_its_cached_tokens_once(serve, oracle):
    served = serve(CKPT)
    executor = served.executor
    plan = Plan(served)
    [p] = prompts(1, [12], seed=33)
    first = plan.new_seq(p)
    plan.prefill([first])
    # a second sequence hits the first's two full blocks (8 tokens) and computes the rest
    hit = plan.new_seq(list(p))
    hit.blocks = list(first.blocks[:2])
    for b in hit.blocks:
        plan.alloc.share(b)
    hit.num_computed = 8
    items = [(hit, 4)]
    bad = _penalise(plan.request(items), [2.0], [12])  # no history sent: out of step
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(bad, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "history" in err.value.details()
    assert hit.seq_id not in executor.tables  # refused before anything changed
    plan.step_id -= 1  # the refused request's step id is free again
    want = _want(oracle(CKPT), p, 2.0)
    _run(plan, items, _penalise(plan.request(items), [2.0], [12], history=[p[:8]]))
    assert hit.tokens[-1] == want and executor.histories.tokens(hit.seq_id) == p
    # the next decode sends no history
    items = [(hit, 1)]
    req = _penalise(plan.request(items), [2.0], [12])
    assert not req.sampling.history_token_ids
    want = _want(oracle(CKPT), hit.tokens, 2.0)
    _run(plan, items, req)
    assert hit.tokens[-1] == want


def test_a_fork_copies_the_parent_history(serve):
    served = serve(CKPT)
    executor = served.executor
    plan = Plan(served)
    [p] = prompts(1, [7], seed=34)  # the last block is partial
    parent = plan.new_seq(p)
    items = [(parent, 7)]
    _run(plan, items, _penalise(plan.request(items), [1.5], [7]))
    child = plan.new_seq(list(parent.tokens), prompt_len=7)
    plan.fork(parent, child)
    child.tokens[-1] = 99 if parent.tokens[-1] != 99 else 98  # its own first token
    shared, fresh = child.blocks[-1], plan.alloc.alloc()  # both write the shared partial block: copy it
    plan.alloc.release([shared])
    child.blocks[-1] = fresh
    ops = common_pb2.CacheOps(copy_src=packed.pack_i32([shared]), copy_dst=packed.pack_i32([fresh]))
    items = [(parent, 1), (child, 1)]
    _run(plan, items, _penalise(plan.request(items, cache_ops=ops), [1.5, 1.5], [7, 7]))
    assert executor.histories.tokens(parent.seq_id) == parent.tokens[:-1]
    assert executor.histories.tokens(child.seq_id) == child.tokens[:-1]
    assert executor.histories.tokens(child.seq_id)[:7] == p


def test_malformed_penalty_columns_are_invalid_argument(serve):
    served = serve(CKPT)
    plan = Plan(served)
    seq = plan.new_seq([4, 5, 6])
    cases = {
        "repetition_penalty": packed.pack_f32([0.0]),
        "min_p": packed.pack_f32([1.5]),
        "presence_penalty": packed.pack_f32([float("nan")]),
    }
    for name, value in cases.items():
        req = plan.request([(seq, 3)])
        setattr(req.sampling, name, value)
        with pytest.raises(grpc.RpcError) as err:
            served.stub.Execute(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
        plan.step_id -= 1
    req = plan.request([(seq, 3)])
    req.sampling.logit_bias_offsets = packed.pack_i32([0, 2])
    req.sampling.logit_bias_token_ids = packed.pack_i32([7, 7])
    req.sampling.logit_bias_values = packed.pack_f32([1.0, 2.0])
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(req, timeout=60)
    assert "distinct" in err.value.details()
    plan.step_id -= 1
    req = plan.request([(seq, 3)])  # history for a row without a penalty
    req.sampling.history_offsets = packed.pack_i32([0, 1])
    req.sampling.history_token_ids = packed.pack_i32([4])
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Execute(req, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_logit_bias_and_min_p_follow_their_rows_past_rows_that_sample_nothing(serve, oracle):
    served = serve(CKPT)
    plan = Plan(served)
    a, b, c = (plan.new_seq(p) for p in prompts(3, [9, 6, 5], seed=35))
    items = [(a, 4), (b, 6), (c, 5)]  # a is mid-prefill: no logits row
    req = plan.request(items)
    req.sampling.logit_bias_offsets = packed.pack_i32([0, 1, 2, 3])
    req.sampling.logit_bias_token_ids = packed.pack_i32([40, 41, 42])
    req.sampling.logit_bias_values = packed.pack_f32([100.0, 100.0, float("-inf")])
    req.sampling.min_p = packed.pack_f32([0.0, 0.5, 0.0])
    want_c = oracle(CKPT).last_logits(c.tokens)
    want_c[42] = float("-inf")
    sampled = _run(plan, items, req)
    assert sampled == [41, int(want_c.argmax())]
