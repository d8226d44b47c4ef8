"""`kvpager demo`: the memory service on its own, driven over gRPC.

Starts a memory service on loopback, registers one executor pool, and plays
a small serving workload through `Step` exactly as a gateway would: requests
that share a system prompt (prefix hits), parallel sampling (fork +
copy-on-write), continuous batching with decode steps, and a pool small
enough to preempt. Shows the live block accounting as it goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="drive a demo workload through the memory service and show block accounting")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--num-blocks", type=int, default=100, help="small enough to preempt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the final accounting as JSON only")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


async def _demo(args: argparse.Namespace) -> dict:
    from rich.console import Console
    from rich.progress import Progress

    from kvpager.channel import make_channel
    from kvpager.packed import pack_i32, pack_i64, unpack_i64
    from kvpager.v1 import common_pb2, memory_pb2, memory_pb2_grpc
    from kvpager_tools.blocks import render_table, snapshot_dict
    from memory_service.service import MemoryConfig, MemoryServer

    console = Console(stderr=args.json)
    rng = random.Random(args.seed)
    server = await MemoryServer(MemoryConfig(port=0)).start()
    console.print(f"memory service listening on [bold]{server.address}[/]")
    channel = make_channel(server.address)
    stub = memory_pb2_grpc.MemoryServiceStub(channel)
    await stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
        executor_id="executor-0", num_blocks=args.num_blocks, block_size=args.block_size, num_swap_blocks=64,
        model_id="demo", dtype="float32", incarnation=1, pool_generation=1, max_model_len=1024, vocab_size=4096)))

    system_prompt = [rng.randrange(4096) for _ in range(100)]
    # (prompt, n completions, tokens to generate)
    requests = []
    for i in range(args.requests):
        prompt = system_prompt + [rng.randrange(4096) for _ in range(rng.randrange(5, 60))]
        requests.append((prompt, 4 if i % 6 == 0 else 1, rng.randrange(20, 120)))

    next_seq = iter(range(1, 1 << 30))
    waiting = list(range(len(requests)))  # request indices not yet admitted
    seq_of: dict[int, list[int]] = {}      # request -> its sequence ids
    left: dict[int, int] = {}              # sequence -> tokens still to generate
    pending: dict[int, int] = {}           # sequence -> sampled token to append
    forks: list = []
    finished: list[int] = []
    preempted_waiting: list[int] = []
    step_id = 0
    max_running = 16
    peak = None
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("serving", total=len(requests))
        while waiting or left or finished:
            step_id += 1
            new, sched, nums = [], [], []
            running = [s for s in left if s not in preempted_waiting]
            for s in running:
                sched.append(s)
                nums.append(1)
            for s in preempted_waiting:
                sched.append(s)
                nums.append(1 << 20)
            for r in waiting[: max(0, max_running - len(running))]:
                if r not in seq_of:
                    s = next(next_seq)
                    seq_of[r] = [s]
                    new.append(memory_pb2.NewSequence(seq_id=s, executor_id="executor-0",
                                                      prompt_token_ids=pack_i32(requests[r][0])))
                sched.append(seq_of[r][0])
                nums.append(1 << 20)
            app = list(pending)
            plan = await stub.Step(memory_pb2.StepRequest(
                step_id=step_id, forks=forks,
                appended=common_pb2.TokenBatch(seq_ids=pack_i64(app), offsets=pack_i32(range(len(app) + 1)),
                                               token_ids=pack_i32(pending[s] for s in app)),
                free_seq_ids=pack_i64(finished), new_sequences=new,
                schedule_seq_ids=pack_i64(sched), schedule_num_tokens=pack_i32(nums)))
            pending, forks, finished = {}, [], []
            for p in plan.preempted:
                if p.seq_id in left and p.seq_id not in preempted_waiting:
                    preempted_waiting.append(p.seq_id)
            for ep in plan.executor_plans:
                for s in unpack_i64(ep.seq_ids):
                    if s in preempted_waiting:
                        preempted_waiting.remove(s)
                    r = next((r for r in waiting if seq_of.get(r) == [s]), None)
                    if r is not None:  # prefill done: sample n first tokens, fork the rest
                        waiting.remove(r)
                        prompt, n, gen = requests[r]
                        children = [next(next_seq) for _ in range(n - 1)]
                        if children:
                            forks.append(common_pb2.ForkOp(parent_seq_id=s, child_seq_ids=children))
                        seq_of[r] = [s, *children]
                        for c in seq_of[r]:
                            left[c] = gen - 1
                            pending[c] = rng.randrange(4096)
                        continue
                    left[s] -= 1
                    if left[s] <= 0:
                        del left[s]
                        finished.append(s)
                        if all(c not in left for c in next(v for v in seq_of.values() if s in v)):
                            progress.advance(task)
                    else:
                        pending[s] = rng.randrange(4096)
            if step_id % 10 == 0:
                snap = await stub.GetAccounting(memory_pb2.AccountingRequest())
                if peak is None or snap.total.used_blocks > peak.total.used_blocks:
                    peak = snap
    final = await stub.GetAccounting(memory_pb2.AccountingRequest())
    if not args.json:
        console.print("[bold]At peak load[/]")
        console.print(render_table(snapshot_dict(peak)))
        console.print("[bold]After every request finished[/] (all blocks back; cached prefixes stay findable)")
        console.print(render_table(snapshot_dict(final)))
    await channel.close()
    await server.stop(5)  # graceful: nothing is in flight, and stop(0) would GOAWAY-with-error a closing transport
    return {"peak": snapshot_dict(peak), "final": snapshot_dict(final), "steps": step_id}


def run(args: argparse.Namespace) -> int:
    from kvpager.telemetry import configure_logging

    configure_logging("demo", "WARNING")
    result = asyncio.run(_demo(args))
    if args.json:
        print(json.dumps(result))
    return 0
