"""`kvpager bench overhead --json`: per-step time spent outside the forward.

For each decode batch size B, B requests (16-token prompts, 64 greedy
tokens, ignore_eos) go through the embedded stack (memory service, one
executor on the demo model, gateway: three processes on loopback gRPC),
one token per step (`--num-scheduler-steps 1`: what a step costs, not how
bursts spread it over tokens). Between
the moment every request has its first token (all prefills done) and the
moment the first one finishes, every step is a decode of exactly B
sequences. Over that window, from the services' own Prometheus timers:

* period_us: wall time per step (window / steps, as the client sees it);
* forward_us, sample_us: the executor's ExecuteResponse.forward_s / sample_s;
* overhead_us = period - forward - sample: the gateway loop, the memory
  service's Step, both RPCs, the executor's validation and input building;
  split into memory_step_us (gateway "plan" phase: schedule + Step RPC; of
  it memory_step_handler_us inside the memory service's handler and
  memory_step_inproc_us the Step itself), execute_rpc_us ("execute" phase
  minus forward and sample; of it execute_handler_us inside the executor's
  handler: decoding, validation, input building, packing) and
  gateway_other_us (applying results, streaming, the loop);
* as a multiple of echo_us, a bare unary gRPC call (grpc.health Check on the
  memory service) timed from this process in the same run.

``control_plane``: the same decode step's two RPCs alone (a Step and an
Execute driven from this process, no streams; kvpager_tools.bench.control_plane)
for B = --batches at each context of --contexts: microseconds per step, as a
multiple of two echoes, and the bytes of every message (``bytes_per_step`` is
the plan's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time

from kvpager_tools.bench import common as bc

NAME = "overhead"
BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (64, 2048)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="per-step control-plane overhead vs a bare gRPC echo, by decode batch")
    p.add_argument("--model", default=None, help="checkpoint dir, 'demo' (default) or 'llama-30m'")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="windows per batch size; medians are reported")
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                   help="control plane: contexts (tokens per sequence) to step at; '' skips it")
    p.add_argument("--control-steps", type=int, default=24, help="control plane: decode steps per (batch, context)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


async def echo_us(address: str, n: int = 200) -> float:
    """Median latency of a grpc.health Check (the bare RPC floor)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpager.channel import make_channel

    async with make_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(20):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def decode_window(gateway: str, ports: dict[str, int], batch: int, prompt_len: int, output_len: int,
                        lo: int, hi: int, salt: str, seed: int) -> dict:
    """One load of `batch` requests; the step figures of its all-decoding window."""
    import random

    from kvpager.channel import make_channel
    from kvpager.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    rng = random.Random(seed)
    prompts = [[rng.randrange(lo, hi) for _ in range(prompt_len)] for _ in range(batch)]
    started = 0
    marks: dict[str, tuple[float, dict]] = {}
    all_started, first_done = asyncio.Event(), asyncio.Event()

    async def one(i: int, stub) -> None:
        nonlocal started
        req = gateway_pb2.GenerateRequest(
            prompt_token_ids=prompts[i], cache_salt=salt, request_id=f"{salt}-{i}",
            sampling_params=common_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
        first = True
        async for r in stub.Generate(req, timeout=600):
            if first and r.token_ids:
                first = False
                started += 1
                if started == batch:
                    all_started.set()
            if r.finish_reason:
                first_done.set()

    async def mark(name: str, event: asyncio.Event) -> None:
        await event.wait()
        t = time.perf_counter()
        marks[name] = (t, await asyncio.to_thread(bc.scrape_all, ports))

    async with make_channel(gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        await asyncio.gather(mark("start", all_started), mark("end", first_done),
                             *(one(i, stub) for i in range(batch)))
    (t1, a), (t2, b) = marks["start"], marks["end"]

    t = bc.step_totals(a, b)
    steps = t["steps"]
    if steps < 1:
        return {}
    per = lambda seconds: seconds / steps * 1e6  # noqa: E731
    period = (t2 - t1) / steps * 1e6
    forward, sample = per(t["forward"]), per(t["sample"])
    return {"steps": int(steps), "period_us": period, "forward_us": forward, "sample_us": sample,
            "overhead_us": period - forward - sample, "memory_step_us": per(t["memory_step"]),
            "memory_step_handler_us": per(t["memory_step_handler"]),
            "memory_step_inproc_us": per(t["memory_step_inproc"]),
            "execute_rpc_us": per(t["execute_handler_other"] + t["execute_rpc_other"]),
            "execute_handler_us": per(t["execute_handler_other"]),
            "gateway_other_us": period - per(t["memory_step"]) - forward - sample
            - per(t["execute_handler_other"] + t["execute_rpc_other"])}


def _one_token_per_step(stack) -> bool:
    flags = stack.config.extra_args.get("gateway", [])
    return any(a == "--num-scheduler-steps" and b == "1" for a, b in zip(flags, flags[1:]))


def measure(model: str, batches: list[int], prompt_len: int, output_len: int, repeats: int, stack=None,
            contexts: list[int] = (), control_steps: int = 24) -> dict:
    """``stack``: a running kvpager_tools.stack.Stack with metrics on, one token per step, max_running and
    max_batch_tokens large enough for the largest batch, and a pool for the
    contexts' prefixes (else one is started)."""
    from kvpager_tools.bench import control_plane

    lo, hi = bc.token_range(model)
    max_batch = max(batches)
    windows_blocks = max_batch * (-(-(prompt_len + output_len + 1) // 16) + 1) + 64
    # control plane: one shared prefix per context + ~3 private blocks per sequence
    control_blocks = max((-(-c // 16) + 4 * max_batch for c in contexts), default=0) + 64
    opts = bc.StackOptions(model=model, metrics=True, max_running=max(max_batch, 64),
                           max_batch_tokens=max(512, max_batch * prompt_len),
                           num_blocks=max(windows_blocks, control_blocks), num_scheduler_steps=1)
    if stack is not None and not _one_token_per_step(stack):
        raise ValueError("bench overhead times one-token steps: start the stack with num_scheduler_steps=1")
    rows = []
    with (bc.embedded_stack(opts) if stack is None else contextlib.nullcontext(stack)) as stack:
        a = stack.addresses
        ports = {name: a.metrics[name] for name in ("gateway", "executor-0", "memory")}
        asyncio.run(decode_window(a.gateway, ports, 4, prompt_len, 8, lo, hi, "overhead-warmup", 0))
        for batch in batches:
            bc.progress(NAME, f"decode batch {batch}")
            windows, echoes = [], []
            for r in range(repeats):
                echoes.append(asyncio.run(echo_us(a.memory)))
                w = asyncio.run(decode_window(a.gateway, ports, batch, prompt_len, output_len, lo, hi,
                                              f"overhead-{batch}-{r}", r))
                if w:
                    windows.append(w)
            med = {k: statistics.median(w[k] for w in windows) for k in windows[0]} if windows else {}
            echo = statistics.median(echoes)
            row = {"batch": batch, "echo_us": round(echo, 1),
                   **{k: round(v, 1) for k, v in med.items() if k != "steps"},
                   "steps_per_window": int(med.get("steps", 0))}
            if med:
                row["overhead_x_echo"] = round(med["overhead_us"] / echo, 2)
                row["overhead_fraction"] = round(med["overhead_us"] / med["period_us"], 3)
            rows.append(row)
        control = []
        if contexts:
            bc.progress(NAME, f"control plane: batches {batches} x contexts {list(contexts)}")
            control = control_plane.measure(a.memory, a.executors[0], batches, list(contexts),
                                            decode_steps=control_steps, token_lo=lo, token_hi=hi)
    return {"benchmark": NAME, "model": model, "prompt_len": prompt_len, "output_len": output_len,
            "repeats": repeats, "batches": rows, "control_plane": control}


def _main(args: argparse.Namespace) -> int:
    from kvpager_tools.bench.serve import machine

    model = str(bc.model_dir(args.model))
    result = measure(model, [int(b) for b in args.batches.split(",")], args.prompt_len, args.output_len,
                     args.repeats, contexts=[int(c) for c in args.contexts.split(",") if c],
                     control_steps=args.control_steps)
    result["machine"] = machine()
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
