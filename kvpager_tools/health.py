"""`kvpager health` (also ``python -m kvpager_tools.health``): one
grpc.health.v1 Check, exit 0 only on SERVING. The compose health checks.

TLS-aware: with ``--tls-ca`` (and, for mutual TLS, ``--tls-client-cert`` /
``--tls-client-key``) it checks over TLS, the way the services' own
channels connect. Each flag defaults to an environment variable
(``$KVPAGER_TLS_CA``, ``$KVPAGER_TLS_CLIENT_CERT``, ``$KVPAGER_TLS_CLIENT_KEY``;
the name checked, ``$KVPAGER_HEALTH_SERVER_NAME``, else
``$KVPAGER_TLS_SERVER_NAME``), the same the service itself reads, so one
compose health check works with TLS on or off. Health needs no token (it is
open on every service).
"""

from __future__ import annotations

import argparse
import os
import sys

HELP = "one grpc.health.v1 check of a service (exit 0 only when SERVING)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("KVPAGER_HEALTH_ADDRESS", "127.0.0.1:50051"),
                   help="host:port of the service (default: $KVPAGER_HEALTH_ADDRESS, else 127.0.0.1:50051)")
    p.add_argument("--service", default="", help="the health service name (default: the whole server)")
    p.add_argument("--timeout-s", type=float, default=3.0)
    from kvpager.security import add_client_tls_arguments

    add_client_tls_arguments(p)


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpager.channel import make_channel
    from kvpager.preflight import report
    from kvpager.security import security_from_args

    if args.tls_server_name is None:  # the name in the service's own certificate, not the host dialled
        args.tls_server_name = os.environ.get("KVPAGER_HEALTH_SERVER_NAME") or None
    try:
        tls = security_from_args(args).client_tls()
    except ValueError as exc:
        return report("kvpager health", exc)
    with make_channel(args.address, tls=tls, aio=False) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s)
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help=HELP)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpager_tools.health", description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
