"""abuse: one request or RPC per case that used to stall, bloat or steer the stack.

Each case runs while a bystander streams a greedy request (its output
checked against its undisturbed reference): ScorePrefix with 100k copies of
one executor id, an executor whose GetInfo never answers, a 15 MiB text
prompt, 1M stop strings (n = 8), 4M stop token ids, 200 accounting watchers
at 10 ms and at 100 ms, a Fork of 100k children, RegisterExecutor x6 with
2^22 blocks, an executor id and address of 1 MiB, a 4 MiB request id, an
Abort of the bystander from another connection. Loopback only; sizes are
options, each case bounded by ``case_timeout_s``.

Per case: the status returned, the bystander's slowdown (its time over its
time alone just before; the median of ``repeats`` rounds, as the machine's
load drifts), each service's peak RSS growth, the bytes its logs grew, leaked
blocks, and whether the real executor was reaped. Goals: slowdown <=
``max_slowdown``, RSS growth <= ``max_rss_growth_mib``, no leak, no executor
reaped, no internal address in any error message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio

from kvpager.channel import channel_options
from kvpager.packed import pack_i32
from kvpager.v1 import common_pb2, executor_pb2_grpc, gateway_pb2, gateway_pb2_grpc, memory_pb2
from kvpager_tools.drills.common import DrillEnv, DrillResult, greedy_request, leaked_blocks, random_prompt, rss_bytes
from kvpager_tools.drills.runner import Needs

NEEDS = Needs(executors=1)
MIB = 2**20


@dataclasses.dataclass
class Options:
    bystander_tokens: int = dataclasses.field(default=300, metadata={"help": "tokens the bystander streams"})
    score_copies: int = 100_000
    prompt_mib: float = 15.0
    stop_strings: int = 1_000_000
    stop_token_ids: int = 4_000_000
    watchers: int = 200
    fork_children: int = 100_000
    registers: int = 6
    register_blocks: int = 1 << 22
    name_mib: float = 1.0
    request_id_mib: float = 4.0
    only: str = dataclasses.field(default="", metadata={"help": "comma-separated case names (default: all)"})
    repeats: int = dataclasses.field(default=3, metadata={
        "help": "rounds per case (alone, then attacked); the slowdown is their median"})
    case_timeout_s: float = 60.0
    max_slowdown: float = 1.5
    max_rss_growth_mib: float = 64.0


async def _call(coro: Awaitable) -> tuple[str, str]:
    try:
        await coro
        return "OK", ""
    except grpc.aio.AioRpcError as err:
        return err.code().name, err.details() or ""


Attack = Callable[[], Awaitable[tuple[str, str]]]


class _SilentExecutor(executor_pb2_grpc.ExecutorServiceServicer):
    """An executor whose GetInfo never answers."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def GetInfo(self, request, context):
        self.asked.set()
        await asyncio.Event().wait()


class _Cases:
    """Each case builds its attack before the bystander starts (large messages
    are serialized then, so the timed part is what the stack does with them)
    and returns it; the attack returns (status, details)."""

    def __init__(self, env: DrillEnv, opts: Options, executor_id: str, done: asyncio.Event) -> None:
        self.env, self.opts, self.executor_id, self.done = env, opts, executor_id, done
        self.c = env.clients

    def _raw(self, service: str, method: str, message, streamed: bool = False) -> Attack:
        """The call with ``message`` already serialized (the drill's own CPU stays out of the timing)."""
        channel = self.c._gateway_channel if service == "Gateway" else self.c._memory_channel
        path = f"/kvpager.v1.{service}/{method}"
        payload = message.SerializeToString()

        async def attack():
            if not streamed:
                return await _call(channel.unary_unary(path)(payload, timeout=60))

            async def drain():
                async for _ in channel.unary_stream(path)(payload, timeout=60):
                    pass
            return await _call(drain())
        return attack

    def _generate(self, **fields) -> Attack:
        return self._raw("Gateway", "Generate", gateway_pb2.GenerateRequest(**fields), streamed=True)

    def score_prefix(self) -> Attack:
        return self._raw("MemoryService", "ScorePrefix", memory_pb2.ScorePrefixRequest(
            token_ids=pack_i32(range(64)), executor_ids=[self.executor_id] * self.opts.score_copies))

    def silent_executor(self) -> Attack:
        async def attack():
            server = grpc.aio.server()
            silent = _SilentExecutor()
            executor_pb2_grpc.add_ExecutorServiceServicer_to_server(silent, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            info = memory_pb2.ExecutorPoolInfo(executor_id="abuse-silent", address=f"127.0.0.1:{port}",
                                               num_blocks=16, block_size=16, model_id="abuse", incarnation=1)
            try:
                status = await _call(self.c.memory.RegisterExecutor(
                    memory_pb2.RegisterExecutorRequest(info=info), timeout=10))
                await asyncio.wait_for(silent.asked.wait(), 10)  # the gateway is joining it now
                await self.done.wait()
                return status
            finally:
                await _call(self.c.memory.DeregisterExecutor(
                    memory_pb2.DeregisterExecutorRequest(executor_id="abuse-silent"), timeout=10))
                await server.stop(0)
        return attack

    def huge_prompt(self) -> Attack:
        return self._generate(prompt="ab " * int(self.opts.prompt_mib * MIB / 3),
                              sampling_params=common_pb2.SamplingParams(max_tokens=4))

    def stop_strings(self) -> Attack:
        return self._generate(prompt_token_ids=[5, 6, 7], sampling_params=common_pb2.SamplingParams(
            max_tokens=16, n=8, temperature=1.0, stop=["xq"] * self.opts.stop_strings))

    def stop_token_ids(self) -> Attack:
        return self._generate(prompt_token_ids=[5, 6, 7], sampling_params=common_pb2.SamplingParams(
            max_tokens=16, stop_token_ids=[1] * self.opts.stop_token_ids))

    def watchers(self) -> Attack:
        async def first(call):
            try:
                await call.read()
                return "OK"
            except grpc.aio.AioRpcError as err:
                return err.code().name

        async def attack():
            calls = [self.c.memory.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=interval))
                     for interval in (10, 100) for _ in range(self.opts.watchers)]
            try:
                seen = await asyncio.gather(*(first(call) for call in calls))
                await self.done.wait()  # the served ones keep streaming meanwhile
            finally:
                for call in calls:
                    call.cancel()
            return "/".join(f"{k}:{seen.count(k)}" for k in sorted(set(seen))), ""
        return attack

    def fork_children(self) -> Attack:
        return self._raw("MemoryService", "Fork", memory_pb2.ForkRequest(fork=common_pb2.ForkOp(
            parent_seq_id=1, child_seq_ids=range(2, 2 + self.opts.fork_children))))

    def register_pools(self) -> Attack:
        calls = [self._raw("MemoryService", "RegisterExecutor", memory_pb2.RegisterExecutorRequest(
            info=memory_pb2.ExecutorPoolInfo(executor_id=f"abuse-pool-{i}", num_blocks=self.opts.register_blocks,
                                             block_size=16, incarnation=1))) for i in range(self.opts.registers)]

        async def attack():
            statuses = [await call() for call in calls]
            for i, (status, _) in enumerate(statuses):
                if status == "OK":
                    await _call(self.c.memory.DeregisterExecutor(
                        memory_pb2.DeregisterExecutorRequest(executor_id=f"abuse-pool-{i}"), timeout=10))
            return "/".join(sorted({s for s, _ in statuses})), next((d for s, d in statuses if d), "")
        return attack

    def long_names(self) -> Attack:
        size = int(self.opts.name_mib * MIB)
        register = self._raw("MemoryService", "RegisterExecutor", memory_pb2.RegisterExecutorRequest(
            info=memory_pb2.ExecutorPoolInfo(executor_id="i" * size, address="a" * size, num_blocks=16,
                                             block_size=16, incarnation=1)))
        beat = self._raw("MemoryService", "Heartbeat", memory_pb2.HeartbeatRequest(executor_id="i" * size))

        async def attack():
            (s1, d1), (s2, d2) = await register(), await beat()
            return f"{s1}/{s2}", f"{d1} {d2}"
        return attack

    def request_id(self) -> Attack:
        return self._generate(prompt_token_ids=[5, 6, 7], request_id="r" * int(self.opts.request_id_mib * MIB),
                              sampling_params=common_pb2.SamplingParams(max_tokens=4))

    def foreign_abort(self, bystander_id: str) -> Attack:
        async def attack():
            if self.env.security is not None:
                return "SKIPPED", "with one shared token every client is the same principal"
            # A connection of its own (grpc shares subchannels between channels by default).
            options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(self.env.stack.addresses.gateway, options=options) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                reply = await stub.Abort(gateway_pb2.AbortRequest(request_id=bystander_id), timeout=10)

                async def same_id():
                    async for _ in stub.Generate(greedy_request([5, 6, 7], 2, request_id=bystander_id), timeout=60):
                        pass
                status, details = await _call(same_id())
            return ("FOUND" if reply.found else "NOT_FOUND") + f"/{status}", details
        return attack


# case -> the statuses that are right for it
EXPECTED = {
    "score_prefix": {"OK"},
    "silent_executor": {"OK"},
    "huge_prompt": {"INVALID_ARGUMENT"},
    "stop_strings": {"INVALID_ARGUMENT"},
    "stop_token_ids": {"INVALID_ARGUMENT"},
    "watchers": None,  # checked in _check_watchers
    "fork_children": {"INVALID_ARGUMENT"},
    "register_pools": {"RESOURCE_EXHAUSTED"},
    "long_names": {"INVALID_ARGUMENT/NOT_FOUND"},
    "request_id": {"INVALID_ARGUMENT"},
    "foreign_abort": {"NOT_FOUND/OK", "SKIPPED"},
}


def _check_watchers(status: str, opts: Options) -> bool:
    counts = dict(part.split(":") for part in status.split("/"))
    return (int(counts.get("INVALID_ARGUMENT", 0)) == opts.watchers
            and int(counts.get("OK", 0)) + int(counts.get("RESOURCE_EXHAUSTED", 0)) == opts.watchers
            and int(counts.get("RESOURCE_EXHAUSTED", 0)) > 0)


async def _sample_rss(env: DrillEnv, peaks: dict[str, int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for name, proc in env.stack.procs.items():
            peaks[name] = max(peaks.get(name, 0), rss_bytes(proc.pid)[0])
        await asyncio.sleep(0.05)


def _log_bytes(env: DrillEnv) -> dict[str, int]:
    out = {}
    for name in env.stack.procs:
        path = env.stack.log_path(name)
        out[name] = path.stat().st_size if path.exists() else 0
    return out


async def _executors(env: DrillEnv) -> dict[str, int]:
    reply = await env.clients.memory.ListExecutors(memory_pb2.ListExecutorsRequest(), timeout=10)
    return {e.executor_id: e.incarnation for e in reply.executors}


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("abuse")
    c = env.clients
    info = await c.model_info()
    prompt = random_prompt(env.rng, info.vocab_size, 16)
    await env.reference(prompt, opts.bystander_tokens)
    real = await _executors(env)
    executor_id = next(iter(real))

    async def bystander(request_id: str, on_first: Callable[[], None] | None = None):
        t0 = time.perf_counter()
        out = await c.generate(greedy_request(prompt, opts.bystander_tokens, request_id=request_id),
                               on_first=on_first)
        return out, time.perf_counter() - t0

    async def alone(name: str) -> float:
        """The bystander undisturbed, right before each case: the machine's load drifts."""
        out, took = await bystander(f"abuse-alone-{name}")
        result.record(out.status)
        env.check_output(result, prompt, opts.bystander_tokens, out)
        return took

    await alone("warm-up")
    names = [n for n in EXPECTED if not opts.only or n in opts.only.split(",")]
    addresses = [env.stack.addresses.memory, env.stack.addresses.gateway, *env.stack.addresses.executors]

    async def one_round(name: str, k: int) -> dict:
        """One case once: the bystander alone, then again with the attack."""
        baseline_s = await alone(f"{name}-{k}")
        done, streaming = asyncio.Event(), asyncio.Event()
        cases_ = _Cases(env, opts, executor_id, done)
        rid = f"abuse-bystander-{name}-{k}"
        attack = cases_.foreign_abort(rid) if name == "foreign_abort" else getattr(cases_, name)()
        rss0 = {n: rss_bytes(p.pid)[0] for n, p in env.stack.procs.items()}
        logs0 = _log_bytes(env)
        peaks: dict[str, int] = {}
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(_sample_rss(env, peaks, stop))
        task = asyncio.ensure_future(bystander(rid, streaming.set))
        task.add_done_callback(lambda _t: done.set())
        await asyncio.wait_for(streaming.wait(), opts.case_timeout_s)
        try:
            status, details = await asyncio.wait_for(attack(), opts.case_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a case that breaks is reported, the drill goes on
            status, details = type(exc).__name__, str(exc)
        out, took = await asyncio.wait_for(task, opts.case_timeout_s * 2)
        stop.set()
        await sampler
        snap, _ = await env.wait_baseline()
        after = await _executors(env)
        result.record(out.status)  # the bystander; the attacks' statuses are in the figures
        if out.status != "OK" or len(out.first) != opts.bystander_tokens:
            result.violation(f"{name}: the bystander ended {out.status} after {len(out.first)} tokens")
        env.check_output(result, prompt, opts.bystander_tokens, out)
        if any(a in details for a in addresses):
            result.violation(f"{name}: the error names an internal address: {details[:200]}")
        return {"status": status, "details": details, "slowdown": took / baseline_s,
                "rss": {n: max(0, peaks.get(n, 0) - rss0[n]) / MIB for n in rss0},
                "logs": {n: size - logs0.get(n, 0) for n, size in _log_bytes(env).items()},
                "leaked": leaked_blocks(snap), "reaped": after.get(executor_id) != real[executor_id]}

    cases: dict[str, dict] = {}
    for name in names:
        rounds = [await one_round(name, k) for k in range(max(1, opts.repeats))]
        status = "|".join(dict.fromkeys(r["status"] for r in rounds))
        figures = cases[name] = {
            "status": status,
            # The median of the rounds: an attack's stall shows in each, the machine's noise does not.
            "bystander_slowdown": round(statistics.median(r["slowdown"] for r in rounds), 2),
            "bystander_slowdowns": [round(r["slowdown"], 2) for r in rounds],
            "rss_growth_mib": {n: round(max(r["rss"][n] for r in rounds), 1) for n in rounds[0]["rss"]},
            "log_bytes": {n: sum(r["logs"].get(n, 0) for r in rounds) for n in rounds[0]["logs"]},
            "leaked_blocks": max(r["leaked"] for r in rounds),
            "executor_reaped": any(r["reaped"] for r in rounds),
        }
        expected = EXPECTED[name]
        if not (_check_watchers(status, opts) if expected is None else status in expected):
            result.violation(f"{name}: status {status} ({rounds[-1]['details'][:200]})")
        if figures["bystander_slowdown"] > opts.max_slowdown:
            result.violation(f"{name}: the bystander took {figures['bystander_slowdown']}x its time alone")
        for n, mib in figures["rss_growth_mib"].items():
            if mib > opts.max_rss_growth_mib:
                result.violation(f"{name}: {n} RSS grew {mib} MiB")
        if figures["leaked_blocks"]:
            result.violation(f"{name}: {figures['leaked_blocks']} blocks leaked")
        if figures["executor_reaped"]:
            result.violation(f"{name}: the executor was reaped")
    result.figures["cases"] = cases
    result.figures["max_bystander_slowdown"] = max((f["bystander_slowdown"] for f in cases.values()), default=0)
    return result
