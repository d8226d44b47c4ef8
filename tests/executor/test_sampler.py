"""Sampler: filters on crafted logits, counter-based seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from executor_service.sampler import SamplingInputs, apply_top_k_top_p, sample
from kvpager_kernels.gumbel import row_keys, splitmix64, token_uniforms


def _inputs(num_rows=1, *, num_samples=1, temperature=1.0, top_p=1.0, top_k=0, positions=None, seeds=None,
            num_top=0, return_logprobs=False) -> SamplingInputs:
    ns = torch.full((num_rows,), num_samples, dtype=torch.int64)
    total = int(ns.sum())
    return SamplingInputs(
        num_samples=ns,
        temperature=torch.full((num_rows,), temperature),
        top_p=torch.full((num_rows,), top_p),
        top_k=torch.full((num_rows,), top_k, dtype=torch.int64),
        positions=torch.full((num_rows,), 10, dtype=torch.int64) if positions is None else positions,
        seeds=torch.arange(total, dtype=torch.int64) if seeds is None else seeds,
        num_top_logprobs=torch.full((num_rows,), num_top, dtype=torch.int64),
        return_logprobs=return_logprobs,
    )


PROBS = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2])  # sorted: 1, 3, 4, 2, 0
LOGITS = PROBS.log()[None, :]


def _freqs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def test_splitmix64_matches_the_reference_constants():
    mask = (1 << 64) - 1

    def ref(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    values = [0, 1, 42, -1, -(2**63), 2**63 - 1, 123456789123]
    got = splitmix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & mask for g in got] == [ref(v & mask) for v in values]
    # splitmix64(0) is a published value: pins the function across versions.
    assert got[0] & mask == 0xE220A8397B1DCDAF


def test_token_uniforms_are_a_pure_function_of_their_key():
    seeds = torch.tensor([7, 7, 7, 8])
    pos = torch.tensor([3, 3, 4, 3])
    idx = torch.tensor([0, 1, 0, 0])
    u = token_uniforms(row_keys(seeds, pos, idx), 16)
    assert u.shape == (4, 16) and bool(((u > 0) & (u < 1)).all())
    again = token_uniforms(row_keys(seeds.flip(0), pos.flip(0), idx.flip(0)), 16).flip(0)
    assert torch.equal(u, again)  # batch order does not matter
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(u[i], u[j])  # every key component matters


def test_greedy_is_argmax_and_ignores_seeds():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, _inputs(3, temperature=0.0, num_samples=2))
    assert out.token_ids.tolist() == logits.argmax(-1).repeat_interleave(2).tolist()


@pytest.mark.parametrize("num_samples", [1, 2])
def test_greedy_takes_the_first_of_tied_maxima_and_a_nan_as_argmax_does(num_samples):
    """bf16 logits tie often: the greedy token is the first maximal one, as
    transformers' argmax takes it (one sample a row takes a gather-free path)."""
    logits = torch.zeros(4, 64)
    logits[0, [5, 9, 40]] = 3.0          # tie: 5
    logits[1, :] = 1.0                   # all tied: 0
    logits[2, [7, 63]] = float("inf")    # tie of infinities: 7
    logits[3, [2, 30]] = 2.0
    logits[3, 11] = float("nan")         # NaN wins, as in argmax
    out = sample(logits, _inputs(4, temperature=0.0, num_samples=num_samples))
    assert out.token_ids.tolist() == torch.argmax(logits, -1).repeat_interleave(num_samples).tolist() == [
        t for t in (5, 0, 7, 11) for _ in range(num_samples)]


def test_top_k_keeps_exactly_the_k_best():
    masked = apply_top_k_top_p(LOGITS, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [1, 3]
    out = sample(LOGITS, _inputs(num_samples=4000, top_k=2))
    f = _freqs(out.token_ids, 5)
    assert set(out.token_ids.unique().tolist()) == {1, 3}
    assert abs(f[1] - 0.4 / 0.65) < 0.03 and abs(f[3] - 0.25 / 0.65) < 0.03


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # 0.4 + 0.25 = 0.65 < 0.7, so token 4 (0.2) is needed; token 2 is not.
    masked = apply_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([0.7]))
    assert sorted(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == [1, 3, 4]
    out = sample(LOGITS, _inputs(num_samples=4000, top_p=0.7))
    f = _freqs(out.token_ids, 5)
    assert set(out.token_ids.unique().tolist()) == {1, 3, 4}
    for t, p in ((1, 0.4), (3, 0.25), (4, 0.2)):
        assert abs(f[t] - p / 0.85) < 0.03
    # A tiny top_p still keeps the most likely token.
    masked = apply_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [1]


def test_top_k_then_top_p_per_row():
    logits = LOGITS.repeat(3, 1)
    masked = apply_top_k_top_p(logits, torch.tensor([3, 0, 4]), torch.tensor([1.0, 0.5, 0.6]))
    keep = [sorted(torch.isfinite(r).nonzero().flatten().tolist()) for r in masked]
    # row 0: top-3; row 1: top-p 0.5 -> {1, 3}; row 2: top-4 renormalised
    # (0.4, 0.25, 0.2, 0.1)/0.95 -> 0.42 + 0.26 = 0.68 >= 0.6 -> {1, 3}
    assert keep == [[1, 3, 4], [1, 3], [1, 3]]


def test_unfiltered_sampling_follows_the_distribution():
    out = sample(LOGITS, _inputs(num_samples=6000))
    f = _freqs(out.token_ids, 5)
    assert torch.allclose(f, PROBS, atol=0.025)


def test_temperature_sharpens():
    out = sample(LOGITS, _inputs(num_samples=2000, temperature=0.25))
    f = _freqs(out.token_ids, 5)
    p = torch.softmax(LOGITS[0] / 0.25, -1)
    assert torch.allclose(f, p, atol=0.03)


def test_same_key_same_token_different_seed_differs():
    logits = torch.zeros(1, 1000)  # uniform: every seed picks its own token
    a = sample(logits, _inputs(num_samples=1, seeds=torch.tensor([5]))).token_ids
    b = sample(logits, _inputs(num_samples=1, seeds=torch.tensor([5]))).token_ids
    c = sample(logits, _inputs(num_samples=1, seeds=torch.tensor([6]))).token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)
    # n > 1 from one row: each draw carries its own seed, and draw i equals
    # what that seed gives alone (completion i of n == seed + i on its own).
    many = sample(logits, _inputs(num_samples=8, seeds=torch.arange(5, 13))).token_ids
    alone = [sample(logits, _inputs(num_samples=1, seeds=torch.tensor([s]))).token_ids[0] for s in range(5, 13)]
    assert many.tolist() == [int(t) for t in alone] and len(set(many.tolist())) > 1


def test_logprobs_are_raw_log_softmax_and_top_logprobs_sorted():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    inp = _inputs(2, num_samples=1, temperature=0.7, top_k=5, num_top=4, return_logprobs=True)
    inp.num_top_logprobs = torch.tensor([4, 0])
    out = sample(logits, inp)
    raw = logits.log_softmax(-1)
    expect = raw[torch.arange(2), out.token_ids]
    assert torch.allclose(out.logprobs, expect)
    assert out.top_counts.tolist() == [4, 0]
    top_vals, top_ids = raw[0].topk(4)
    assert out.top_token_ids.tolist() == top_ids.tolist()
    assert torch.allclose(out.top_logprobs, top_vals)
    assert math.isclose(float(torch.exp(raw[0]).sum()), 1.0, rel_tol=1e-5)


def test_zero_samples_rows_produce_nothing():
    inp = _inputs(2, num_samples=0, seeds=torch.empty(0, dtype=torch.int64))
    out = sample(torch.randn(2, 10), inp)
    assert out.token_ids.numel() == 0
