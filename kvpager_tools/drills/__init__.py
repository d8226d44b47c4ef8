"""Fault drills: ``kvpager drill NAME [--json]``.

Each drill starts a stack on loopback (``kvpager_tools.stack.Stack``), does
something unpleasant to it, and ends with the same check: every block is back
(memory-service accounting at its baseline), the accounting identities hold,
every service is alive and SERVING, and nothing wrong was served. It prints
one JSON summary (``DrillResult``) and exits 1 when the check fails.

    bad-input       the validation battery, malformed protobufs and garbage bytes on every method of every port
    fuzz            randomly generated Generate requests and memory-service calls for a time budget
    cancel          many streams cancelled, aborted or timed out at random points
    executor-kill   SIGKILL an executor mid-stream, then restart it (new incarnation)
    memory-restart  restart the memory service under load with the Redis mirror on
    redis-kill      kill and restart Redis under load
    load            many concurrent streams (1,000 by default): throughput, p99 latencies, peak RSS
    http-load       1,000 concurrent streaming HTTP requests (OpenAI API): each completes or gets 429, no 5xx
    soak            a random mix of the above for --duration-s
    abuse           one request or RPC per case that used to stall, bloat or steer the stack, beside a bystander

docs/reliability.md has the figures of full runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvpager_tools.drills import runner as _runner
from kvpager_tools.drills.common import DrillResult
from kvpager_tools.drills.runner import (DRILL_DEFAULTS, DRILLS, Needs, StackOptions, add_option_flags, drill_options,
                                         drill_stack, options_from_args, run_drill)

# Not `load` here: importing the submodule kvpager_tools.drills.load rebinds that name.
_load = _runner.load

__all__ = ["DRILLS", "DrillResult", "Needs", "StackOptions", "drill_options", "drill_stack", "register", "run_drill"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drill", help="run a fault drill against a local stack (JSON summary)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    drills = p.add_subparsers(dest="drill", metavar="NAME")
    for name in DRILLS:
        try:
            module = _load(name)
        except Exception as exc:  # noqa: BLE001 - a broken drill must never break `kvpager <service>`
            d = drills.add_parser(name, help=f"(unavailable: {exc})")
            d.set_defaults(func=lambda args, exc=exc: print(f"kvpager drill: {exc}", file=sys.stderr) or 2)
            continue
        d = drills.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        d.add_argument("--json", action="store_true", help="print only the JSON summary")
        add_option_flags(d, module.Options, f"{name} options")
        add_option_flags(d, StackOptions, "stack", DRILL_DEFAULTS)
        d.set_defaults(func=main, drill_name=name)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def main(args: argparse.Namespace) -> int:
    import asyncio

    from kvpager_tools.drills.runner import run_async
    from kvpager_tools.stack import StackError

    module = _load(args.drill_name)
    opts = options_from_args(module.Options, args)
    stack_opts = options_from_args(StackOptions, args)
    needs = module.needs(opts) if callable(getattr(module, "needs", None)) else module.NEEDS
    if not args.json:
        print(f"drill {args.drill_name}: starting a stack ({max(stack_opts.executors, needs.executors)} "
              f"executor(s){', Redis mirror' if needs.redis else ''}{', mTLS + tokens' if stack_opts.secure else ''})",
              file=sys.stderr, flush=True)
    try:
        with drill_stack(needs, stack_opts) as env:
            if not args.json:
                print(f"drill {args.drill_name}: running (logs in {env.stack.log_dir})", file=sys.stderr, flush=True)
            result = asyncio.run(run_async(env, module, opts))
    except (StackError, FileNotFoundError) as exc:
        print(f"kvpager drill {args.drill_name}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=None if args.json else 2))
    return 0 if result.ok else 1
