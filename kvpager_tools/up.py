"""`kvpager up`: the whole stack as local child processes, supervised
(kvpager_tools.supervisor) until Ctrl-C or SIGTERM, which drain it."""

from __future__ import annotations

import argparse
import signal
import time
from datetime import UTC, datetime

from kvpager_tools.stack import Stack, StackError, _tail
from kvpager_tools.stack_config import DEMO_NUM_BLOCKS, StackConfig

# Gateway flags `kvpager up` forwards when given: (flag, type, help). One line
# per flag, so that a new gateway option is one line here. (The scheduling
# group is the gateway's own definition, gateway.cli.add_scheduling_arguments,
# and is always passed on.)
GATEWAY_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--routing", str, "prefix | round-robin"),
    ("--max-prompt-tokens", int, "longest prompt accepted, in tokens"),
    ("--step-timeout-s", float, "deadline of each internal Step and Execute call"),
    ("--tenants", str, "token -> tenant map file (docs/security.md, Tenants)"),
    ("--prefix-sharing", str, "isolated (default) | shared: prefix caching across tenants"),
)

# Memory-service policy flags `kvpager up` forwards when given, the same way.
MEMORY_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--preemption-mode", str, "cost (default) | threshold | recompute | swap"),
    ("--swap-min-tokens", int, "the threshold mode's rule: swap sequences at least this long"),
    ("--victim-policy", str, "newest (default) | least-lost-work"),
    ("--tenant-max-blocks", float, "per-tenant quota per pool: a fraction (< 1) or a block count; 0 = none"),
    ("--tenant-max-pinned-blocks", float, "per-tenant budget of retention pins: a fraction or a count"),
)


def _given(args: argparse.Namespace, flags: tuple[tuple[str, type, str], ...]) -> list[str]:
    out: list[str] = []
    for flag, _kind, _help in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            out += [flag, str(value)]
    return out


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The forwarded gateway flags that were given, then --gateway-args."""
    import shlex

    return _given(args, GATEWAY_FLAGS) + shlex.split(args.gateway_args)


def executor_flags(args: argparse.Namespace) -> list[str]:
    """The executors' CUDA-graph, CPU-binding and huge-page flags, when given (the executor's defaults otherwise)."""
    out = ["--enforce-eager"] if args.enforce_eager else []
    if args.no_cpu_bind:
        out.append("--no-cpu-bind")
    if args.no_huge_pages:
        out.append("--no-huge-pages")
    if args.cuda_graph_max_batch is not None:
        out += ["--cuda-graph-max-batch", str(args.cuda_graph_max_batch)]
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start memory service, executors and gateway locally (Ctrl-C stops)")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the demo model, built once)")
    p.add_argument("--executors", type=int, default=1, help="number of executors")
    p.add_argument("--host", default="127.0.0.1", help="listen address of every service")
    p.add_argument("--memory-port", type=int, default=50051, help="0 = any free port (as for every port flag)")
    p.add_argument("--gateway-port", type=int, default=50050)
    p.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI-compatible HTTP API")
    p.add_argument("--no-http", action="store_true", help="the gateway serves gRPC only")
    p.add_argument("--blockmap-port", type=int, default=8001, help="the memory service's live block map (HTTP)")
    p.add_argument("--no-blockmap", action="store_true", help="no block map")
    p.add_argument("--executor-base-port", type=int, default=50060, help="executor i listens on base + i")
    p.add_argument("--metrics-base-port", type=int, default=None,
                   help="Prometheus: memory = base, gateway = base+1, executor i = base+2+i (default: off)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks per executor")
    size.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size per executor")
    p.add_argument("--swap-blocks", type=int, default=None, help="CPU swap pool blocks per executor")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--redis-url", default=None, help="turn the Redis mirror on (memory service and gateway)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--device", default="cpu", help="executor device: cpu (default) | cuda | cuda:N | auto")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "cpu", "triton"))
    p.add_argument("--model-impl", default="auto", choices=("auto", "kvpager", "transformers"),
                   help="executor forward: kvpager's own for the Llama family (auto) or transformers' code")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA executors: no decode CUDA graphs (faster start, slower small batches)")
    p.add_argument("--cuda-graph-max-batch", type=int, default=None,
                   help="CUDA executors: the largest decode batch replayed as a graph (executor default 256)")
    p.add_argument("--no-cpu-bind", action="store_true",
                   help="CPU executors: leave the step's OpenMP threads unbound (by default bound one per core "
                        "while a step uses every core)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="CPU executors: keep the KV pool on 4 KiB pages (by default advised for transparent huge pages)")
    p.add_argument("--log-dir", default=None, help="child logs (default: a fresh temp dir)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    p.add_argument("--grace-s", type=float, default=10.0, help="per tier on stop, then SIGKILL")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="Ctrl-C / SIGTERM: stop admitting, let requests in flight finish this long, abort the rest, "
                        "then stop gateway, executors, memory in that order")
    p.add_argument("--no-restart", action="store_true",
                   help="a child that exits stops the whole stack (default: it is restarted with backoff)")
    p.add_argument("--restart-backoff-s", type=float, default=1.0,
                   help="first wait before restarting a child that exited; doubles on each quick failure")
    p.add_argument("--restart-backoff-max-s", type=float, default=30.0, help="longest wait between restarts")
    p.add_argument("--gateway-args", default="", metavar="FLAGS",
                   help="more gateway flags, one shell-quoted string (e.g. \"--policy priority\")")
    g = p.add_argument_group("passed to the gateway as they are (kvpager gateway --help)")
    for flag, kind, help_text in GATEWAY_FLAGS:
        g.add_argument(flag, type=kind, default=None, help=help_text)
    m = p.add_argument_group("passed to the memory service as they are (kvpager memory --help)")
    for flag, kind, help_text in MEMORY_FLAGS:
        m.add_argument(flag, type=kind, default=None, help=help_text)
    # A wrong choice is refused here, not by a child restarted over and over.
    from memory_service.policy import MODE_POLICIES, VICTIM_POLICIES

    for dest, choices in (("prefix_sharing", ("isolated", "shared")), ("preemption_mode", MODE_POLICIES),
                          ("victim_policy", sorted(VICTIM_POLICIES))):
        next(a for a in p._actions if a.dest == dest).choices = choices
    p.add_argument("--demo", action="store_true",
                   help="run a short streaming demo against the stack, show block accounting, then stop "
                        f"(pool of {DEMO_NUM_BLOCKS} blocks unless sized)")
    from gateway.cli import add_scheduling_arguments
    from kvpager.security import add_security_arguments

    add_scheduling_arguments(p)  # passed on to the gateway, every one
    # Passed to every child: TLS files as flags, tokens through the environment.
    add_security_arguments(p, server=True, client=True, auth_token=True, admin_token=True, open_read_only=True,
                           read_only_token=True)
    p.add_argument("--no-admin-token", action="store_true",
                   help="do not generate an admin token when none is given (then any local process may call "
                        "the memory service's and executors' mutating RPCs; docs/security.md)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> StackConfig:
    from gateway.cli import scheduling_argv
    from kvpager.security import security_from_args

    security = security_from_args(args)
    num_blocks = args.num_blocks
    if args.demo and num_blocks is None and args.kv_cache_gib is None:
        num_blocks = DEMO_NUM_BLOCKS  # a small pool keeps the accounting readable
    return StackConfig(
        model=args.model, num_executors=args.executors, host=args.host, memory_port=args.memory_port,
        gateway_port=args.gateway_port, http_port=None if args.no_http else args.http_port,
        blockmap_port=None if args.no_blockmap else args.blockmap_port,
        executor_base_port=args.executor_base_port,
        metrics_base_port=args.metrics_base_port, block_size=args.block_size, num_blocks=num_blocks,
        kv_cache_gib=args.kv_cache_gib, swap_blocks=args.swap_blocks, redis_url=args.redis_url,
        dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        model_impl=args.model_impl, log_dir=args.log_dir,
        log_level=args.log_level, ready_timeout_s=args.ready_timeout_s, grace_s=args.grace_s,
        drain_timeout_s=args.drain_timeout_s, generate_admin_token=not args.no_admin_token,
        extra_args={"gateway": scheduling_argv(args) + gateway_flags(args),
                    **({"memory": flags} if (flags := _given(args, MEMORY_FLAGS)) else {}),
                    **({"executor": flags} if (flags := executor_flags(args)) else {})},
        security=security if security.enabled or security.open_read_only or security.read_only_token else None)


def _print_ready(stack: Stack, console) -> None:
    a = stack.addresses
    console.print(f"[bold green]kvpager stack ready[/] (logs in {stack.log_dir})")
    for child in stack.children:
        metrics = f"  metrics :{child.metrics_port}" if child.metrics_port is not None else ""
        console.print(f"  {child.name:<12} {child.address}{metrics}")
    security = stack.config.security
    from kvpager_tools.stack_secrets import ADMIN_TOKEN_FILE, READ_ONLY_TOKEN_FILE

    for label, name in (("admin token", ADMIN_TOKEN_FILE), ("read-only token", READ_ONLY_TOKEN_FILE)):
        if (stack.secrets_dir / name).is_file():
            console.print(f"  {label} (generated, mode 600): {stack.secrets_dir / name}")
    console.print("try:")
    tls = ""
    if security is not None and security.tls_cert:
        tls = f" --tls-ca {security.tls_ca}" if security.tls_ca else ""
        if security.tls_require_client_auth:
            tls += " --tls-client-cert CERT --tls-client-key KEY"
    gen_token = " (with $KVPAGER_AUTH_TOKEN set)" if security is not None and security.auth_token else ""
    blk_token = ""
    if security is not None and security.admin_token and not security.open_read_only:
        blk_token = " (with $KVPAGER_ADMIN_TOKEN[_FILE] or $KVPAGER_READ_ONLY_TOKEN[_FILE] set)"
    console.print(f"  kvpager generate \"Once upon a time\" --address {a.gateway} --max-tokens 32{tls}{gen_token}")
    console.print(f"  kvpager blocks --address {a.memory}{tls}{blk_token}")
    if a.blockmap is not None:
        key = " (it asks for the admin or read-only token)" if security is not None and security.admin_token \
            and not security.open_read_only else ""
        console.print(f"  the live block map: {a.blockmap}{key}")
    if a.http is not None:
        key = " (with the auth token as the API key)" if security is not None and security.auth_token else ""
        console.print(f"  OpenAI-compatible API: {a.http}/v1{key}")
        console.print(f"  curl {a.http}/v1/completions -H 'Content-Type: application/json' "
                      f"-d '{{\"prompt\": \"Once upon a time\", \"max_tokens\": 16}}'")


async def _demo(stack: Stack, console) -> None:
    import asyncio

    from kvpager.channel import make_channel
    from kvpager.v1 import memory_pb2, memory_pb2_grpc
    from kvpager_tools.blocks import render_table, snapshot_dict
    from kvpager_tools.generate import run_demo

    a = stack.addresses
    security = stack.config.security
    admin = security.admin_token if security is not None else None
    auth = security.auth_token if security is not None else None
    async with make_channel(a.memory, tls=stack.client_tls, token=admin) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        peak: dict = {}

        async def watch() -> None:  # keep the snapshot with the most blocks in use
            async for snap in stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=100)):
                data = snapshot_dict(snap)
                if data["used_blocks"] >= peak.get("used_blocks", -1):
                    peak.clear()
                    peak.update(data)

        watcher = asyncio.ensure_future(watch())
        try:
            await run_demo(a.gateway, console, tls=stack.client_tls, token=auth)
        finally:
            watcher.cancel()
        final = snapshot_dict(await stub.GetAccounting(memory_pb2.AccountingRequest(), timeout=10))
    if peak:
        console.print("\n[bold]KV blocks at peak[/] (most blocks in use):")
        console.print(render_table(peak))
    console.print("\n[bold]KV blocks after every request finished[/] (cached blocks stay for prefix hits):")
    console.print(render_table(final))


def _run_demo(stack: Stack, console) -> int:
    import asyncio

    import grpc

    try:
        asyncio.run(_demo(stack, console))
    except grpc.RpcError as exc:
        console.print(f"[red]demo failed: {exc.code().name}: {exc.details()}[/]")
        return 1
    return 0


def _preflight(config: StackConfig) -> None:
    """A wrong --model, reported before anything starts."""
    from kvpager.preflight import check_model_dir

    if config.model is not None:
        from executor_service.model_runner import SUPPORTED_MODEL_TYPES

        check_model_dir(config.model, supported=SUPPORTED_MODEL_TYPES)


def _supervise(stack: Stack, args: argparse.Namespace, console) -> int:
    """Until Ctrl-C / SIGTERM (KeyboardInterrupt); with --no-restart, until a child exits (returns 1)."""
    from kvpager_tools.supervisor import Backoff, Supervisor

    if args.no_restart:
        while (dead := stack.poll()) is None:
            time.sleep(0.2)
        name, exit_code = dead
        console.print(f"[red]{name} exited with code {exit_code}[/]; its log ({stack.log_path(name)}) ends:")
        console.print(_tail(stack.log_path(name)), markup=False, highlight=False)
        return 1

    import json

    def record(event: str, **fields) -> None:  # supervisor.log: one JSON line per event, as the services log
        line = {"event": event, **fields, "timestamp": datetime.now(UTC).isoformat()}
        with open(stack.log_dir / "supervisor.log", "a") as f:
            f.write(json.dumps(line) + "\n")

    def exited(event) -> None:
        console.print(f"[yellow]{event.child} exited with code {event.exit_code}[/]; restart {event.num_restarts} "
                      f"in {event.delay_s:g}s (log: {stack.log_path(event.child)})")
        record("child exited", level="warning", child=event.child, exit_code=event.exit_code,
               restart_in_s=event.delay_s, num_restarts=event.num_restarts)

    def restarted(name: str) -> None:
        console.print(f"{name} restarted (pid {stack.pid(name)})")
        record("child restarted", level="info", child=name, pid=stack.pid(name))

    supervisor = Supervisor(stack, Backoff(args.restart_backoff_s, args.restart_backoff_max_s),
                            on_exit=exited, on_restart=restarted)
    metrics = None
    if stack.config.supervisor_metrics_port is not None:
        from kvpager.telemetry import MetricsServer

        metrics = MetricsServer(stack.config.supervisor_metrics_port, stack.config.host,
                                supervisor.metrics.registry)
        console.print(f"  supervisor   metrics :{metrics.port}")
    try:
        supervisor.run()
    finally:
        if metrics is not None:
            metrics.close()
    return 0  # not reached: run() ends by KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvpager.preflight import report

    console = Console()
    try:
        config = config_from_args(args)
        _preflight(config)
    except ValueError as exc:
        return report("kvpager up", exc)
    stack = Stack(config)
    # SIGTERM behaves like Ctrl-C: unwind, then drain and stop the children in order.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    code = 0
    try:
        console.print(f"starting {config.num_executors} executor(s)"
                      f" on {config.model or 'the demo model (built on first use)'}, device {config.device} …")
        stack.start()
        _print_ready(stack, console)
        if args.demo:
            return _run_demo(stack, console)
        console.print(f"Ctrl-C stops the stack (requests in flight get {config.drain_timeout_s:g}s to finish).")
        code = _supervise(stack, args, console)
    except StackError as exc:
        if exc.usage:  # e.g. a port in use: the operator's to fix, named by its flag
            return report("kvpager up", exc)
        console.print(f"[red]kvpager up: {exc}[/]" + (f"; its log ({exc.log_path}) ends:" if exc.log_tail else ""))
        if exc.log_tail:
            console.print(exc.log_tail, markup=False, highlight=False)
        code = 1
    except KeyboardInterrupt:
        code = 0
    finally:
        # Ignore further Ctrl-C while stopping: the drain and grace periods bound it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if stack.procs:
            console.print(f"stopping: the gateway drains (up to {config.drain_timeout_s:g}s), then executors, "
                          "then memory …")
        codes = stack.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous)
        if codes:
            console.print("stopped: " + ", ".join(f"{n} ({c})" for n, c in codes.items()))
    return code
