"""`kvpager bench routing --json`: prefix-aware routing vs round-robin.

Four executors (the 30M random Llama of compare-hf, small KV pools: the
caches compete) behind one gateway; a prefix-repetition workload
(``--num-prefixes`` shared prefixes, each followed by distinct suffixes,
groups interleaved) from a closed-loop client (``--max-concurrency``
requests in flight). The default model is the 30M one because prefix
routing saves prefill compute: on the 0.2M demo model (``--model demo``) a
forward costs next to nothing and the comparison measures RPC overhead. The same trace runs once with
``--routing prefix`` (the executor already holding the longest prefix wins,
balanced against load) and once with ``--routing round-robin``, each on a
fresh stack, ``--repeats`` times alternating.

Reported: the memory service's prefix hit rate against the trace's best
possible hit rate (every shared full block of a prompt seen before is a
hit, unbounded cache), request throughput and p90 TTFT, and the ratios
prefix / round-robin (throughput) and round-robin / prefix (p90 TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from kvpager_tools.bench import common as bc

NAME = "routing"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="prefix-aware routing vs round-robin over 4 executors")
    p.add_argument("--model", default="llama-30m", help="checkpoint dir, 'llama-30m' (default) or 'demo'")
    p.add_argument("--executors", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks per executor (small: caches compete)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1, help="runs per routing (alternating); medians reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def run_routing(routing: str, model: str, requests, args) -> dict:
    opts = bc.StackOptions(model=model, executors=args.executors, num_blocks=args.num_blocks or 0,
                           routing=routing)
    with bc.embedded_stack(opts) as stack:
        a = stack.addresses
        before = asyncio.run(bc.accounting(a.memory))
        res = asyncio.run(bc.run_load(a.gateway, requests, max_concurrency=args.max_concurrency,
                                      ignore_eos=True, seed=args.seed))
        after = asyncio.run(bc.accounting(a.memory))
    m = bc.load_metrics(res)
    mem = bc.accounting_delta(before, after)
    return {"routing": routing, "completed": m["completed"], "failed": m["failed"],
            "duration_s": m["duration_s"], "request_throughput": m["request_throughput"],
            "output_throughput": m["output_throughput"], "ttft_p90_ms": m["ttft_ms"]["p90"],
            "ttft_median_ms": m["ttft_ms"]["median"], "prefix_hit_rate": mem["prefix_hit_rate"],
            "preemptions": mem["preemptions"], "evictions": mem["evictions"]}


def compare_routing(args) -> dict:
    model = str(bc.model_dir(args.model))
    lo, hi = bc.token_range(model)
    requests = bc.make_dataset("prefix-repetition", args.num_prompts, token_lo=lo, token_hi=hi, seed=args.seed,
                               output_len=args.output_len, num_prefixes=args.num_prefixes,
                               prefix_len=args.prefix_len, suffix_len=args.suffix_len)
    best = bc.best_hit_rate(requests, 16)
    runs: dict[str, list[dict]] = {"prefix": [], "round-robin": []}
    for r in range(args.repeats):
        for routing in ("prefix", "round-robin"):
            bc.progress(NAME, f"run {r + 1}/{args.repeats}: {routing}")
            runs[routing].append(run_routing(routing, model, requests, args))

    def med(routing: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[routing])

    p, rr = "prefix", "round-robin"
    summary = {k: {key: med(k, key) for key in ("request_throughput", "output_throughput", "ttft_p90_ms",
                                                "prefix_hit_rate", "preemptions", "evictions")} for k in runs}
    tput = [a["request_throughput"] / b["request_throughput"] for a, b in zip(runs[p], runs[rr])]
    ttft = [b["ttft_p90_ms"] / a["ttft_p90_ms"] for a, b in zip(runs[p], runs[rr])]
    return {
        "benchmark": NAME, "model": model, "executors": args.executors, "num_blocks": args.num_blocks,
        "num_prompts": args.num_prompts, "num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len, "output_len": args.output_len, "max_concurrency": args.max_concurrency,
        "repeats": args.repeats,
        "best_hit_rate": round(best, 5),
        "prefix": summary[p], "round_robin": summary[rr],
        "hit_rate_vs_best": round(summary[p]["prefix_hit_rate"] / best, 4) if best else None,
        "round_robin_hit_rate_vs_best": round(summary[rr]["prefix_hit_rate"] / best, 4) if best else None,
        "throughput_ratio": round(statistics.median(tput), 3),
        "ttft_p90_ratio": round(statistics.median(ttft), 3),
        "runs": runs,
    }


def _main(args: argparse.Namespace) -> int:
    from kvpager_tools.bench.serve import machine

    result = compare_routing(args)
    result["machine"] = machine()
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
