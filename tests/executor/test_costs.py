"""The executor's cost meter: batch-size buckets, moving averages, noise floor."""

from __future__ import annotations

import pytest

from executor_service.costs import EWMA, CostMeter, bucket


def test_buckets_are_powers_of_two_at_or_below():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 500, 512, 513)] == [1, 1, 2, 2, 4, 4, 8, 256, 512, 512]


def test_forward_and_swap_rates_average_per_bucket():
    m = CostMeter(block_bytes=1000)
    assert m.snapshot().prefill_batch_tokens == () and m.snapshot().swap_bytes_per_s == 0.0
    m.record_forward(64, 0.1)            # 640 tokens/s in bucket 64
    m.record_forward(100, 0.1)           # 1000 tokens/s, same bucket: moves the average by EWMA
    m.record_forward(1, 0.01)
    m.record_forward(0, 1.0)             # nothing computed: ignored
    m.record_forward(8, 1e-7)            # clock noise: ignored
    snap = m.snapshot()
    assert snap.prefill_batch_tokens == (1, 64)
    assert snap.prefill_tokens_per_s == pytest.approx((100.0, (1 - EWMA) * 640 + EWMA * 1000))
    m.record_swap(10, 0.01)
    assert m.snapshot().swap_bytes_per_s == pytest.approx(1e6)
    assert m.snapshot().block_bytes == 1000
