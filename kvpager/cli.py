"""The ``kvpager`` command. Each subcommand lives beside the code it drives
and exposes ``register(subparsers)``, which adds its parser and sets
``func(args) -> int``; this module only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing register(subparsers)
SUBCOMMANDS = {
    "up": "kvpager.stack",
    "demo": "kvpager.demo",
    "memory": "memory_service.cli",
    "blocks": "memory_service.blocks_cli",
    "executor": "executor_service.cli",
    "demo-model": "executor_service.demo_model",
    "gateway": "gateway.cli",
    "generate": "gateway.client_cli",
    "bench": "kvpager.bench",
    "drill": "kvpager.drills",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpager", description="LLM serving built around PagedAttention")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # not built yet; anything else is a real error
                continue
            raise
        module.register(sub)
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
