"""`kvpager blocks`: live block accounting from a running memory service."""

from __future__ import annotations

import argparse
import json
import sys

# The JSON keys promised to operators, in display order.
KEYS = ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "block_usage", "live_tokens",
        "allocated_slots", "token_occupancy", "kv_utilization", "logical_blocks", "physical_blocks",
        "sharing_saved_blocks", "prefix_hit_rate", "prefix_query_tokens", "prefix_hit_tokens",
        "recompute_query_tokens", "recompute_hit_tokens", "recompute_hit_rate",
        "preemptions", "preemptions_recompute", "preemptions_swap", "contiguous_equivalent_blocks",
        "contiguous_declared_blocks", "num_sequences", "num_swapped_sequences", "swap_free_blocks",
        "copy_on_write_copies", "evictions",
        "pinned_blocks", "preempt_recompute_tokens", "preempt_swap_bytes", "preempt_cost_s", "preempt_saved_s")
# Per KV group of an executor with a table per group (kv_layout hybrid): "kv_groups", a list of these.
GROUP_KEYS = ("window", "used_blocks", "logical_blocks", "full_attention_blocks", "window_saved_blocks",
              "max_seq_blocks")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("blocks", help="show live KV block accounting of a memory service")
    p.add_argument("--address", default="127.0.0.1:50051", help="memory service host:port")
    p.add_argument("--executor", default="", help="only this executor")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--watch", action="store_true", help="keep updating (Ctrl-C to stop)")
    p.add_argument("--interval-ms", type=int, default=1000)
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument("--token", default=None,
                   help="admin or read-only token of a memory service that requires one (default: "
                        "$KVPAGER_ADMIN_TOKEN, $KVPAGER_ADMIN_TOKEN_FILE, $KVPAGER_READ_ONLY_TOKEN, "
                        "$KVPAGER_READ_ONLY_TOKEN_FILE)")
    from kvpager.security import add_client_tls_arguments

    add_client_tls_arguments(p)
    p.set_defaults(func=run)


def snapshot_dict(snap) -> dict:
    """AccountingSnapshot -> the documented JSON shape."""
    def part(p) -> dict:
        return {"executor_id": p.executor_id, **{k: getattr(p, k) for k in KEYS},
                "kv_groups": [{k: getattr(g, k) for k in GROUP_KEYS} for g in p.kv_groups]}

    out = part(snap.total)
    del out["executor_id"], out["kv_groups"]
    out["executors"] = [part(p) for p in snap.executors]
    out["mirror"] = {"enabled": snap.mirror_enabled, "stale": snap.mirror_stale,
                     "lag_events": snap.mirror_lag_events}
    out["step_id"] = snap.step_id
    out["time_s"] = snap.time_s
    return out


def render_table(data: dict):
    from rich.table import Table

    table = Table(title="kvpager KV blocks", show_lines=False)
    table.add_column("metric")
    table.add_column("total", justify="right")
    for ex in data["executors"]:
        table.add_column(ex["executor_id"], justify="right")

    def fmt(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    for key in KEYS:
        table.add_row(key, fmt(data[key]), *[fmt(ex[key]) for ex in data["executors"]])
    # KV groups (executors with a table per group): used blocks, and for sliding ones what the window saved.
    for g in range(max((len(ex["kv_groups"]) for ex in data["executors"]), default=0)):
        def cell(ex, key, g=g) -> str:
            groups = ex["kv_groups"]
            if g >= len(groups):
                return ""
            return f"{groups[g][key]} (window {groups[g]['window']})" if key == "used_blocks" and groups[g]["window"] \
                else str(groups[g][key])
        for key in ("used_blocks", "full_attention_blocks", "window_saved_blocks", "max_seq_blocks"):
            table.add_row(f"group {g} {key}", "", *[cell(ex, key) for ex in data["executors"]])
    mirror = data["mirror"]
    table.caption = ("mirror: " + ("off" if not mirror["enabled"] else
                                   ("STALE" if mirror["stale"] else "in sync") + f", lag {mirror['lag_events']}"))
    return table


def run(args: argparse.Namespace) -> int:
    import grpc
    from rich.console import Console
    from rich.live import Live

    from kvpager.channel import auth_metadata, make_channel
    from kvpager.security import admin_token_from_args, read_only_token_from_args, security_from_args
    from kvpager.v1 import memory_pb2, memory_pb2_grpc

    try:
        tls = security_from_args(args).client_tls()
        token = (args.token or admin_token_from_args(argparse.Namespace())
                 or read_only_token_from_args(argparse.Namespace()))
    except ValueError as exc:
        print(f"kvpager blocks: {exc}", file=sys.stderr)
        return 2
    # Per-call metadata: a blocking plaintext channel cannot carry call credentials.
    metadata = auth_metadata(token) if token else None
    channel = make_channel(args.address, tls=tls, aio=False)
    stub = memory_pb2_grpc.MemoryServiceStub(channel)
    console = Console()
    try:
        if not args.watch:
            data = snapshot_dict(stub.GetAccounting(memory_pb2.AccountingRequest(executor_id=args.executor),
                                                    timeout=args.timeout_s, metadata=metadata))
            if args.json:
                print(json.dumps(data))
            else:
                console.print(render_table(data))
            return 0
        stream = stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=args.interval_ms),
                                      metadata=metadata)
        if args.json:
            for snap in stream:
                print(json.dumps(snapshot_dict(snap)), flush=True)
            return 0
        with Live(console=console, auto_refresh=False) as live:
            for snap in stream:
                live.update(render_table(snapshot_dict(snap)), refresh=True)
        return 0
    except KeyboardInterrupt:
        return 0
    except grpc.RpcError as exc:
        print(f"kvpager blocks: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
