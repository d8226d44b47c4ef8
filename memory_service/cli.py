"""The memory service's entry point: `python -m memory_service` (also `kvpager memory`)."""

from __future__ import annotations

import argparse
import asyncio
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    from memory_service.policy import MODE_POLICIES, VICTIM_POLICIES

    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--lease-s", type=float, default=5.0, help="executor heartbeat lease in seconds")
    pre = p.add_argument_group("preemption (docs/architecture.md, Preemption by measured cost)")
    pre.add_argument("--preemption-mode", choices=MODE_POLICIES, default="cost",
                     help="recompute or swap per victim: cost (default: the cheaper at the executor's measured "
                          "prefill throughput and copy bandwidth), threshold (--swap-min-tokens), recompute, swap")
    pre.add_argument("--swap-min-tokens", type=int, default=256,
                     help="threshold mode (and cost mode until an executor has measured its rates): swap victims "
                          "with at least this many computed tokens")
    pre.add_argument("--victim-policy", choices=sorted(VICTIM_POLICIES), default="newest",
                     help="who is preempted among the least important: newest arrival (default) or the one whose "
                          "preemption wastes least per block freed")
    p.add_argument("--tenant-max-blocks", type=float, default=0.0,
                   help="per-tenant quota of each executor's pool: below 1 a fraction, from 1 a block count "
                        "(default 0: none). A tenant at its quota preempts only its own sequences; no tenant is "
                        "preempted for another; a request that can never fit it is RESOURCE_EXHAUSTED")
    p.add_argument("--tenant-max-pinned-blocks", type=float, default=0.25,
                   help="per-tenant budget of blocks retained for requests that ask (retention_s), per pool: "
                        "below 1 a fraction, from 1 a count (default 0.25; 0: no retention)")
    p.add_argument("--grace-s", type=float, default=5.0, help="graceful stop period")
    p.add_argument("--redis-url", default=os.environ.get("KVPAGER_REDIS_URL") or None,
                   help="mirror the prefix index to this Redis, redis://[user:pass@]host:port/db "
                        "(default: $KVPAGER_REDIS_URL; none = no mirror). Credentials may also come from "
                        "$KVPAGER_REDIS_USERNAME / $KVPAGER_REDIS_PASSWORD")
    lim = p.add_argument_group("what one RPC may ask (docs/security.md, Limits)")
    lim.add_argument("--max-pool-blocks", type=int, default=1 << 22,
                     help="RegisterExecutor refuses pools (device or swap) larger than this many blocks")
    lim.add_argument("--max-total-blocks", type=int, default=1 << 22,
                     help="device + swap blocks of all registered executors together")
    lim.add_argument("--max-executors", type=int, default=64,
                     help="executors registered at once (also: distinct executor ids in one ScorePrefix)")
    lim.add_argument("--max-executor-id-chars", type=int, default=128, help="characters of an executor id")
    lim.add_argument("--max-name-chars", type=int, default=256,
                     help="characters of a registered address, model id, dtype or adapter")
    lim.add_argument("--max-fork-children", type=int, default=1024,
                     help="child sequences of all forks of one Step (or one Fork)")
    lim.add_argument("--max-watchers", type=int, default=16, help="WatchAccounting streams open at once")
    lim.add_argument("--min-watch-interval-ms", type=int, default=100, help="WatchAccounting's shortest interval")
    p.add_argument("--http-port", type=int, default=None,
                   help="serve the live block map (and /metrics, /health) over HTTP here (0: any free port; "
                        "default: none)")
    p.add_argument("--http-host", default=None, help="the block map's listen address (default: --host)")
    from kvpager.security import add_security_arguments
    from kvpager.telemetry import add_observability_arguments

    add_observability_arguments(p)

    add_security_arguments(p, server=True, client=True, admin_token=True, open_read_only=True,
                           read_only_token=True)


def preflight(args: argparse.Namespace) -> None:
    """Ports someone else holds, reported now (naming the flag) instead of as a bind traceback.

    Raises:
        UsageError: the first port that cannot be bound.
    """
    from kvpager.preflight import check_port_free

    check_port_free(args.host, args.port, flag="--port")
    check_port_free(args.metrics_host, args.metrics_port, flag="--metrics-port")
    check_port_free(args.http_host or args.host, args.http_port, flag="--http-port")


def config_from_args(args: argparse.Namespace):
    from kvpager.security import security_from_args
    from memory_service.limits import MemoryLimits
    from memory_service.service import MemoryConfig

    security = security_from_args(args)
    if security.read_only_token and not security.admin_token:
        raise ValueError("--read-only-token needs an admin token (--admin-token-file or $KVPAGER_ADMIN_TOKEN): "
                         "without one every RPC is open")
    for flag in ("tenant_max_blocks", "tenant_max_pinned_blocks"):
        if not getattr(args, flag) >= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag):g}")
    defaults = MemoryLimits()
    limits = MemoryLimits(**{name: getattr(args, name, getattr(defaults, name)) for name in (
        "max_pool_blocks", "max_total_blocks", "max_executors", "max_executor_id_chars", "max_name_chars",
        "max_fork_children", "max_watchers", "min_watch_interval_ms")})
    return MemoryConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                        metrics_host=args.metrics_host, http_port=args.http_port,
                        http_host=args.http_host or args.host, lease_s=args.lease_s,
                        preemption_mode=args.preemption_mode, swap_min_tokens=args.swap_min_tokens,
                        victim_policy=args.victim_policy, tenant_max_blocks=args.tenant_max_blocks,
                        tenant_max_pinned_blocks=args.tenant_max_pinned_blocks,
                        grace_s=args.grace_s,
                        redis_url=getattr(args, "redis_url", None), tls=security.server_tls(),
                        client_tls=security.client_tls(), admin_token=security.admin_token,
                        read_only_token=security.read_only_token, open_read_only=security.open_read_only,
                        limits=limits)


def run(args: argparse.Namespace) -> int:
    from kvpager.preflight import BindError, report
    from kvpager.telemetry import configure_logging
    from memory_service.service import MemoryServer

    configure_logging("memory", args.log_level, log_format=args.log_format)
    try:
        preflight(args)
        config = config_from_args(args)
    except ValueError as exc:  # a port in use, a TLS cert without its key ...
        return report("kvpager memory", exc)

    async def main() -> None:
        server = MemoryServer(config)
        await server.start()
        await server.serve_until_signal()

    try:
        asyncio.run(main())
    except BindError as exc:  # taken between the check and the bind
        return report("kvpager memory", exc)
    return 0


HELP = "run the KV memory service (control plane)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memory_service", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))
