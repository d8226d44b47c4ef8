"""Smoke run of `kvpager bench preemption`: one policy (the cost model) on
the demo model over the quick workloads, on the real stack under memory
pressure. The JSON has the issue's shape and sane values; the figures live
in docs/benchmarks.md."""

from __future__ import annotations

import argparse

import pytest

from kvpager_tools.bench import common as bc
from kvpager_tools.bench.preemption import POLICIES, compare, run_policy, workloads

pytestmark = pytest.mark.timeout(240)


def test_cost_policy_under_pressure_reports_the_three_figures():
    args = argparse.Namespace(num_blocks=16, block_size=4, swap_blocks=64, max_batch_tokens=512,
                              swap_min_tokens=32, lease_s=0.6, seed=0)
    loads = workloads(quick=True)
    out = run_policy("cost", str(bc.model_dir("demo")), loads, args)
    assert set(out) == {"short_prompts", "long_prompts", "long_shared_prefix"}
    for name, r in out.items():
        assert {"throughput_tok_s", "wasted_prefill_tokens", "swap_bytes"} <= set(r), name
        assert r["completed"] == next(w.num_prompts for w in loads if w.name == name) and r["failed"] == 0
        assert r["throughput_tok_s"] > 0 and r["wasted_prefill_tokens"] >= 0 and r["swap_bytes"] >= 0
        assert r["rates_measured"], "the warm-up's rates reached the memory service before the workload"
    # the pool is 16 blocks of 4: decode growth of the short prompts preempts
    short = out["short_prompts"]
    assert short["preemptions_recompute"] + short["preemptions_swap"] > 0
    if short["preemptions_swap"]:
        assert short["swap_bytes"] > 0 and short["estimated_preemption_cost_s"] > 0
    assert POLICIES == ("recompute", "swap", "threshold", "cost") and callable(compare)
