"""The sampled-token draw (``kvpager_kernels/cpu/gumbel.cpp``) against its
reference, torch ops over the counter-based uniforms: argmax of
``log_p - log(-log(u))`` in float64 (kvpager_kernels.gumbel)."""

import pytest
import torch

from kvpager_kernels import cpu_build
from kvpager_kernels.gumbel import gumbel_argmax, reference_gumbel_argmax, row_keys, token_uniforms

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here")


def _kernel(log_p, keys, token_ids=None):
    return torch.ops.kvpager_cpu.gumbel_argmax(log_p, keys, token_ids)


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
    with pytest.raises(RuntimeError, match="token_ids"):
        _kernel(x, keys, torch.zeros(6, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="token_ids"):
        _kernel(x, keys, torch.zeros(6, 200, dtype=torch.int32))


def test_wrapper_falls_back_to_the_reference():
    log_p = _log_p(5, 30, seed=6)
    keys = _keys(5)
    assert torch.equal(gumbel_argmax(log_p.double(), keys), reference_gumbel_argmax(log_p, keys))
    assert torch.equal(gumbel_argmax(log_p, keys), reference_gumbel_argmax(log_p, keys))


def test_uniforms_stay_inside_the_open_interval():
    """The logarithms' inputs: u in [2^-54, 1 - 2^-54], never 0 or 1."""
    u = token_uniforms(_keys(8), 4096)
    assert bool(((u > 0) & (u < 1)).all())


def _sorted_filtered(log_p: torch.Tensor, keep: int):
    """Rows in descending order with their token ids, all but the first ``keep`` dropped (-inf), as top-k leaves them."""
    values, ids = torch.sort(log_p, dim=-1, descending=True, stable=True)
    values = values.clone()
    values[:, keep:] = float("-inf")
    return values.log_softmax(dim=-1), ids


@pytest.mark.parametrize("vocab, keep", [(7, 3), (40, 1), (40, 9), (300, 50), (8192, 8192), (32000, 40)])
def test_sorted_rows_draw_the_reference_token(vocab, keep):
    """Top-k / top-p rows come sorted with their token ids: the token, not the position, comes back."""
    values, ids = _sorted_filtered(_log_p(16, vocab, seed=vocab + keep), keep)
    keys = _keys(16, salt=keep)
    got = _kernel(values, keys, ids)
    assert torch.equal(got, reference_gumbel_argmax(values, keys, ids))
    kept = ids[:, :keep]
    assert all(int(t) in kept[i].tolist() for i, t in enumerate(got))
    assert torch.equal(gumbel_argmax(values, keys, ids), got)


def test_a_sorted_row_draws_as_its_unsorted_twin():
    """The same log-probabilities in token order or sorted (with ids): the same token (the noise is keyed by token id)."""
    log_p = _log_p(32, 500, seed=8)
    keys = _keys(32, salt=8)
    values, ids = torch.sort(log_p, dim=-1, descending=True, stable=True)
    assert torch.equal(_kernel(values.contiguous(), keys, ids), _kernel(log_p, keys))


def test_sorted_scan_stops_at_the_first_dropped_token():
    values, ids = _sorted_filtered(_log_p(1, 64, seed=9), 2)
    values[0, 30] = 50.0  # past the first -inf: never looked at (the contract: dropped tokens last)
    got = _kernel(values, _keys(1), ids)
    assert int(got) in ids[0, :2].tolist()


def test_sorted_draws_follow_the_renormalised_distribution():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 30000
    log_p = torch.full((n, 16), float("-inf"))
    log_p[:, :4] = p.log()
    ids = torch.tensor([9, 2, 14, 5] + [0, 1, 3, 4, 6, 7, 8, 10, 11, 12, 13, 15]).expand(n, -1).contiguous()
    kept = log_p.clone()
    kept[:, 2:] = float("-inf")  # top-k 2: 0.4 and 0.3 renormalised
    got = _kernel(kept.log_softmax(dim=-1), _keys(n, salt=12), ids)
    freq = {t: (got == t).float().mean().item() for t in (9, 2)}
    assert set(got.tolist()) == {9, 2}
    assert abs(freq[9] - 4 / 7) < 5 * (4 / 7 * 3 / 7 / n) ** 0.5
