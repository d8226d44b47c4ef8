"""Smoke run of `kvpager bench preemption`: one policy (the cost model) on
the demo model over the quick workloads, on the real stack under memory
pressure. The JSON has the issue's shape and sane values; the figures live
in docs/benchmarks.md."""

from __future__ import annotations

import argparse

import pytest

from kvpager_tools.bench import common as bc
from kvpager_tools.bench.preemption import POLICIES, TWIN, PolicyStack, compare, summarize, workloads

pytestmark = pytest.mark.timeout(240)


def test_cost_policy_under_pressure_reports_the_three_figures():
    args = argparse.Namespace(num_blocks=16, block_size=4, swap_blocks=64, max_batch_tokens=512,
                              swap_min_tokens=32, lease_s=0.6, seed=0, victim_policy="newest")
    loads = workloads(quick=True)
    stack = PolicyStack("cost", "cost", str(bc.model_dir("demo")), args)
    try:
        stack.start(loads)
        out = {w.name: stack.run(w, 0) for w in loads}
    finally:
        stack.stop()
    assert set(out) == {"short_prompts", "long_prompts", "long_shared_prefix"}
    for name, r in out.items():
        assert {"throughput_tok_s", "wasted_prefill_tokens", "swap_bytes"} <= set(r), name
        assert r["completed"] == next(w.num_prompts for w in loads if w.name == name) and r["failed"] == 0
        assert r["throughput_tok_s"] > 0 and r["wasted_prefill_tokens"] >= 0 and r["swap_bytes"] >= 0
        assert r["rates_measured"], "the warm-up's rates reached the memory service before the workload"
        assert r["steps"] > 0 and r["forward_s"] > 0 and r["swap_bytes_per_s"] > 0
    # the pool is 16 blocks of 4: decode growth of the short prompts preempts
    short = out["short_prompts"]
    assert short["preemptions_recompute"] + short["preemptions_swap"] > 0
    if short["preemptions_swap"]:
        assert short["swap_bytes"] > 0 and short["estimated_preemption_cost_s"] > 0
    assert POLICIES == ("recompute", "swap", "threshold", "cost") and callable(compare)


def test_summary_takes_medians_and_round_by_round_ratios():
    def runs(*tok_s):
        return [{"throughput_tok_s": x} for x in tok_s]

    by = {"recompute": runs(100, 50, 80), "swap": runs(200, 100, 120), "threshold": runs(150, 90, 100),
          "cost": runs(210, 90, 130), f"cost{TWIN}": runs(189, 99, 130)}
    s = summarize(by, "cost")
    assert (s["best_fixed"], s["worst_fixed"]) == ("swap", "recompute")
    assert s["cost_over_best_fixed"] == 1.083 and s["cost_over_worst"] == 1.625   # 130/120, 130/80
    assert s["paired_cost_over_best_fixed"]["per_round"] == [1.05, 0.9, 1.083]
    assert s["paired_cost_over_best_fixed"]["median"] == 1.05
    assert s["paired_cost_over_worst"]["per_round"] == [2.1, 1.8, 1.625]
    assert s["self_check"]["per_round"] == [0.9, 1.1, 1.0] and s["self_check"]["median"] == 1.0
    assert "best_fixed" not in summarize({"cost": runs(1)}, None)     # without all four, no comparison
