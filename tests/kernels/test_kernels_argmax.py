"""Greedy sampling's argmax kernel (``kvpager_kernels/cpu/argmax.cpp``)
against its reference, torch's ``max(dim=-1).indices``: each row's first
maximum, a NaN counting as the maximum (its first)."""

import pytest
import torch

from kvpager_kernels import cpu_build
from kvpager_kernels.greedy import argmax_rows, reference_argmax_rows

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Under one vector, a vector and a tail, whole vectors, the bench models' vocabularies.
SHAPES = [(1, 1), (3, 7), (2, 16), (5, 31), (4, 32), (4, 33), (3, 47), (2, 1000), (32, 8192), (3, 32000)]


def _kernel(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kvpager_cpu.argmax_rows(x)


def _logits(rows: int, vocab: int, dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(dtype, shape):
    x = _logits(*shape, dtype, seed=shape[1])
    got = _kernel(x)
    assert got.dtype == torch.int64 and got.shape == (shape[0],)
    assert torch.equal(got, reference_argmax_rows(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 40, 100, 8192])
def test_ties_go_to_the_first(dtype, vocab):
    """Tied maxima in one lane, in different lanes, and in the tail: the lowest index wins."""
    x = _logits(6, vocab, dtype, seed=vocab)
    top = x.max() + 1
    places = [(0, [vocab - 1, 3]), (1, [2, 18, 5]), (2, [vocab // 2, vocab - 1]), (3, [0, vocab - 1]),
              (4, [17, 1])]
    for row, cols in places:
        for c in cols:
            x[row, c % vocab] = top
    x[5] = top  # the whole row tied
    want = reference_argmax_rows(x)
    assert torch.equal(_kernel(x), want)
    assert want[1].item() == min(c % vocab for c in [2, 18, 5]) and want[5].item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [9, 33, 64, 8192])
def test_nan_is_the_maximum(dtype, vocab):
    """A NaN anywhere in a row (a vector lane or the tail) is what the row answers: its first NaN."""
    x = _logits(5, vocab, dtype, seed=7 + vocab)
    nan = float("nan")
    x[0, vocab - 1] = nan                       # last element (a tail where there is one)
    x[1, vocab // 2], x[1, 1] = nan, nan        # two: the first
    x[2, 0] = nan                               # the first element
    x[3, 1], x[3, 2] = float("inf"), nan        # +inf before a NaN: still the NaN
    x[4] = float("-inf")                        # no NaN, every element -inf: index 0
    assert torch.equal(_kernel(x), reference_argmax_rows(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities_and_strided_rows(dtype):
    wide = _logits(4, 300, dtype, seed=3)
    wide[0, 250] = float("inf")
    wide[1, :] = float("-inf")
    wide[1, 123] = -1e4 if dtype != torch.float16 else -1e3
    x = wide[:, 10:210]  # rows 300 apart, 200 columns each
    assert x.stride() == (300, 1)
    assert torch.equal(_kernel(x), reference_argmax_rows(x))
    assert _kernel(wide)[0].item() == 250


def test_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="argmax_rows"):
        _kernel(torch.zeros(3))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        _kernel(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        _kernel(torch.zeros(4, 3).t())  # columns not contiguous
    with pytest.raises(RuntimeError, match="argmax_rows"):
        _kernel(torch.zeros(2, 0))


def test_wrapper_falls_back_to_the_reference():
    """fp64 and column-strided logits: the reference answers (same result, no error)."""
    x = _logits(3, 50, torch.float64, seed=1)
    assert torch.equal(argmax_rows(x), reference_argmax_rows(x))
    y = _logits(50, 3, torch.float32, seed=2).t()
    assert torch.equal(argmax_rows(y), reference_argmax_rows(y))
    z = _logits(4, 8192, torch.bfloat16, seed=4)
    assert torch.equal(argmax_rows(z), reference_argmax_rows(z))
