"""`kvpager bench contention --json`: a lone stream's latency while other
processes take the CPU, and how soon it recovers once they stop.

A CPU executor shares its cores with whatever else the machine runs; it
picks each step's thread count from measured step times
(executor_service/cpu.py). This runs the stack on the model, sends one
request at a time (the same prompt, a fresh cache salt each, so every
prefill computes) and reports each request's time to first token, time
per output token and end-to-end time in three phases: quiet, while ``--spinners`` busy-looping
processes run, and after they stop. The figure to watch is ``after``'s
first requests against ``quiet``: a tuner that stays on fewer threads once
the load is gone shows there.

With ``--vllm-python``, vLLM's OpenAI server (the compare-vllm settings)
runs beside the stack and every phase alternates requests between the two
(kvpager, vLLM, kvpager, ...), both over HTTP with the same client, ``--gap-s``
apart (vLLM's CPU worker spins for about a second after a request; the loaded
phase never goes quiet, so a fixed gap, not ``bc.settle``): each phase's
first-token and end-to-end ratios are kvpager's over vLLM's under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvpager_tools.bench import common as bc

NAME = "contention"
PHASES = ("quiet", "loaded", "after")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="a lone stream's latency quiet, under CPU load, and after the load stops")
    p.add_argument("--model", default="llama-30m",
                   help="'llama-30m' (default), 'llama-0.5b', 'demo' or a checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--prompt-len", type=int, default=149, help="prompt tokens (random ids, one prompt throughout)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--spinners", type=int, default=os.cpu_count() or 1,
                   help="busy-looping processes during the loaded phase (default: one per core)")
    p.add_argument("--requests", default="6,10,24", metavar="QUIET,LOADED,AFTER",
                   help="requests in each phase, one at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", metavar="PATH", help="python of a venv with vLLM: run it beside, same phases")
    p.add_argument("--gap-s", type=float, default=None,
                   help="pause between requests (default: 0 alone, 1.5 with --vllm-python)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def _one(target: bc.Target, request: bc.BenchRequest, salt: str) -> dict:
    res = asyncio.run(bc.run_load(target, [request], ignore_eos=True, cache_salt=salt))
    rec = res.records[0]
    if not rec.ok:
        raise RuntimeError(f"{salt}: the request failed: {rec.error}")
    return {"ttft_ms": round(rec.ttft_s * 1e3, 2), "tpot_ms": round(rec.tpot_s * 1e3, 3) if rec.tpot_s else None,
            "e2e_ms": round(rec.e2e_s * 1e3, 2)}


def _spin(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _phase_summary(rows: list[dict]) -> dict:
    def med(key: str, part: list[dict]) -> float | None:
        vals = [r[key] for r in part if r[key] is not None]
        return round(statistics.median(vals), 2) if vals else None

    half = rows[: max(1, len(rows) // 2)]
    return {"requests": len(rows), "ttft_ms": med("ttft_ms", rows), "tpot_ms": med("tpot_ms", rows),
            "e2e_ms": med("e2e_ms", rows),
            "first_half_ttft_ms": med("ttft_ms", half), "ttft_ms_each": [r["ttft_ms"] for r in rows]}


def measure(targets: dict[str, bc.Target], request: bc.BenchRequest, counts: dict[str, int], spinners: int,
            gap_s: float = 0.0) -> dict:
    """``targets``: label -> server, visited in turn for each request;
    ``counts``: phase -> requests (each, to each server). Two warm-up
    requests first (a fresh executor builds its kernels on its first shapes)."""
    for label, target in targets.items():
        for i in range(2):
            _one(target, request, f"contention-warmup-{label}-{i}-{time.time()}")
    out: dict = {label: {} for label in targets}
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
            rows: dict[str, list[dict]] = {label: [] for label in targets}
            for i in range(counts[phase]):
                for label, target in targets.items():
                    time.sleep(gap_s)
                    rows[label].append(_one(target, request, f"contention-{phase}-{label}-{i}-{time.time()}"))
            for label in targets:
                out[label][phase] = {**_phase_summary(rows[label]), "loadavg_1m": load}
    finally:
        for p in procs:
            p.kill()
    for phases in out.values():
        quiet = phases["quiet"]["ttft_ms"]
        phases["after_first_half_ttft_vs_quiet"] = round(phases["after"]["first_half_ttft_ms"] / quiet, 3)
        phases["loaded_ttft_vs_quiet"] = round(phases["loaded"]["ttft_ms"] / quiet, 3)
    if "vllm" in out:
        def ratio(phase: str, key: str) -> float:
            return round(out["kvpager"][phase][key] / out["vllm"][phase][key], 3)

        out["ttft_ratio_vs_vllm"] = {phase: ratio(phase, "ttft_ms") for phase in PHASES}
        # A server whose stream stalls under load sends its tokens together at the
        # end: its first token is then its last, and end to end is the fair figure.
        out["e2e_ratio_vs_vllm"] = {phase: ratio(phase, "e2e_ms") for phase in PHASES}
        out["after_first_half_ttft_ratio_vs_vllm"] = ratio("after", "first_half_ttft_ms")
    return out


def _main(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != 3 or min(counts) < 1:
        print("--requests takes three positive counts: QUIET,LOADED,AFTER", file=sys.stderr)
        return 2
    if args.spinners < 1 or args.prompt_len < 1 or args.max_new_tokens < 2 or (args.gap_s or 0) < 0:
        print("--spinners and --prompt-len must be >= 1, --max-new-tokens >= 2, --gap-s >= 0", file=sys.stderr)
        return 2
    model = str(bc.model_dir(args.model))
    lo, hi = bc.token_range(model)
    rng = random.Random(args.seed)
    request = bc.BenchRequest(prompt_ids=[rng.randrange(lo, hi) for _ in range(args.prompt_len)],
                              max_tokens=args.max_new_tokens)
    gap_s = args.gap_s if args.gap_s is not None else (1.5 if args.vllm_python else 0.0)
    opts = bc.StackOptions(model=model, dtype=args.dtype, num_blocks=512)
    with contextlib.ExitStack() as es:
        targets = {}
        if args.vllm_python:
            from kvpager_tools.bench.compare_vllm_online import vllm_server

            url = es.enter_context(vllm_server(Path(args.vllm_python), model, args.dtype, max_num_seqs=32,
                                               max_model_len=max(512, args.prompt_len + args.max_new_tokens + 1)))
            targets["vllm"] = bc.Target(backend="openai", base_url=url)
        stack = es.enter_context(bc.embedded_stack(opts))
        targets = {"kvpager": bc.Target(backend="openai", base_url=stack.addresses.http), **targets}
        result = measure(targets, request, dict(zip(PHASES, counts)), args.spinners, gap_s)
    result = {"benchmark": NAME, "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len,
              "max_new_tokens": args.max_new_tokens, "spinners": args.spinners, "cpus": os.cpu_count(),
              "gap_s": gap_s, "client": "streamed /v1/completions, token-id prompt, greedy, ignore_eos",
              **result}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
