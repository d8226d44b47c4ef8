"""Preemption by measured cost: the executor's rates as the memory service
keeps them, both modes' estimates per victim, the four mode policies, the
lost-work victim policy, and the decisions in the plan and the accounting."""

from __future__ import annotations

import pytest

from kvpager.errors import InvalidArgument
from memory_service.costs import ExecutorCosts
from memory_service.policy import (CostModePolicy, LeastLostWorkVictimPolicy, PreemptionEstimate, PreemptionMode,
                                   RecomputeModePolicy, SwapModePolicy, ThresholdModePolicy, VictimPolicy,
                                   estimate_preemption, make_mode_policy)
from memory_service.sequence import Sequence

RECOMPUTE, SWAP = PreemptionMode.RECOMPUTE, PreemptionMode.SWAP


def test_prefill_seconds_interpolate_between_measured_batch_sizes():
    c = ExecutorCosts((4, 16), (100.0, 400.0), 1e6, 1000)
    assert c.prefill_s(0) == 0.0
    assert c.prefill_s(2) == pytest.approx(2 / 100)          # below the smallest: its rate
    assert c.prefill_s(4) == pytest.approx(0.04) and c.prefill_s(16) == pytest.approx(0.04)
    assert c.prefill_s(10) == pytest.approx(0.04)            # a step's time, linear between
    assert c.prefill_s(64) == pytest.approx(64 / 400)        # past the largest: chunks at its rate
    assert c.swap_s(3) == pytest.approx(2 * 3 * 1000 / 1e6) and c.swap_s(0) == 0.0
    assert ExecutorCosts().prefill_s(5) is None and ExecutorCosts().swap_s(1) is None
    assert not ExecutorCosts((4,), (1.0,)).measured and c.measured


@pytest.mark.parametrize("kw", [
    dict(prefill_batch_tokens=(4,), prefill_tokens_per_s=()),
    dict(prefill_batch_tokens=(8, 4), prefill_tokens_per_s=(1.0, 2.0)),
    dict(prefill_batch_tokens=(0,), prefill_tokens_per_s=(1.0,)),
    dict(prefill_batch_tokens=(4,), prefill_tokens_per_s=(0.0,)),
    dict(prefill_batch_tokens=(4,), prefill_tokens_per_s=(float("inf"),)),
    dict(swap_bytes_per_s=float("nan")),
    dict(swap_bytes_per_s=-1.0),
    dict(prefill_batch_tokens=tuple(range(1, 66)), prefill_tokens_per_s=(1.0,) * 65),
])
def test_malformed_cost_reports_are_refused(kw):
    with pytest.raises(InvalidArgument):
        ExecutorCosts(**kw)


def _setup(harness, swap_bytes_per_s: float):
    """bs 4, 8 blocks: 1 (12 tokens, 3 blocks, unimportant) runs; 2 (24 tokens) needs 6 with 5 free."""
    h = harness(num_blocks=8, num_swap_blocks=8)
    h.m.planner.modes = CostModePolicy()
    h.m.update_costs("e0", ExecutorCosts((4,), (100.0,), swap_bytes_per_s, 1000))
    h.step(new=[h.new(1, range(12), priority=5)], sched=[(1, 12)])
    return h, h.step(new=[h.new(2, range(100, 124))], sched=[(2, 24)])


def test_cost_mode_recomputes_when_the_cached_prefix_makes_it_cheaper(harness):
    h, out = _setup(harness, swap_bytes_per_s=1e5)
    assert out.preempted == [(1, RECOMPUTE)]
    (d,) = out.decisions
    # 2 takes one block beyond the free five: 1's tail (freed first); its two leading cached blocks stay
    # (the last prompt token is always recomputed, so 8 of its 12 tokens are hits at resume)
    e = d.estimate
    assert (e.recompute_tokens, e.swap_blocks, e.swap_bytes, e.freed_blocks) == (4, 3, 3000, 3)
    assert e.recompute_s == pytest.approx(0.04) and e.swap_s == pytest.approx(0.06)
    assert d.reason == "recompute 40 ms <= swap 60 ms"
    _, (part,) = h.m.accounting()
    assert (part.preempt_recompute_tokens, part.preempt_swap_bytes) == (4, 0)
    assert part.preempt_cost_s == pytest.approx(0.04) and part.preempt_saved_s == pytest.approx(0.02)
    assert (part.prefill_tokens_per_s, part.swap_bytes_per_s) == (100.0, 1e5)
    h.step(free=[2])
    h.step(sched=[(1, 12)])
    _, (part,) = h.m.accounting()
    assert (part.recompute_query_tokens, part.recompute_hit_tokens) == (12, 8)  # the estimate came true


def test_cost_mode_swaps_when_the_link_is_fast(harness):
    h, out = _setup(harness, swap_bytes_per_s=1e6)
    assert out.preempted == [(1, SWAP)]
    assert out.decisions[0].reason == "swap 6 ms < recompute 40 ms"
    _, (part,) = h.m.accounting()
    assert part.preempt_swap_bytes == 2 * 3000 and part.preempt_saved_s == pytest.approx(0.034)


def test_cost_mode_falls_back_until_measured_and_when_swap_is_full(harness):
    h = harness(num_blocks=8, num_swap_blocks=8)
    h.m.planner.modes = CostModePolicy(ThresholdModePolicy(swap_min_tokens=8))
    h.step(new=[h.new(1, range(12), priority=5)], sched=[(1, 12)])
    out = h.step(new=[h.new(2, range(100, 124))], sched=[(2, 24)])
    assert out.preempted == [(1, SWAP)]
    assert out.decisions[0].reason == "unmeasured, threshold: 12 tokens >= swap_min_tokens 8"
    assert out.decisions[0].estimate.recompute_s is None
    seq = Sequence(9, "e0", list(range(12)), b"", num_computed=12)
    est = PreemptionEstimate(4, 0.5, 3, 3000, 0.001, swap_fits=False, freed_blocks=3)
    for policy in (CostModePolicy(), SwapModePolicy(), ThresholdModePolicy(1)):
        d = policy.choose(seq, est)
        assert (d.mode, d.reason) == (RECOMPUTE, "swap pool full")


def test_fixed_mode_policies_and_the_factory():
    seq = Sequence(9, "e0", list(range(12)), b"", num_computed=12)
    est = PreemptionEstimate(4, 0.001, 3, 3000, 0.5, swap_fits=True, freed_blocks=3)
    assert RecomputeModePolicy().choose(seq, est).mode is RECOMPUTE
    assert SwapModePolicy().choose(seq, est).mode is SWAP          # whatever it costs
    assert ThresholdModePolicy(12).choose(seq, est).mode is SWAP
    assert ThresholdModePolicy(13).choose(seq, est).mode is RECOMPUTE
    assert CostModePolicy().choose(seq, est).mode is RECOMPUTE
    assert [make_mode_policy(n).name for n in ("cost", "threshold", "recompute", "swap")] == [
        "cost", "threshold", "recompute", "swap"]
    assert make_mode_policy("threshold", 7).swap_min_tokens == 7
    with pytest.raises(ValueError):
        make_mode_policy("fastest")


def test_estimate_counts_hits_that_survive_the_room_being_made(harness):
    h = harness(num_blocks=8)
    h.step(new=[h.new(1, range(14))], sched=[(1, 14)])   # 3 full cached blocks + a partial one
    seq = h.seq(1)
    costs = ExecutorCosts((4,), (100.0,), 1e6, 10)
    # taking 0, 1 (the partial tail), 2, 3 of its blocks: a leading hit survives unless taken
    assert [estimate_preemption(seq, 4, 8, costs, t).recompute_tokens for t in (0, 1, 2, 3, 4)] == [
        2, 2, 6, 10, 14]
    assert estimate_preemption(seq, 4, 3, None).swap_fits is False
    h.m.fork(1, [2])                                      # shared blocks are not freed: all hits stay
    e = estimate_preemption(h.seq(1), 4, 8, costs, 4)
    assert (e.recompute_tokens, e.freed_blocks) == (2, 0)


def test_least_lost_work_victim_policy():
    def s(seq_id, priority, arrival):
        return Sequence(seq_id, "e0", [1], b"", priority=priority, arrival=arrival)

    a, b, c, d = s(1, 5, 0), s(2, 5, 1), s(3, 5, 2), s(4, 0, 3)
    est = {1: PreemptionEstimate(40, 0.4, 4, 0, 0.8, True, 4),     # 0.1 s per block freed
           2: PreemptionEstimate(90, 0.9, 3, 0, 0.6, True, 3),     # swap: 0.2 s per block
           3: PreemptionEstimate(0, 0.0, 2, 0, 0.4, True, 0),      # frees nothing
           4: PreemptionEstimate(0, 0.0, 1, 0, 0.1, True, 1)}      # cheapest but more important
    policy = LeastLostWorkVictimPolicy()
    assert policy.select([a, b, c, d], lambda q: est[q.seq_id]) is a
    assert policy.select([b, c], lambda q: est[q.seq_id]) is b
    assert policy.select([c], lambda q: est[q.seq_id]) is c
    assert policy.select([a, b, c], None) is c                   # no estimates: newest
    assert VictimPolicy().select([a, b, c, d], lambda q: est[q.seq_id]) is c
    assert policy.select([], None) is None


def test_cost_mode_recomputes_a_shared_prefix_a_swap_would_unshare(harness):
    """A swap copies shared blocks out without freeing them and back into
    private ones: the cost model charges the lost sharing, so a victim whose
    prefix others hold is recomputed although its copy is far cheaper."""
    h = harness(num_blocks=8)
    h.step(new=[h.new(1, range(14))], sched=[(1, 14)])   # 3 full cached blocks + a partial one
    costs = ExecutorCosts((4,), (100.0,), 1e6, 10)
    alone = estimate_preemption(h.seq(1), 4, 8, costs)
    assert (alone.unshared_blocks, alone.unshare_s, alone.swap_total_s) == (0, 0.0, alone.swap_s)
    d = CostModePolicy().choose(h.seq(1), alone)
    assert d.mode is SWAP and d.reason == "swap 0.08 ms < recompute 20 ms"
    h.m.fork(1, [2])                                      # 2 shares all four blocks
    e = estimate_preemption(h.seq(1), 4, 8, costs)
    assert (e.recompute_tokens, e.unshared_blocks) == (2, 3)   # the partial tail is not a prefix hit
    assert e.unshare_s == pytest.approx(0.12) and e.swap_total_s == pytest.approx(0.12 + e.swap_s)
    assert e.cost_s(SWAP) == e.swap_total_s
    d = CostModePolicy().choose(h.seq(1), e)
    assert d.mode is RECOMPUTE and d.reason == "recompute 20 ms <= swap 120 ms (3 shared blocks 120 ms)"
