"""`kvpager bench preemption --json`: the preemption mode policies under
memory pressure, on the real stack.

One stack (memory service, one executor, gateway; child processes) per
policy — ``recompute``, ``swap``, ``threshold`` (the old fixed rule,
``--swap-min-tokens``) and ``cost`` (the measured-cost model, the default)
— and on each, in turn, the same workloads against a KV pool far smaller
than the load:

* ``short_prompts``: many short prompts with long outputs (decode growth
  preempts; little to recompute);
* ``long_prompts``: few long prompts (a recompute redoes a long prefill);
* ``long_shared_prefix``: one long shared prefix and short suffixes (the
  prefix stays cached and shared, so a recompute redoes almost nothing while
  a swap copies every block, shared ones too).

Before the workloads a short warm-up runs the same prompt shapes and the
benchmark waits for a heartbeat, so the executor's measured rates have
reached the memory service (every policy gets the same warm-up). Each
workload runs under a fresh cache salt (no warm-up prefix helps it).

Per workload and policy: ``throughput_tok_s`` (generated tokens / wall
seconds), ``estimated_preemption_cost_s`` (the chosen modes' seconds at the
executor's measured rates, summed; what the cost model minimises, free of
the machine's noise), ``wasted_prefill_tokens`` (tokens prefilled again after a
preemption by recompute that the cache no longer held: the accounting's
``recompute_query_tokens - recompute_hit_tokens``), ``swap_bytes`` (blocks
copied out and in × block bytes), and the preemption counts. ``summary``:
the cost model's throughput over the best and the worst fixed policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass

from kvpager_tools.bench import common as bc

NAME = "preemption"
POLICIES = ("recompute", "swap", "threshold", "cost")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    shared_prefix_len: int = 0     # > 0: every prompt starts with the same prefix of this many tokens

    def requests(self, lo: int, hi: int, seed: int) -> list[bc.BenchRequest]:
        if self.shared_prefix_len:
            return bc.make_dataset("shared-system-prompt", self.num_prompts, token_lo=lo, token_hi=hi, seed=seed,
                                   prefix_len=self.shared_prefix_len, input_len=self.input_len,
                                   output_len=self.output_len)
        return bc.make_dataset("random", self.num_prompts, token_lo=lo, token_hi=hi, seed=seed,
                               input_len=self.input_len, output_len=self.output_len)


def workloads(quick: bool) -> list[Workload]:
    if quick:  # CI smoke: shapes only
        return [Workload("short_prompts", 8, 8, 24), Workload("long_prompts", 4, 56, 8),
                Workload("long_shared_prefix", 6, 4, 12, shared_prefix_len=48)]
    return [Workload("short_prompts", 32, 24, 96), Workload("long_prompts", 12, 448, 32),
            Workload("long_shared_prefix", 24, 16, 48, shared_prefix_len=384)]


async def _totals(memory_address: str) -> dict:
    from kvpager.channel import make_channel
    from kvpager.v1 import memory_pb2, memory_pb2_grpc

    async with make_channel(memory_address) as ch:
        stub = memory_pb2_grpc.MemoryServiceStub(ch)
        snap = await stub.GetAccounting(memory_pb2.AccountingRequest(), timeout=10)
        listed = await stub.ListExecutors(memory_pb2.ListExecutorsRequest(), timeout=10)
    t = snap.total
    costs = listed.executors[0].costs if listed.executors else None
    return {"recompute_query_tokens": t.recompute_query_tokens, "recompute_hit_tokens": t.recompute_hit_tokens,
            "swapped_blocks": t.swapped_out_blocks + t.swapped_in_blocks,
            "preemptions_recompute": t.preemptions_recompute, "preemptions_swap": t.preemptions_swap,
            "preempt_cost_s": t.preempt_cost_s, "block_bytes": costs.block_bytes if costs else 0,
            "measured": bool(costs and costs.prefill_batch_tokens and costs.swap_bytes_per_s > 0),
            "prefill_points": len(costs.prefill_batch_tokens) if costs else 0}


def run_policy(policy: str, model: str, loads: list[Workload], args) -> dict[str, dict]:
    from kvpager_tools.stack import Stack

    opts = bc.StackOptions(model=model, num_blocks=args.num_blocks, block_size=args.block_size,
                           swap_blocks=args.swap_blocks, max_batch_tokens=args.max_batch_tokens)
    memory_flags = ["--preemption-mode", policy, "--swap-min-tokens", str(args.swap_min_tokens),
                    "--lease-s", str(args.lease_s)]
    lo, hi = bc.token_range(model)
    stack = Stack(opts.config(extra={"memory": memory_flags}))
    stack.start()
    out: dict[str, dict] = {}
    try:
        a = stack.addresses
        # Warm-up: the executor times these steps; one heartbeat later the memory service knows the rates.
        warm = [r for w in loads for r in w.requests(lo, hi, seed=10_000)[:2]]
        asyncio.run(bc.run_load(a.gateway, warm, max_concurrency=len(warm), cache_salt=f"warm-{policy}"))
        time.sleep(args.lease_s / 3 + 0.5)
        for w in loads:
            bc.progress(NAME, f"{policy}: {w.name}")
            before = asyncio.run(_totals(a.memory))
            res = asyncio.run(bc.run_load(a.gateway, w.requests(lo, hi, seed=args.seed),
                                          max_concurrency=w.num_prompts, cache_salt=f"{w.name}-{policy}"))
            after = asyncio.run(_totals(a.memory))
            m = bc.load_metrics(res)
            d = {k: after[k] - before[k] for k in ("recompute_query_tokens", "recompute_hit_tokens",
                                                   "swapped_blocks", "preemptions_recompute", "preemptions_swap",
                                                   "preempt_cost_s")}
            out[w.name] = {
                "throughput_tok_s": m["output_throughput"],
                "wasted_prefill_tokens": d["recompute_query_tokens"] - d["recompute_hit_tokens"],
                "swap_bytes": d["swapped_blocks"] * after["block_bytes"],
                "preemptions_recompute": d["preemptions_recompute"], "preemptions_swap": d["preemptions_swap"],
                # the chosen modes' cost at the executor's measured rates (machine noise does not move it)
                "estimated_preemption_cost_s": round(d["preempt_cost_s"], 6),
                "completed": m["completed"], "failed": m["failed"], "duration_s": m["duration_s"],
                "rates_measured": before["measured"],
            }
    finally:
        stack.stop()
    return out


def _median_runs(runs: list[dict]) -> dict:
    keys = ("throughput_tok_s", "wasted_prefill_tokens", "swap_bytes", "preemptions_recompute", "preemptions_swap",
            "duration_s", "estimated_preemption_cost_s")
    first = runs[0]
    return {**first, **{k: statistics.median(r[k] for r in runs) for k in keys}, "repeats": len(runs)}


def compare(args) -> dict:
    model = str(bc.model_dir(args.model))
    loads = workloads(args.quick)
    runs: dict[str, dict[str, list[dict]]] = {w.name: {p: [] for p in POLICIES} for w in loads}
    for r in range(args.repeats):
        # Rotated each repeat: on a shared machine the load drifts, and a fixed order would favour the first.
        for policy in POLICIES[r % len(POLICIES):] + POLICIES[:r % len(POLICIES)]:
            bc.progress(NAME, f"run {r + 1}/{args.repeats}: {policy}")
            for name, res in run_policy(policy, model, loads, args).items():
                runs[name][policy].append(res)
    table = {name: {p: _median_runs(rs) for p, rs in by.items()} for name, by in runs.items()}
    summary = {}
    for name, by in table.items():
        fixed = [by[p]["throughput_tok_s"] for p in POLICIES if p != "cost"]
        cost = by["cost"]["throughput_tok_s"]
        summary[name] = {"cost_over_best_fixed": round(cost / max(fixed), 3) if max(fixed) else None,
                         "cost_over_worst": round(cost / min(fixed), 3) if min(fixed) else None}
    return {"benchmark": NAME, "model": model, "num_blocks": args.num_blocks, "block_size": args.block_size,
            "swap_blocks": args.swap_blocks, "max_batch_tokens": args.max_batch_tokens,
            "swap_min_tokens": args.swap_min_tokens, "repeats": args.repeats,
            "workload_shapes": {w.name: {"num_prompts": w.num_prompts, "input_len": w.input_len,
                                         "output_len": w.output_len, "shared_prefix_len": w.shared_prefix_len}
                                for w in loads},
            "workloads": table, "summary": summary}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="preemption mode policies (recompute, swap, threshold, cost) under memory pressure")
    p.add_argument("--model", default="llama-30m", help="checkpoint dir, 'llama-30m' (default) or 'demo'")
    p.add_argument("--num-blocks", type=int, default=96, help="KV blocks (far fewer than the load wants)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--swap-blocks", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--swap-min-tokens", type=int, default=256, help="the threshold policy's rule")
    p.add_argument("--lease-s", type=float, default=1.5, help="memory lease (heartbeats bring the rates every third)")
    p.add_argument("--repeats", type=int, default=1, help="runs per policy (alternating); medians reported")
    p.add_argument("--quick", action="store_true", help="tiny workloads (CI smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from kvpager_tools.bench.serve import machine

    result = compare(args)
    result["machine"] = machine()
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
