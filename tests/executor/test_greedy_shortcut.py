"""The greedy shortcut (executor_service.greedy): which steps take it, and that
it answers what ``sample`` answers for them, 16-bit logits and ties included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from executor_service.greedy import greedy_only, greedy_tokens
from executor_service.sampler import SamplingInputs, sample
from executor_service.step import Sampling

N = 4


def _plain(n: int = N) -> Sampling:
    """A checked step's sampling with the defaults filled in: one greedy token a row."""
    return Sampling(num_samples=np.ones(n, np.int32), temperature=np.zeros(n, np.float32),
                    top_p=np.ones(n, np.float32), top_k=np.zeros(n, np.int32), seeds=np.zeros(n, np.int64),
                    num_top_logprobs=np.zeros(n, np.int32))


def _with(column: str, row_value) -> Sampling:
    s = _plain()
    arr = getattr(s, column).copy()
    arr[2] = row_value
    return dataclasses.replace(s, **{column: arr})


def test_plain_greedy_rows_take_it():
    assert greedy_only(_plain(), N)
    # Neutral penalties and top-k / top-p / min_p leave greedy rows greedy.
    s = dataclasses.replace(_plain(), presence_penalty=np.zeros(N, np.float32),
                            repetition_penalty=np.ones(N, np.float32), min_p=np.full(N, 0.5, np.float32))
    assert greedy_only(dataclasses.replace(s, top_k=np.full(N, 3, np.int32)), N)


@pytest.mark.parametrize("change", [
    lambda: _with("num_samples", 2),             # n > 1 first tokens
    lambda: _with("num_samples", 0),             # a prefill chunk that samples nothing
    lambda: _with("temperature", 0.7),           # one sampled row
    lambda: _with("num_top_logprobs", 1),        # alternatives wanted (beam candidates too)
    lambda: dataclasses.replace(_plain(), return_logprobs=True),
    lambda: dataclasses.replace(_plain(), presence_penalty=np.array([0, 0, 0.5, 0], np.float32)),
    lambda: dataclasses.replace(_plain(), repetition_penalty=np.array([1, 1.2, 1, 1], np.float32)),
    lambda: dataclasses.replace(_plain(), bias_offsets=np.array([0, 0, 1, 1, 1], np.int32),
                                bias_token_ids=np.array([5], np.int32), bias_values=np.array([2.0], np.float32)),
])
def test_anything_else_goes_to_the_sampler(change):
    assert not greedy_only(change(), N)


def _greedy_inputs(n: int) -> SamplingInputs:
    return SamplingInputs(num_samples=torch.ones(n, dtype=torch.int64), temperature=torch.zeros(n),
                          top_p=torch.ones(n), top_k=torch.zeros(n, dtype=torch.int64),
                          positions=torch.arange(n), seeds=torch.zeros(n, dtype=torch.int64),
                          num_top_logprobs=torch.zeros(n, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [10, 8192, 32000])
def test_same_tokens_as_the_sampler(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(32, vocab, generator=g).to(dtype)
    logits[3, 7], logits[3, 2] = 100.0, 100.0      # a tie: the first
    logits[5, vocab - 1] = float("nan")             # NaN counts as the maximum
    logits[6] = logits[6, 0]                        # a flat row (random weights' logits nearly are)
    got = greedy_tokens(logits)
    assert got.dtype == np.int32 and got.shape == (32,)
    want = sample(logits, _greedy_inputs(32)).token_ids
    assert got.tolist() == want.tolist() == logits.float().max(dim=-1).indices.tolist()
    assert got[3] == 2 and got[5] == vocab - 1 and got[6] == 0
