"""The ``kvpager`` command: one front door to the services and the tooling.

The three services keep their own entry points (``python -m memory_service``,
``python -m executor_service``, ``python -m gateway``); ``kvpager memory |
executor | gateway`` are the same parsers and runs. Every other subcommand is
tooling in this package and exposes ``register(subparsers)``, which adds its
parser and sets ``func(args) -> int``; this module only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvpager.grpc_logging import quiet_grpc_core

quiet_grpc_core()  # before any subcommand imports grpc

# service subcommand -> the service's entry-point module (add_arguments, run, HELP)
SERVICES = {
    "memory": "memory_service.cli",
    "executor": "executor_service.cli",
    "gateway": "gateway.cli",
}

# tooling subcommand -> module exposing register(subparsers)
TOOLS = {
    "up": "kvpager_tools.up",
    "demo": "kvpager_tools.demo",
    "blocks": "kvpager_tools.blocks",
    "demo-model": "kvpager_tools.demo_model",
    "generate": "kvpager_tools.generate",
    "bench": "kvpager_tools.bench",
    "drill": "kvpager_tools.drills",
    "health": "kvpager_tools.health",
}

ORDER = ("up", "demo", "memory", "blocks", "executor", "demo-model", "gateway", "generate", "bench", "drill", "health")


def _executor_run(args: argparse.Namespace) -> int:
    """`kvpager executor` without --model serves the demo model (built once);
    `python -m executor_service` itself always needs a checkpoint."""
    from executor_service import cli

    if args.model is None:
        from kvpager_tools.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    return cli.run(args)


def _add_service(sub: argparse._SubParsersAction, name: str) -> None:
    module = importlib.import_module(SERVICES[name])
    p = sub.add_parser(name, help=module.HELP)
    module.add_arguments(p)
    if name == "executor":
        p.set_defaults(func=_executor_run)
        for action in p._actions:
            if action.dest == "model":
                action.required = False
                action.help = "local HF checkpoint directory (default: the demo model, built once)"
    else:
        p.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpager", description="LLM serving built around PagedAttention")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in ORDER:
        if name in SERVICES:
            _add_service(sub, name)
        else:
            importlib.import_module(TOOLS[name]).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
