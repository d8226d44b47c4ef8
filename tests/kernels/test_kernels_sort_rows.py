"""The descending row sort of top-k / top-p (``kvpager_kernels/cpu/sort_rows.cpp``)
against its reference, torch's stable descending sort: values and indices
equal, ties in index order, NaN first, -0.0 tied with +0.0."""

import pytest
import torch

from kvpager_kernels import cpu_build
from kvpager_kernels.sort_rows import reference_sort_rows, sort_rows

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here")


def _kernel(x):
    return torch.ops.kvpager_cpu.sort_rows(x)


def _same(x: torch.Tensor) -> None:
    values, indices = _kernel(x)
    want_values, want_indices = reference_sort_rows(x)
    assert indices.dtype == torch.int64 and values.dtype == torch.float32
    assert torch.equal(indices, want_indices)
    assert torch.equal(values.nan_to_num(nan=7.5), want_values.nan_to_num(nan=7.5))


@pytest.mark.parametrize("vocab", [1, 2, 17, 1000, 8192, 32000])
def test_matches_the_stable_sort(vocab):
    _same(torch.randn(8, vocab, generator=torch.Generator().manual_seed(vocab)) * 5)


@pytest.mark.parametrize("vocab", [64, 8192])
def test_ties_keep_index_order(vocab):
    """bf16 logits (few distinct values, many ties) and whole tied rows."""
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    x[1] = 0.25
    x[2] = torch.randint(-3, 3, (vocab,), generator=torch.Generator().manual_seed(2)).float()
    _same(x)


def test_nan_zeros_and_infinities():
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    x[0, :6] = torch.tensor([float("nan"), 0.0, -0.0, float("inf"), float("-inf"), -0.0])
    x[1, ::3] = float("nan")
    x[2] = float("-inf")
    x[3, 10:20] = -0.0
    x[3, 20:30] = 0.0
    _same(x)


def test_one_value_per_bucket_digit_still_sorts():
    """Keys sharing their high digits (a narrow range): the skipped passes change nothing."""
    base = torch.full((3, 5000), 1.0)
    base += torch.arange(5000) * 1e-7
    _same(base[:, torch.randperm(5000, generator=torch.Generator().manual_seed(4))].contiguous())


def test_strided_rows_and_refusals():
    wide = torch.randn(5, 300, generator=torch.Generator().manual_seed(5))
    _same(wide[:, 50:250])
    with pytest.raises(RuntimeError, match="sort_rows"):
        _kernel(wide.double())
    with pytest.raises(RuntimeError, match="sort_rows"):
        _kernel(torch.zeros(4, 3).t())
    with pytest.raises(RuntimeError, match="sort_rows"):
        _kernel(torch.zeros(3))


def test_wrapper_falls_back_to_the_reference():
    x = torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    got, want = sort_rows(x), reference_sort_rows(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    y = torch.randn(3, 0)
    assert sort_rows(y)[0].shape == (3, 0)
