"""`kvpager bench contention --json`: a lone stream's latency while other
processes take the CPU, and how soon it recovers once they stop.

A CPU executor shares its cores with whatever else the machine runs; it
picks each step's thread count from measured step times
(executor_service/cpu.py). This runs the stack on the model, sends one
request at a time (the same prompt, a fresh cache salt each, so every
prefill computes) and reports each request's time to first token and time
per output token in three phases: quiet, while ``--spinners`` busy-looping
processes run, and after they stop. The figure to watch is ``after``'s
first requests against ``quiet``: a tuner that stays on fewer threads once
the load is gone shows there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

from kvpager_tools.bench import common as bc

NAME = "contention"
PHASES = ("quiet", "loaded", "after")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="a lone stream's latency quiet, under CPU load, and after the load stops")
    p.add_argument("--model", default="llama-30m", help="'llama-30m' (default), 'llama-0.5b', 'demo' or a checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--prompt-len", type=int, default=149, help="prompt tokens (random ids, one prompt throughout)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--spinners", type=int, default=os.cpu_count() or 1,
                   help="busy-looping processes during the loaded phase (default: one per core)")
    p.add_argument("--requests", default="6,10,24", metavar="QUIET,LOADED,AFTER",
                   help="requests in each phase, one at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def _one(address: str, request: bc.BenchRequest, salt: str) -> dict:
    res = asyncio.run(bc.run_load(bc.Target(address=address), [request], ignore_eos=True, cache_salt=salt))
    rec = res.records[0]
    if not rec.ok:
        raise RuntimeError(f"{salt}: the request failed: {rec.error}")
    return {"ttft_ms": round(rec.ttft_s * 1e3, 2), "tpot_ms": round(rec.tpot_s * 1e3, 3) if rec.tpot_s else None}


def _spin(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _phase_summary(rows: list[dict]) -> dict:
    def med(key: str, part: list[dict]) -> float | None:
        vals = [r[key] for r in part if r[key] is not None]
        return round(statistics.median(vals), 2) if vals else None

    half = rows[: max(1, len(rows) // 2)]
    return {"requests": len(rows), "ttft_ms": med("ttft_ms", rows), "tpot_ms": med("tpot_ms", rows),
            "first_half_ttft_ms": med("ttft_ms", half), "ttft_ms_each": [r["ttft_ms"] for r in rows]}


def measure(address: str, request: bc.BenchRequest, counts: dict[str, int], spinners: int) -> dict:
    """``counts``: phase -> requests. One warm-up request first (a fresh
    executor builds its kernels on its first shapes)."""
    _one(address, request, f"contention-warmup-{time.time()}")
    out: dict = {}
    procs: list[subprocess.Popen] = []
    try:
        for phase in PHASES:
            if phase == "loaded":
                procs = _spin(spinners)
                time.sleep(0.5)              # the spinners are running before the first request
            elif phase == "after":
                for p in procs:
                    p.kill()
                for p in procs:
                    p.wait()
                procs = []
            bc.progress(NAME, f"{phase}: {counts[phase]} requests, one at a time")
            load = os.getloadavg()[0]
            rows = [_one(address, request, f"contention-{phase}-{i}-{time.time()}") for i in range(counts[phase])]
            out[phase] = {**_phase_summary(rows), "loadavg_1m": load}
    finally:
        for p in procs:
            p.kill()
    quiet = out["quiet"]["ttft_ms"]
    if quiet:
        out["after_first_half_ttft_vs_quiet"] = round(out["after"]["first_half_ttft_ms"] / quiet, 3)
        out["loaded_ttft_vs_quiet"] = round(out["loaded"]["ttft_ms"] / quiet, 3)
    return out


def _main(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != 3 or min(counts) < 1:
        print("--requests takes three positive counts: QUIET,LOADED,AFTER", file=sys.stderr)
        return 2
    if args.spinners < 1 or args.prompt_len < 1 or args.max_new_tokens < 2:
        print("--spinners and --prompt-len must be >= 1, --max-new-tokens >= 2", file=sys.stderr)
        return 2
    model = str(bc.model_dir(args.model))
    lo, hi = bc.token_range(model)
    rng = random.Random(args.seed)
    request = bc.BenchRequest(prompt_ids=[rng.randrange(lo, hi) for _ in range(args.prompt_len)],
                              max_tokens=args.max_new_tokens)
    opts = bc.StackOptions(model=model, dtype=args.dtype, num_blocks=512)
    with bc.embedded_stack(opts) as stack:
        result = measure(stack.addresses.gateway, request, dict(zip(PHASES, counts)), args.spinners)
    result = {"benchmark": NAME, "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
              "max_new_tokens": args.max_new_tokens, "spinners": args.spinners, "cpus": os.cpu_count(),
              **result}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
