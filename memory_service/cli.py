"""`kvpager memory`: run the memory service."""

from __future__ import annotations

import argparse
import asyncio
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (default: none)")
    p.add_argument("--lease-s", type=float, default=5.0, help="executor heartbeat lease in seconds")
    p.add_argument("--swap-min-tokens", type=int, default=256,
                   help="preempt by swap (not recompute) from this many computed tokens")
    p.add_argument("--grace-s", type=float, default=5.0, help="graceful stop period")
    p.add_argument("--redis-url", default=os.environ.get("KVPAGER_REDIS_URL") or None,
                   help="mirror the prefix index to this Redis, redis://[user:pass@]host:port/db "
                        "(default: $KVPAGER_REDIS_URL; none = no mirror). Credentials may also come from "
                        "$KVPAGER_REDIS_USERNAME / $KVPAGER_REDIS_PASSWORD")
    p.add_argument("--log-level", default="INFO")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="run the KV memory service (control plane)")
    add_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    from memory_service.service import MemoryConfig

    return MemoryConfig(host=args.host, port=args.port, metrics_port=args.metrics_port, lease_s=args.lease_s,
                        swap_min_tokens=args.swap_min_tokens, grace_s=args.grace_s,
                        redis_url=getattr(args, "redis_url", None))


def run(args: argparse.Namespace) -> int:
    from kvpager.telemetry import configure_logging
    from memory_service.service import MemoryServer

    configure_logging("memory", args.log_level)

    async def main() -> None:
        server = MemoryServer(config_from_args(args))
        await server.start()
        print(f"memory service listening on {server.address}"
              + (f", metrics on :{server.runtime.metrics_port}" if server.runtime.metrics_port else ""), flush=True)
        await server.serve_until_signal()

    asyncio.run(main())
    return 0
