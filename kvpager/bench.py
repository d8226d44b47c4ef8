"""`kvpager bench NAME`: benchmarks that print JSON. Each lives beside the
code it measures and exposes `add_bench_parser(bench_subparsers)`."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "memory": "memory_service.bench",
    "mirror": "memory_service.bench_mirror",
    "executor": "executor_service.bench",
    "serve": "gateway.bench_serve",
    "compare-hf": "gateway.bench_compare_hf",
    "overhead": "gateway.bench_overhead",
    "routing": "gateway.bench_routing",
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
