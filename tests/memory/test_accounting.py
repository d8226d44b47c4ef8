"""Accounting that cannot be misread: block usage beside token occupancy,
first-prefill hit rate apart from recompute after preemption, and both
contiguous counterfactuals (max context; prompt + max_tokens as declared)."""

from __future__ import annotations

import pytest

from memory_service.policy import PreemptionMode


def test_block_usage_token_occupancy_and_both_counterfactuals(harness):
    h = harness(num_blocks=8, block_size=4, max_model_len=32)
    h.step(new=[h.new(1, range(6), max_total_tokens=10), h.new(2, range(100, 105))], sched=[(1, 6), (2, 5)])
    total, (part,) = h.m.accounting()
    assert (part.used_blocks, part.live_tokens, part.allocated_slots) == (4, 11, 16)
    assert part.block_usage == pytest.approx(4 / 8)          # what kv_cache_usage_perc reads
    assert part.token_occupancy == pytest.approx(11 / 32)    # the pool's token slots holding KV
    assert part.kv_utilization == pytest.approx(11 / 16)     # the fill of the used blocks
    # the seeds' max-context reservation: 8 blocks each; declared: ceil(10/4) and (no max_tokens) the context
    assert (part.contiguous_equivalent_blocks, part.contiguous_declared_blocks) == (16, 3 + 8)
    assert total.as_dict() == {**part.as_dict(), "executor_id": ""}


def test_recompute_after_preemption_is_counted_apart(harness):
    h = harness(num_blocks=8, block_size=4)
    h.step(new=[h.new(1, range(6)), h.new(2, range(100, 109), priority=5)], sched=[(1, 6), (2, 9)])
    out = h.step(new=[h.new(3, range(200, 216))], sched=[(3, 16)])
    assert out.preempted == [(2, PreemptionMode.RECOMPUTE)]
    h.step(free=[3])
    h.step(sched=[(2, 9)])
    _, (part,) = h.m.accounting()
    assert (part.prefix_query_tokens, part.prefix_hit_tokens) == (6 + 9 + 16, 0)  # first prefills only
    assert part.prefix_hit_rate == 0.0
    # 2 comes back with its 9 tokens; what the cache kept of them is its own work found again, not a hit
    assert part.recompute_query_tokens == 9
    # 3 took the 3 never-used blocks and 2's partial tail (freed tail first); 2's full blocks stayed cached
    assert part.recompute_hit_tokens == 8
    assert part.recompute_hit_rate == pytest.approx(8 / 9)
