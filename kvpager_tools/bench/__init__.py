"""`kvpager bench NAME`: benchmarks that print JSON. Each module here exposes
`add_bench_parser(bench_subparsers)`."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "memory": "kvpager_tools.bench.memory",
    "mirror": "kvpager_tools.bench.mirror",
    "executor": "kvpager_tools.bench.executor",
    "serve": "kvpager_tools.bench.serve",
    "compare-hf": "kvpager_tools.bench.compare_hf",
    "compare-vllm": "kvpager_tools.bench.compare_vllm",
    "overhead": "kvpager_tools.bench.overhead",
    "routing": "kvpager_tools.bench.routing",
    "penalties": "kvpager_tools.bench.penalties",
    "blockmap": "kvpager_tools.bench.blockmap",
    "preemption": "kvpager_tools.bench.preemption",
    "contention": "kvpager_tools.bench.contention",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints JSON with --json)")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for module_name in BENCHMARKS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # not built yet
                continue
            raise
        module.add_bench_parser(bench_sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
