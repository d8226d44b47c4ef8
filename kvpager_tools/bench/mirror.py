"""`kvpager bench mirror --json` (or `python -m kvpager_tools.bench.mirror --json`):
what the Redis mirror costs and what it buys. Starts its own redis-server.

* mirror_overhead_ratio: median Step RPC latency with the mirror on over off.
  Two memory services (separate processes, one with --redis-url) serve the
  same decode-with-churn workload from one client in alternating slices of
  10 steps; the ratio is the median of the per-round ratios. Server CPU per
  step (from /proc) is reported beside it: it does not depend on neighbours. Also in-process:
  the Step call alone (event emission is all the allocator pays) and a
  Step+yield loop that charges the writer's CPU to the steps.
* score_p50_us / score_p99_us: PrefixReader.score of a 64-block prompt
  against 4 executors (holding 16/32/48/64 of its blocks), one round trip.
* events_per_s: a backlog of KV events applied by the writer.
* resync_s: a full resync of 100,000 cached blocks into an empty Redis;
  recovery_s: a fresh memory service rebuilding them from the mirror.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

from kvpager_tools.ports import free_port
from kvpager_tools.stats import percentile

VOCAB = 32000
BS = 16


def _progress(msg: str) -> None:
    print(f"[bench mirror] {msg}", file=sys.stderr, flush=True)


# ---- Step overhead over gRPC ------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _spawn_memory(redis_url: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "memory_service", "--port", str(port), "--log-level", "WARNING"]
    if redis_url:
        args += ["--redis-url", redis_url]
    env = {k: v for k, v in os.environ.items() if k != "KVPAGER_REDIS_URL"}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return proc, f"127.0.0.1:{port}"


class _Workload:
    """Decode `batch` sequences; every `churn` steps one finishes and a new one
    (shared 128-token system prompt + its own 72) is prefilled in the same Step."""

    def __init__(self, stub, executor_id: str, batch: int, seed: int, churn: int = 8) -> None:
        from kvpager.v1 import memory_pb2

        self.pb = memory_pb2
        self.stub, self.eid, self.batch, self.churn = stub, executor_id, batch, churn
        self.rng = random.Random(seed)
        self.system = [self.rng.randrange(VOCAB) for _ in range(128)]
        self.live: list[int] = []
        self.next_id = seed * 1_000_000
        self.step_id = seed * 1_000_000
        stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
            executor_id=executor_id, num_blocks=batch * 48, block_size=BS, max_model_len=4096, vocab_size=VOCAB)))
        self.step(admit=batch)

    def _prompt(self) -> list[int]:
        return self.system + [self.rng.randrange(VOCAB) for _ in range(72)]

    def step(self, admit: int = 0) -> None:
        from kvpager.packed import pack_i32, pack_i64
        from kvpager.v1 import common_pb2

        pb = self.pb
        decoding = list(self.live)
        free = []
        if admit == 0 and self.step_id % self.churn == 0 and decoding:
            free = [decoding.pop(0)]
            admit = 1
        new = []
        for _ in range(admit):
            self.next_id += 1
            prompt = self._prompt()
            new.append(pb.NewSequence(seq_id=self.next_id, executor_id=self.eid, prompt_token_ids=pack_i32(prompt)))
        self.step_id += 1
        sched = decoding + [n.seq_id for n in new]
        nums = [1] * len(decoding) + [200] * len(new)
        req = pb.StepRequest(step_id=self.step_id, free_seq_ids=pack_i64(free), new_sequences=new,
                             schedule_seq_ids=pack_i64(sched), schedule_num_tokens=pack_i32(nums))
        if decoding:
            req.appended.CopyFrom(common_pb2.TokenBatch(
                seq_ids=pack_i64(decoding), offsets=pack_i32(range(len(decoding) + 1)),
                token_ids=pack_i32([self.rng.randrange(VOCAB) for _ in decoding])))
        self.stub.Step(req)
        self.live = sched

    def close(self) -> None:
        self.stub.Free(self.pb.FreeRequest(seq_ids=self.live))
        self.stub.DeregisterExecutor(self.pb.DeregisterExecutorRequest(executor_id=self.eid))


def step_overhead_rpc(redis_url: str, batch: int, steps: int, rounds: int) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpager.channel import make_channel
    from kvpager.v1 import memory_pb2_grpc

    servers = {mode: _spawn_memory(redis_url if mode == "on" else None) for mode in ("off", "on")}
    channels = []
    try:
        stubs = {}
        for mode, (_, address) in servers.items():
            channel = make_channel(address, aio=False)
            channels.append(channel)
            grpc.channel_ready_future(channel).result(timeout=60)
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
                time.sleep(0.05)
            stubs[mode] = memory_pb2_grpc.MemoryServiceStub(channel)
        medians = {"off": [], "on": []}
        cpu = {"off": [], "on": []}  # server process CPU per step: robust to a busy machine
        for r in range(rounds):
            # Both services run the same workload in alternating slices of 10 steps,
            # so a busy neighbour slows both alike.
            loads = {mode: _Workload(stubs[mode], f"bench{r}", batch, seed=r + 1) for mode in ("off", "on")}
            times = {"off": [], "on": []}
            cpu_s = {"off": 0.0, "on": 0.0}
            for w in loads.values():
                for _ in range(20):  # warm-up
                    w.step()
            for k in range(steps // 10):
                for mode in (("off", "on") if k % 2 == 0 else ("on", "off")):
                    w = loads[mode]
                    cpu0 = _cpu_s(servers[mode][0].pid)
                    for _ in range(10):
                        t0 = time.perf_counter()
                        w.step()
                        times[mode].append(time.perf_counter() - t0)
                    cpu_s[mode] += _cpu_s(servers[mode][0].pid) - cpu0
            for mode, w in loads.items():
                w.close()
                medians[mode].append(statistics.median(times[mode]))
                cpu[mode].append(cpu_s[mode] / len(times[mode]))
        ratios = [on / off for on, off in zip(medians["on"], medians["off"])]
        return {"mirror_overhead_ratio": round(statistics.median(ratios), 3),
                "mirror_overhead_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "step_rpc_us_mirror_off": round(statistics.median(medians["off"]) * 1e6, 1),
                "step_rpc_us_mirror_on": round(statistics.median(medians["on"]) * 1e6, 1),
                "server_cpu_us_per_step_mirror_off": round(statistics.median(cpu["off"]) * 1e6, 1),
                "server_cpu_us_per_step_mirror_on": round(statistics.median(cpu["on"]) * 1e6, 1),
                "step_batch": batch, "step_rounds": rounds}
    finally:
        for channel in channels:
            channel.close()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


# ---- in-process pieces ------------------------------------------------------------


def _state(events: bool):
    from memory_service.events import EventQueue
    from memory_service.manager import MemoryManager
    from memory_service.service_state import MemoryState

    return MemoryState(MemoryManager(events=EventQueue(enabled=events)))


def _spec(executor_id: str, num_blocks: int, max_model_len: int = 4096):
    from memory_service.kv_manager import ExecutorSpec

    return ExecutorSpec(executor_id, num_blocks, BS, model_id="bench", dtype="float16",
                        max_model_len=max_model_len, vocab_size=VOCAB)


async def step_overhead_inprocess(redis_url: str, batch: int, steps: int, rounds: int) -> dict:
    """Step call alone (what the allocator pays: event records), and a
    back-to-back Step+yield loop: its wall time (the writer, and on a small
    machine Redis too, compete with the steps) and this process's CPU time
    (the writer's own cost)."""
    from memory_service.mirror.writer import MirrorWriter
    from memory_service.records import NewSeq, StepInput

    call = {"off": [], "on": []}
    loop_wall = {"off": [], "on": []}
    loop_cpu = {"off": [], "on": []}
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            state = _state(events=mode == "on")
            writer = await MirrorWriter(state, redis_url).start() if mode == "on" else None
            state.register_executor(_spec("e0", batch * 48))
            rng = random.Random(r)
            system = [rng.randrange(VOCAB) for _ in range(128)]
            live, next_id, step_id = [], 0, 0
            times = []
            t_start = cpu_start = 0.0
            for i in range(steps + 20):
                decoding = list(live)
                free, new = [], []
                if not decoding:
                    admit = batch
                elif i % 8 == 0:
                    free, admit = [decoding.pop(0)], 1
                else:
                    admit = 0
                for _ in range(admit):
                    next_id += 1
                    new.append(NewSeq(next_id, "e0", system + [rng.randrange(VOCAB) for _ in range(72)]))
                step_id += 1
                sched = decoding + [n.seq_id for n in new]
                req = StepInput(step_id, appended_seq_ids=decoding, appended_offsets=list(range(len(decoding) + 1)),
                                appended_tokens=[rng.randrange(VOCAB) for _ in decoding], free_seq_ids=free,
                                new_seqs=new, schedule_seq_ids=sched,
                                schedule_num_tokens=[1] * len(decoding) + [200] * len(new))
                if i == 20:
                    t_start, cpu_start = time.perf_counter(), time.process_time()
                t0 = time.perf_counter()
                state.step(req)
                if i >= 20:
                    times.append(time.perf_counter() - t0)
                live = sched
                await asyncio.sleep(0)  # the loop turn a served Step would give back
            loop_wall[mode].append((time.perf_counter() - t_start) / steps)
            loop_cpu[mode].append((time.process_time() - cpu_start) / steps)
            call[mode].append(statistics.median(times))
            if writer is not None:
                await writer.sync(30)
                await writer.stop()
            state.close()
    return {"step_inprocess_ratio": round(statistics.median(
                [a / b for a, b in zip(call["on"], call["off"])]), 3),
            "step_inprocess_us_mirror_off": round(statistics.median(call["off"]) * 1e6, 1),
            "step_loop_wall_ratio": round(statistics.median(
                [a / b for a, b in zip(loop_wall["on"], loop_wall["off"])]), 3),
            "step_loop_cpu_ratio": round(statistics.median(
                [a / b for a, b in zip(loop_cpu["on"], loop_cpu["off"])]), 3)}


async def score_latency(redis_url: str, iters: int) -> dict:
    from kvpager.prefix_index.reader import AsyncPrefixReader, PrefixReader
    from memory_service.mirror.writer import MirrorWriter
    from memory_service.records import NewSeq, StepInput

    state = _state(events=True)
    writer = await MirrorWriter(state, redis_url).start()
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(64 * BS)]
    for k in range(4):
        state.register_executor(_spec(f"e{k}", 256, max_model_len=2048))
        n = 16 * (k + 1) * BS + 1
        state.step(StepInput(2 * k + 1, new_seqs=[NewSeq(k + 1, f"e{k}", (prompt + [1])[:n])],
                             schedule_seq_ids=[k + 1], schedule_num_tokens=[n]))
        state.step(StepInput(2 * k + 2, free_seq_ids=[k + 1]))
    await writer.sync(30)
    expected = {s.executor_id: s.hit_blocks for s in state.score_prefix(prompt, "", [])}
    reader = PrefixReader(redis_url, model_id="bench", block_size=BS, dtype="float16")
    assert reader.score(prompt) == expected == {"e0": 16, "e1": 32, "e2": 48, "e3": 64}, (reader.score(prompt),
                                                                                      expected)
    for _ in range(200):
        reader.score(prompt)
    sync_us = []
    for _ in range(iters):
        t0 = time.perf_counter()
        reader.score(prompt)
        sync_us.append((time.perf_counter() - t0) * 1e6)
    areader = AsyncPrefixReader(redis_url, model_id="bench", block_size=BS, dtype="float16")
    for _ in range(200):
        await areader.score(prompt)
    async_us = []
    for _ in range(iters):
        t0 = time.perf_counter()
        await areader.score(prompt)
        async_us.append((time.perf_counter() - t0) * 1e6)
    local_us = []
    for _ in range(min(iters, 500)):
        t0 = time.perf_counter()
        state.score_prefix(prompt, "", [])
        local_us.append((time.perf_counter() - t0) * 1e6)
    reader.close()
    await areader.aclose()
    await writer.stop()
    state.close()
    return {"score_p50_us": round(percentile(sync_us, 50), 1), "score_p99_us": round(percentile(sync_us, 99), 1),
            "score_async_p50_us": round(percentile(async_us, 50), 1),
            "score_async_p99_us": round(percentile(async_us, 99), 1),
            "score_inprocess_p50_us": round(percentile(local_us, 50), 1), "score_blocks": 64, "score_executors": 4}


async def events_and_resync(redis_url: str, num_blocks: int) -> dict:
    """A backlog of num_blocks BlockStored events, then a full resync of them
    into an empty Redis, then a fresh service recovering them."""
    import redis

    from memory_service.mirror.recovery import recover
    from memory_service.mirror.writer import MirrorWriter
    from kvpager.prefix_index.hashing import hash_block

    state = _state(events=True)
    writer = await MirrorWriter(state, redis_url).start()
    spec = _spec("e0", num_blocks)
    spec.address = "bench:1"
    state.register_executor(spec)
    await writer.sync(30)
    pool = state.manager.executors["e0"].pool
    rng = random.Random(3)
    chain = 1000
    for b in range(num_blocks):
        if b % chain == 0:
            parent = None
        tokens = [rng.randrange(VOCAB) for _ in range(BS)]
        h = hash_block(parent or b"root", tokens)
        pool.restore_cached(h, b, tokens, parent, b % chain)
        parent = h
    writer.on_step()
    t0 = time.perf_counter()
    await writer.sync(300)
    apply_s = time.perf_counter() - t0

    redis.Redis.from_url(redis_url).flushall()  # as if Redis restarted empty
    writer.resync_all()
    t0 = time.perf_counter()
    await writer.sync(300)
    resync_s = time.perf_counter() - t0

    fresh = _state(events=True)
    writer2 = await MirrorWriter(fresh, redis_url).start()

    async def confirm(*_args) -> bool:
        return True

    t0 = time.perf_counter()
    report = await recover(fresh, writer2, confirm=confirm)
    recovery_s = time.perf_counter() - t0
    assert report.num_blocks == num_blocks, report
    await writer2.abort()
    await writer.stop()
    fresh.close()
    state.close()
    return {"events_per_s": round(num_blocks / apply_s),
            "resync_s": round(resync_s, 3), "resync_blocks": num_blocks, "recovery_s": round(recovery_s, 3)}


# ---- driver -----------------------------------------------------------------------


def run_all(redis_url: str | None = None, quick: bool = False) -> dict:
    from kvpager_tools.redis_server import RedisServer

    proc = None
    if redis_url is None:
        proc = RedisServer().start()
        redis_url = proc.url
    try:
        import redis

        info = redis.Redis.from_url(redis_url).info("server")
        result = {"machine": {"cpus": os.cpu_count(), "redis_version": info.get("redis_version"),
                              "python": sys.version.split()[0]}}
        steps, rounds = (100, 3) if quick else (300, 11)
        _progress("Step overhead over gRPC (two memory services, mirror off/on)")
        result.update(step_overhead_rpc(redis_url, batch=64, steps=steps, rounds=rounds))
        _progress("Step overhead in-process")
        result.update(asyncio.run(step_overhead_inprocess(redis_url, batch=64, steps=steps, rounds=rounds)))
        _progress("prefix scoring")
        result.update(asyncio.run(score_latency(redis_url, iters=500 if quick else 3000)))
        _progress("event backlog, resync, recovery")
        result.update(asyncio.run(events_and_resync(redis_url, 10_000 if quick else 100_000)))
        return result
    finally:
        if proc is not None:
            proc.close()


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("mirror", help="Redis mirror: Step overhead, prefix scoring, resync")
    _arguments(p)
    p.set_defaults(func=_run)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--quick", action="store_true", help="fewer rounds, 10,000 blocks (smoke)")
    p.add_argument("--redis-url", default=None, help="use this Redis (default: start a private redis-server)")


def _run(args: argparse.Namespace) -> int:
    from kvpager.telemetry import configure_logging

    configure_logging("bench", "WARNING")
    result = run_all(args.redis_url, quick=args.quick)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpager_tools.bench.mirror", description=__doc__.splitlines()[0])
    _arguments(p)
    return _run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
