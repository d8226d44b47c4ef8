"""`kvpager bench preemption --json`: the preemption mode policies under
memory pressure, on the real stack.

One stack (memory service, one executor, gateway; child processes) per
policy — ``recompute``, ``swap``, ``threshold`` (the old fixed rule,
``--swap-min-tokens``) and ``cost`` (the measured-cost model, the default)
— all kept up for the whole run, and the same workloads against a KV pool
far smaller than the load:

* ``short_prompts``: many short prompts with long outputs (decode growth
  preempts; little to recompute);
* ``long_prompts``: long prompts (a recompute redoes a long prefill);
* ``long_shared_prefix``: one long shared prefix and short suffixes (the
  prefix stays cached and shared, so a recompute redoes almost nothing while
  a swap copies every block, shared ones too).

Before the workloads a short warm-up runs the same prompt shapes on every
stack and waits for a heartbeat, so the executor's measured rates have
reached the memory service. Then ``--repeats`` rounds: each runs every
workload on every stack, one after another (the order rotated each round),
each run under a fresh cache salt (no earlier run's prefix helps it). A
workload runs tens of seconds: the 2–3 s runs of the first version measured the
machine's noise (the same decisions up to 30 % apart). ``--self-check P``
adds a second stack of policy P: its ratio to P is the noise floor.
``--workload`` splits a long campaign into short runs.

Per workload and policy (medians over the rounds): ``throughput_tok_s``
(generated tokens / wall seconds), ``estimated_preemption_cost_s`` (the
chosen modes' seconds at the executor's measured rates, summed; what the
cost model minimises), ``wasted_prefill_tokens`` (tokens prefilled again
after a preemption by recompute that the cache no longer held: the
accounting's ``recompute_query_tokens - recompute_hit_tokens``),
``swap_bytes`` (blocks copied out and in × block bytes), the preemption
counts, and where the time went (forward, the rest of the Execute handler
with the swap copies in it, the memory service's plan; the executor's
measured rates). ``summary``: the cost model's throughput over the best and
the worst fixed policy, of the medians and round by round; ``loadavg``: the
machine's load around each round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from gateway.cli import positive_int
from kvpager_tools.bench import common as bc
from memory_service.policy import VICTIM_POLICIES

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
    # Sized for tens of seconds each on two CPU cores with the 30M model: 2-3 s runs measured the machine's noise.
    return [Workload("short_prompts", 64, 24, 160), Workload("long_prompts", 32, 448, 64),
            Workload("long_shared_prefix", 64, 16, 112, shared_prefix_len=384)]


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
            "swap_bytes_per_s": costs.swap_bytes_per_s if costs else 0.0,
            "prefill_tokens_per_s": dict(zip(costs.prefill_batch_tokens, costs.prefill_tokens_per_s))
            if costs else {}}


_DELTAS = ("recompute_query_tokens", "recompute_hit_tokens", "swapped_blocks", "preemptions_recompute",
           "preemptions_swap", "preempt_cost_s")


class PolicyStack:
    """One stack (memory service, one executor, gateway) under one mode
    policy, kept up for the whole comparison so that rounds can alternate
    between the policies workload by workload."""

    def __init__(self, label: str, policy: str, model: str, args) -> None:
        from kvpager_tools.stack import Stack

        self.label, self.policy, self.args = label, policy, args
        opts = bc.StackOptions(model=model, num_blocks=args.num_blocks, block_size=args.block_size,
                               swap_blocks=args.swap_blocks, max_batch_tokens=args.max_batch_tokens, metrics=True)
        memory_flags = ["--preemption-mode", policy, "--swap-min-tokens", str(args.swap_min_tokens),
                        "--lease-s", str(args.lease_s), "--victim-policy", args.victim_policy]
        self.lo, self.hi = bc.token_range(model)
        self.stack = Stack(opts.config(extra={"memory": memory_flags}))

    def start(self, loads: list[Workload]) -> None:
        self.stack.start()
        # Warm-up: the executor times these steps; one heartbeat later the memory service knows the rates.
        warm = [r for w in loads for r in w.requests(self.lo, self.hi, seed=10_000)[:2]]
        asyncio.run(bc.run_load(self.stack.addresses.gateway, warm, max_concurrency=len(warm),
                                cache_salt=f"warm-{self.label}"))
        time.sleep(self.args.lease_s / 3 + 0.5)

    def stop(self) -> None:
        self.stack.stop()

    def run(self, w: Workload, round_no: int) -> dict:
        a = self.stack.addresses
        ports = {k: a.metrics[k] for k in ("gateway", "executor-0", "memory")}
        before, scraped = asyncio.run(_totals(a.memory)), bc.scrape_all(ports)
        res = asyncio.run(bc.run_load(a.gateway, w.requests(self.lo, self.hi, seed=self.args.seed),
                                      max_concurrency=w.num_prompts,
                                      cache_salt=f"{w.name}-{self.label}-{round_no}"))
        steps = bc.step_totals(scraped, bc.scrape_all(ports))
        after = asyncio.run(_totals(a.memory))
        m = bc.load_metrics(res)
        d = {k: after[k] - before[k] for k in _DELTAS}
        return {
            "throughput_tok_s": m["output_throughput"],
            "wasted_prefill_tokens": d["recompute_query_tokens"] - d["recompute_hit_tokens"],
            "swap_bytes": d["swapped_blocks"] * after["block_bytes"],
            "preemptions_recompute": d["preemptions_recompute"], "preemptions_swap": d["preemptions_swap"],
            # the chosen modes' cost at the executor's measured rates (machine noise does not move it)
            "estimated_preemption_cost_s": round(d["preempt_cost_s"], 6),
            "completed": m["completed"], "failed": m["failed"], "duration_s": m["duration_s"],
            "ttft_median_ms": m["ttft_ms"].get("median") if m["ttft_ms"] else None,
            # where the wall time went (the services' own timers): the forward, the rest of the executor's
            # Execute handler (the swap copies are in it), the memory service's plan, the steps run
            "forward_s": round(steps["forward"], 3), "execute_other_s": round(steps["execute_handler_other"], 3),
            "memory_step_s": round(steps["memory_step"], 3), "steps": int(steps["steps"]),
            "rates_measured": before["measured"], "swap_bytes_per_s": round(after["swap_bytes_per_s"]),
            "prefill_tokens_per_s": {str(k): round(v) for k, v in after["prefill_tokens_per_s"].items()},
        }


_MEDIAN_KEYS = ("throughput_tok_s", "wasted_prefill_tokens", "swap_bytes", "preemptions_recompute",
                "preemptions_swap", "duration_s", "estimated_preemption_cost_s", "forward_s", "execute_other_s",
                "memory_step_s", "steps")


def _median_runs(runs: list[dict]) -> dict:
    out = {**runs[-1], **{k: statistics.median(r[k] for r in runs) for k in _MEDIAN_KEYS}, "repeats": len(runs)}
    out["throughput_per_round"] = [r["throughput_tok_s"] for r in runs]
    out["completed"] = min(r["completed"] for r in runs)
    out["failed"] = max(r["failed"] for r in runs)
    return out


def _ratio_summary(ratios: list[float]) -> dict:
    return {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
            "max": round(max(ratios), 3), "per_round": [round(x, 3) for x in ratios]}


def summarize(runs: dict[str, list[dict]], self_check: str | None) -> dict:
    """The cost model against the fixed policies, of one workload: its median
    throughput over the best and the worst fixed policy's medians, and the
    same ratios taken round by round (each round's runs are adjacent in time,
    so the ratio cancels the machine's drift); and, with ``self_check``, the
    policy run twice per round against itself (the noise floor)."""
    out: dict = {}
    med = {p: statistics.median(r["throughput_tok_s"] for r in rs) for p, rs in runs.items()}
    if all(p in runs for p in POLICIES):
        fixed = [p for p in POLICIES if p != "cost"]
        best, worst = max(fixed, key=med.__getitem__), min(fixed, key=med.__getitem__)
        out.update(best_fixed=best, worst_fixed=worst,
                   cost_over_best_fixed=round(med["cost"] / med[best], 3),
                   cost_over_worst=round(med["cost"] / med[worst], 3))
        rounds = range(len(runs["cost"]))
        out["paired_cost_over_best_fixed"] = _ratio_summary(
            [runs["cost"][i]["throughput_tok_s"] / max(runs[p][i]["throughput_tok_s"] for p in fixed) for i in rounds])
        out["paired_cost_over_worst"] = _ratio_summary(
            [runs["cost"][i]["throughput_tok_s"] / min(runs[p][i]["throughput_tok_s"] for p in fixed) for i in rounds])
    if self_check:
        twin = runs[f"{self_check}{TWIN}"]
        out["self_check"] = {"policy": self_check, **_ratio_summary(
            [b["throughput_tok_s"] / a["throughput_tok_s"] for a, b in zip(runs[self_check], twin)])}
    return out


TWIN = "#2"  # the label of a policy's second stack (the self-check)


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def compare(args) -> dict:
    model = str(bc.model_dir(args.model))
    loads = [w for w in workloads(args.quick) if not args.workload or w.name in args.workload]
    policies = list(args.policies)
    if args.self_check and args.self_check not in policies:
        raise SystemExit(f"--self-check {args.self_check}: not among --policies {','.join(policies)}")
    labels = [(p, p) for p in policies] + ([(args.self_check + TWIN, args.self_check)] if args.self_check else [])
    stacks = [PolicyStack(label, policy, model, args) for label, policy in labels]
    runs: dict[str, dict[str, list[dict]]] = {w.name: {label: [] for label, _ in labels} for w in loads}
    load_per_round: list[dict] = []
    started: list[PolicyStack] = []
    try:
        for s in stacks:
            bc.progress(NAME, f"starting {s.label}")
            s.start(loads)
            started.append(s)
        for r in range(args.repeats):
            mark = {"round": r + 1, "loadavg_before": _loadavg()}
            for w in loads:
                # Rotated each round: on a shared machine the load drifts, and a fixed order would favour one.
                k = r % len(stacks)
                for s in stacks[k:] + stacks[:k]:
                    bc.progress(NAME, f"round {r + 1}/{args.repeats}: {w.name} on {s.label}")
                    runs[w.name][s.label].append(s.run(w, r))
            load_per_round.append({**mark, "loadavg_after": _loadavg()})
    finally:
        for s in started:
            s.stop()
    table = {name: {label: _median_runs(rs) for label, rs in by.items()} for name, by in runs.items()}
    summary = {name: summarize(by, args.self_check) for name, by in runs.items()}
    return {"benchmark": NAME, "model": model, "num_blocks": args.num_blocks, "block_size": args.block_size,
            "swap_blocks": args.swap_blocks, "max_batch_tokens": args.max_batch_tokens,
            "swap_min_tokens": args.swap_min_tokens, "victim_policy": args.victim_policy, "repeats": args.repeats,
            "workload_shapes": {w.name: {"num_prompts": w.num_prompts, "input_len": w.input_len,
                                         "output_len": w.output_len, "shared_prefix_len": w.shared_prefix_len}
                                for w in loads},
            "loadavg": load_per_round, "workloads": table, "summary": summary}


def _policy_list(text: str) -> tuple[str, ...]:
    names = tuple(x for x in text.split(",") if x)
    bad = [x for x in names if x not in POLICIES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a comma list of distinct policies among {','.join(POLICIES)}, got {text!r}")
    return names


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="preemption mode policies (recompute, swap, threshold, cost) under memory pressure")
    p.add_argument("--model", default="llama-30m", help="checkpoint dir, 'llama-30m' (default) or 'demo'")
    p.add_argument("--num-blocks", type=int, default=96, help="KV blocks (far fewer than the load wants)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--swap-blocks", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--swap-min-tokens", type=int, default=256, help="the threshold policy's rule")
    p.add_argument("--lease-s", type=float, default=1.5, help="memory lease (heartbeats bring the rates every third)")
    p.add_argument("--victim-policy", default="newest", choices=sorted(VICTIM_POLICIES),
                   help="the memory service's --victim-policy (all stacks)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="rounds; each runs every workload on every policy (rotated order); medians reported")
    p.add_argument("--policies", type=_policy_list, default=POLICIES, help="comma list (default: all four)")
    p.add_argument("--workload", action="append", choices=[w.name for w in workloads(False)],
                   help="only this workload (repeatable; default all): split a long campaign into short runs")
    p.add_argument("--self-check", default=None, choices=POLICIES,
                   help="also run this policy on a second stack every round: its ratio to itself is the noise")
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
