"""The sampled-token draw (``kvpager_kernels/cpu/gumbel.cpp``) against its
reference, torch ops over the counter-based uniforms: argmax of
``log_p - log(-log(u))`` in float64 (kvpager_kernels.gumbel)."""

import pytest
import torch

from kvpager_kernels import cpu_build
from kvpager_kernels.gumbel import gumbel_argmax, reference_gumbel_argmax, row_keys, token_uniforms

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here")


def _kernel(log_p, keys):
    return torch.ops.kvpager_cpu.gumbel_argmax(log_p, keys)


def _keys(n: int, salt: int = 0) -> torch.Tensor:
    return row_keys(torch.arange(n) + salt, torch.arange(n) * 7 + 3, torch.zeros(n, dtype=torch.int64))


def _log_p(rows: int, vocab: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * spread).log_softmax(dim=-1)


# Shorter than a vector, one, a vector and a tail, many; the bench models' vocabularies.
@pytest.mark.parametrize("vocab", [1, 3, 7, 8, 9, 15, 64, 100, 8192, 32000])
@pytest.mark.parametrize("spread", [0.1, 1.0, 8.0])  # nearly flat (random weights) to peaked
def test_draws_the_reference_token(vocab, spread):
    log_p = _log_p(24, vocab, seed=vocab, spread=spread)
    keys = _keys(24, salt=vocab)
    got = _kernel(log_p, keys)
    assert got.dtype == torch.int64 and got.shape == (24,)
    assert torch.equal(got, reference_gumbel_argmax(log_p, keys))


def test_masked_tokens_are_never_drawn():
    """Top-k / top-p / min-p leave -inf behind: only the kept tokens come out."""
    log_p = _log_p(64, 100, seed=1)
    keep = torch.zeros(64, 100, dtype=torch.bool)
    keep[:, [3, 50, 97]] = True
    keep[0] = False
    keep[0, 42] = True  # one token left
    masked = log_p.masked_fill(~keep, float("-inf"))
    keys = _keys(64, salt=5)
    got = _kernel(masked, keys)
    assert torch.equal(got, reference_gumbel_argmax(masked, keys))
    assert got[0].item() == 42 and set(got[1:].tolist()) <= {3, 50, 97}


def test_nan_and_all_masked_rows_answer_as_argmax():
    log_p = _log_p(4, 40, seed=2)
    log_p[0, 33] = float("nan")  # a NaN: its index (in the tail)
    log_p[1, 5], log_p[1, 20] = float("nan"), float("nan")  # the first NaN
    log_p[2] = float("-inf")  # nothing left: index 0
    keys = _keys(4)
    got = _kernel(log_p, keys)
    assert got.tolist()[:3] == [33, 5, 0]
    assert torch.equal(got, reference_gumbel_argmax(log_p, keys))


def test_a_row_draws_the_same_whatever_its_batch():
    log_p = _log_p(16, 300, seed=3)
    keys = _keys(16, salt=9)
    together = _kernel(log_p, keys)
    alone = torch.cat([_kernel(log_p[i:i + 1], keys[i:i + 1]) for i in range(16)])
    flipped = _kernel(log_p.flip(0).contiguous(), keys.flip(0)).flip(0)
    assert torch.equal(together, alone) and torch.equal(together, flipped)


def test_draws_follow_the_distribution():
    """Many keys over one distribution: frequencies within a few sigma of p."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625] + [0.0] * 11)  # a vector of 16, zeros masked
    n = 40000
    log_p = p.log().expand(n, -1).contiguous()
    got = _kernel(log_p, _keys(n, salt=11))
    freq = torch.bincount(got, minlength=16).float() / n
    assert freq[5:].sum() == 0
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-9).all(), freq


def test_strided_rows_and_refusals():
    wide = _log_p(6, 250, seed=4)
    x = wide[:, 20:220]
    assert x.stride() == (250, 1)
    keys = _keys(6)
    assert torch.equal(_kernel(x, keys), reference_gumbel_argmax(x, keys))
    with pytest.raises(RuntimeError, match="gumbel_argmax"):
        _kernel(x.double(), keys)
    with pytest.raises(RuntimeError, match="gumbel_argmax"):
        _kernel(x, keys[:5])
    with pytest.raises(RuntimeError, match="gumbel_argmax"):
        _kernel(x, keys.int())
    with pytest.raises(RuntimeError, match="gumbel_argmax"):
        _kernel(torch.zeros(4, 3).t(), _keys(3))


def test_wrapper_falls_back_to_the_reference():
    log_p = _log_p(5, 30, seed=6)
    keys = _keys(5)
    assert torch.equal(gumbel_argmax(log_p.double(), keys), reference_gumbel_argmax(log_p, keys))
    assert torch.equal(gumbel_argmax(log_p, keys), reference_gumbel_argmax(log_p, keys))


def test_uniforms_stay_inside_the_open_interval():
    """The logarithms' inputs: u in [2^-54, 1 - 2^-54], never 0 or 1."""
    u = token_uniforms(_keys(8), 4096)
    assert bool(((u > 0) & (u < 1)).all())
