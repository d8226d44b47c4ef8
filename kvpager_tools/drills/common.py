"""What every drill shares: the result record, the clients, the checks.

Every drill ends with the same check (``DrillEnv.finish``): every block is
back (memory-service accounting at its baseline: used_blocks 0,
num_sequences 0, swap free == total), the accounting identities hold, every
service is alive and SERVING, and nothing wrong was served (greedy outputs
equal the same request's output on an undisturbed run, ``DrillEnv.reference``).

Outputs are compared only where they are exact: an fp32 executor computes a
row the same whichever batch it is in; in bf16 or fp16 the rounding moves
with the batch's shape (for vLLM as for us), and random-weight logits are
flat enough that a greedy token flips. On such a stack (``DrillEnv.exact``
False, learned from the executors' ``GetInfo``) the drills count the outputs
they did not compare (``outputs_not_compared``) and check everything else.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import time
from pathlib import Path

import grpc
import grpc.aio

from kvpager.channel import make_channel
from kvpager_tools.generate import Stream, stream_generate
from kvpager.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, memory_pb2, memory_pb2_grpc

# Never acceptable from any service: a crash or an unmapped exception.
FORBIDDEN_STATUSES = frozenset({"UNKNOWN", "INTERNAL"})
# How long a service may take to report SERVING at a drill's end (a gateway's health follows
# its executors by one poll of its readiness, 0.1 s; a request can finish within it).
HEALTH_SETTLE_S = 2.0


@dataclasses.dataclass
class DrillResult:
    """The JSON summary every drill prints."""

    drill: str
    requests: int = 0
    completions: int = 0
    failures_by_status: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    leaked_blocks: int = 0
    invariant_violations: list[str] = dataclasses.field(default_factory=list)
    healthy: bool = True
    duration_s: float = 0.0
    figures: dict = dataclasses.field(default_factory=dict)

    def record(self, status: str) -> None:
        """One request's outcome: "OK" or a status code name."""
        self.requests += 1
        if status == "OK":
            self.completions += 1
        else:
            self.failures_by_status[status] += 1

    def add(self, figure: str, n: int = 1) -> None:
        """Adds ``n`` to a counted figure (``outputs_compared`` ...)."""
        self.figures[figure] = self.figures.get(figure, 0) + n

    def violation(self, message: str) -> None:
        if len(self.invariant_violations) < 200:  # bounded: one bug can repeat thousands of times
            self.invariant_violations.append(message)
        elif len(self.invariant_violations) == 200:
            self.invariant_violations.append("... (more violations not listed)")

    def forbid(self, allowed: frozenset[str] | set[str], what: str = "requests") -> None:
        """Every failure status outside ``allowed`` (and any UNKNOWN/INTERNAL) is a violation."""
        for status, count in sorted(self.failures_by_status.items()):
            if status in FORBIDDEN_STATUSES or status not in allowed:
                self.violation(f"{count} {what} ended with {status}")

    def merge(self, other: DrillResult) -> None:
        self.requests += other.requests
        self.completions += other.completions
        self.failures_by_status.update(other.failures_by_status)
        self.leaked_blocks = max(self.leaked_blocks, other.leaked_blocks)
        for v in other.invariant_violations:
            self.violation(f"{other.drill}: {v}")
        self.healthy = self.healthy and other.healthy

    @property
    def ok(self) -> bool:
        return self.leaked_blocks == 0 and not self.invariant_violations and self.healthy

    def to_dict(self) -> dict:
        return {
            "drill": self.drill,
            "ok": self.ok,
            "requests": self.requests,
            "completions": self.completions,
            "failures_by_status": dict(sorted(self.failures_by_status.items())),
            "leaked_blocks": self.leaked_blocks,
            "invariant_violations": list(self.invariant_violations),
            "healthy": self.healthy,
            "duration_s": round(self.duration_s, 3),
            "figures": self.figures,
        }


# --- accounting identities --------------------------------------------------------------------------------

_SUMMED = ("total_blocks", "free_blocks", "used_blocks", "cached_blocks", "live_tokens", "allocated_slots",
           "logical_blocks", "physical_blocks", "num_sequences", "num_swapped_sequences", "swap_total_blocks",
           "swap_free_blocks")


def accounting_violations(snap: memory_pb2.AccountingSnapshot) -> list[str]:
    """The identities of GetAccounting that must hold in every snapshot."""
    out = []
    for p in [*snap.executors, snap.total]:
        who = p.executor_id or "total"

        def need(ok: bool, what: str) -> None:
            if not ok:
                out.append(f"{who}: {what}")

        need(p.free_blocks + p.used_blocks == p.total_blocks,
             f"free {p.free_blocks} + used {p.used_blocks} != total {p.total_blocks}")
        need(p.cached_blocks <= p.free_blocks, f"cached {p.cached_blocks} > free {p.free_blocks}")
        need(p.logical_blocks >= p.physical_blocks, f"logical {p.logical_blocks} < physical {p.physical_blocks}")
        need(p.sharing_saved_blocks == p.logical_blocks - p.physical_blocks, "sharing_saved != logical - physical")
        # Every block with refcount > 0 is in some block table, and only those are.
        need(p.physical_blocks == p.used_blocks, f"physical {p.physical_blocks} != used {p.used_blocks}")
        if p.block_size:
            need(p.allocated_slots == p.used_blocks * p.block_size, "allocated_slots != used * block_size")
        need(p.live_tokens <= p.allocated_slots, f"live_tokens {p.live_tokens} > slots {p.allocated_slots}")
        need(0.0 <= p.kv_utilization <= 1.0 + 1e-9, f"kv_utilization {p.kv_utilization}")
        need(0.0 <= p.prefix_hit_rate <= 1.0 + 1e-9, f"prefix_hit_rate {p.prefix_hit_rate}")
        need(p.prefix_hit_tokens <= p.prefix_query_tokens, "prefix hits > prefix queries")
        need(p.swap_free_blocks <= p.swap_total_blocks, "swap free > swap total")
        need(p.preemptions == p.preemptions_recompute + p.preemptions_swap, "preemptions != recompute + swap")
    for name in _SUMMED:
        summed = sum(getattr(p, name) for p in snap.executors)
        if getattr(snap.total, name) != summed:
            out.append(f"total.{name} {getattr(snap.total, name)} != sum over executors {summed}")
    return out


def leaked_blocks(snap: memory_pb2.AccountingSnapshot) -> int:
    """Blocks (device + swap) still held; 0 at the baseline."""
    t = snap.total
    return t.used_blocks + (t.swap_total_blocks - t.swap_free_blocks)


def at_baseline(snap: memory_pb2.AccountingSnapshot) -> bool:
    t = snap.total
    return (t.used_blocks == 0 and t.num_sequences == 0 and t.num_swapped_sequences == 0
            and t.swap_free_blocks == t.swap_total_blocks)


# --- requests -----------------------------------------------------------------------------------------------


def sampling(**kw) -> common_pb2.SamplingParams:
    seed = kw.pop("seed", None)
    sp = common_pb2.SamplingParams(**kw)
    if seed is not None:
        sp.seed = seed
    return sp


def greedy_request(prompt_ids, max_tokens: int, **kw) -> gateway_pb2.GenerateRequest:
    """A greedy, ignore-EOS request: its output is fixed by the prompt alone."""
    return gateway_pb2.GenerateRequest(
        prompt_token_ids=list(prompt_ids), request_id=kw.pop("request_id", ""),
        sampling_params=sampling(max_tokens=max_tokens, ignore_eos=True, **kw))


class Clients:
    """aio channels to the stack's gateway and memory service (and executors),
    with its TLS and tokens. Create inside the running loop; ``close`` after."""

    def __init__(self, addresses, *, tls=None, auth_token: str | None = None,
                 admin_token: str | None = None) -> None:
        self.addresses = addresses
        self.tls = tls
        self.auth_token = auth_token
        self.admin_token = admin_token
        self._gateway_channel = make_channel(addresses.gateway, tls=tls, token=auth_token)
        self._memory_channel = make_channel(addresses.memory, tls=tls, token=admin_token)
        self.gateway = gateway_pb2_grpc.GatewayStub(self._gateway_channel)
        self.memory = memory_pb2_grpc.MemoryServiceStub(self._memory_channel)

    def channel(self, address: str, token: str | None = None):
        return make_channel(address, tls=self.tls, token=token)

    async def close(self) -> None:
        await self._gateway_channel.close()
        await self._memory_channel.close()

    async def accounting(self, timeout_s: float = 5.0) -> memory_pb2.AccountingSnapshot:
        return await self.memory.GetAccounting(memory_pb2.AccountingRequest(), timeout=timeout_s)

    async def model_info(self, timeout_s: float = 5.0) -> gateway_pb2.ModelInfo:
        return await self.gateway.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=timeout_s)

    async def generate(self, request: gateway_pb2.GenerateRequest, *, timeout_s: float | None = 120.0,
                       cancel_after_tokens: int | None = None, on_first=None) -> Stream:
        """One streamed Generate, never raising for a gRPC status (the Stream says how it ended)."""
        return await stream_generate(self.gateway, request, timeout_s=timeout_s, on_first=on_first,
                                     cancel_after_tokens=cancel_after_tokens, raise_errors=False)


# --- the environment --------------------------------------------------------------------------------------


@dataclasses.dataclass
class DrillEnv:
    """A running stack (``kvpager_tools.stack.Stack``) plus what drills need around it.

    ``redis`` is a ``RedisServer`` when the memory service mirrors to Redis.
    ``references`` caches undisturbed greedy outputs by (prompt, max_tokens).
    """

    stack: object
    redis: object | None = None
    seed: int = 0
    references: dict = dataclasses.field(default_factory=dict)
    clients: Clients | None = None
    rng: random.Random = dataclasses.field(default_factory=random.Random)
    exact: bool = True  # outputs comparable token for token (module docstring); ``learn_dtype``
    dtype: str = ""

    @property
    def security(self):
        return self.stack.config.security

    def open(self) -> Clients:
        """Clients on the current event loop (closed by ``close``)."""
        sec = self.security
        self.clients = Clients(self.stack.addresses, tls=self.stack.client_tls,
                               auth_token=sec.auth_token if sec else None,
                               admin_token=sec.admin_token if sec else None)
        self.rng = random.Random(self.seed)
        return self.clients

    async def learn_dtype(self) -> None:
        """``dtype`` and ``exact`` from the first executor that answers ``GetInfo``."""
        from kvpager.v1 import executor_pb2, executor_pb2_grpc

        sec = self.security
        for child in self.stack.children:
            if child.role != "executor":
                continue
            async with self.clients.channel(child.address, sec.auth_token if sec else None) as channel:
                stub = executor_pb2_grpc.ExecutorServiceStub(channel)
                try:
                    info = await stub.GetInfo(executor_pb2.GetInfoRequest(), timeout=10)
                except grpc.aio.AioRpcError:
                    continue
            self.dtype = info.dtype
            self.exact = info.dtype == "float32"
            return

    async def close(self) -> None:
        if self.clients is not None:
            await self.clients.close()
            self.clients = None

    @property
    def executor_names(self) -> list[str]:
        return [c.name for c in self.stack.children if c.role == "executor"]

    # --- references ---

    async def reference(self, prompt_ids, max_tokens: int) -> list[int]:
        """The greedy output of this prompt, measured once on an undisturbed
        stack (call before disturbing it)."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self.references:
            out = await self.clients.generate(greedy_request(prompt_ids, max_tokens), timeout_s=120)
            if out.status != "OK":
                raise RuntimeError(f"reference request failed: {out.status}: {out.details}")
            self.references[key] = out.first
        return self.references[key]

    def check_output(self, result: DrillResult, prompt_ids, max_tokens: int, out: Stream) -> None:
        """A completed greedy stream must equal its undisturbed reference."""
        key = (tuple(prompt_ids), max_tokens)
        ref = self.references.get(key)
        if out.status != "OK" or ref is None:
            return
        result.add("outputs_compared" if self.exact else "outputs_not_compared")
        if not self.exact:
            return
        if out.first != ref:
            # The whole of both outputs and the prompt: a rare divergence must be reproducible from the message.
            at = next((i for i, (g, w) in enumerate(zip(out.first, ref)) if g != w), min(len(out.first), len(ref)))
            result.violation(f"wrong output for a {len(prompt_ids)}-token prompt, first difference at token {at}: "
                             f"got {list(out.first)} want {list(ref)} prompt {list(prompt_ids)}")

    # --- the checks every drill ends with ---

    async def wait_baseline(self, timeout_s: float = 15.0) -> tuple[memory_pb2.AccountingSnapshot, float]:
        """Polls GetAccounting until every block is back; returns the last
        snapshot and how long it took."""
        t0 = time.monotonic()
        while True:
            try:
                snap = await self.clients.accounting()
            except grpc.aio.AioRpcError:
                snap = None
            if snap is not None and at_baseline(snap):
                return snap, time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                if snap is None:
                    raise RuntimeError("memory service not answering GetAccounting")
                return snap, time.monotonic() - t0
            await asyncio.sleep(0.02)

    async def health(self, settle_s: float = HEALTH_SETTLE_S) -> list[str]:
        """Problems with the services: exited children, health not SERVING
        within ``settle_s`` (a gateway's health follows its executors a poll
        later: one that rejoined just before the end reports SERVING then)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        problems = []
        dead = self.stack.poll()
        if dead is not None:
            problems.append(f"{dead[0]} exited with code {dead[1]}")
        for child in self.stack.children:
            deadline = time.monotonic() + settle_s
            async with self.clients.channel(child.address) as channel:
                while True:
                    try:
                        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                                 timeout=5)
                        problem = (None if reply.status == health_pb2.HealthCheckResponse.SERVING
                                   else f"{child.name} health is {reply.status}")
                    except grpc.aio.AioRpcError as err:
                        problem = f"{child.name} health check failed: {err.code().name}"
                    if problem is None or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
            if problem is not None:
                problems.append(problem)
        return problems

    async def finish(self, result: DrillResult, *, baseline_timeout_s: float = 15.0) -> DrillResult:
        """The common end: blocks back, identities, health."""
        snap, waited = await self.wait_baseline(baseline_timeout_s)
        result.leaked_blocks = leaked_blocks(snap)
        if not at_baseline(snap):
            t = snap.total
            result.violation(f"not at baseline after {baseline_timeout_s:g}s: used {t.used_blocks}, "
                             f"sequences {t.num_sequences}, swapped {t.num_swapped_sequences}, "
                             f"swap free {t.swap_free_blocks}/{t.swap_total_blocks}")
        for v in accounting_violations(snap):
            result.violation(f"accounting: {v}")
        result.figures["baseline_wait_s"] = round(waited, 3)
        problems = await self.health()
        result.healthy = not problems
        for p in problems:
            result.violation(f"health: {p}")
        return result


def rss_bytes(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of a process from /proc, in bytes; (0, 0) if gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def children_memory(stack) -> dict[str, dict[str, float]]:
    """RSS and peak RSS (MiB) of each live child of the stack."""
    out = {}
    for name, proc in stack.procs.items():
        if proc.poll() is None:
            rss, peak = rss_bytes(proc.pid)
            out[name] = {"rss_mib": round(rss / 2**20, 1), "peak_rss_mib": round(peak / 2**20, 1)}
    return out


FIRST_ORDINARY_TOKEN = 3  # the demo vocabulary: 0 bos, 1 eos, 2 pad


def random_prompt(rng: random.Random, vocab_size: int, length: int, prefix=()) -> list[int]:
    """``prefix`` + random ordinary token ids, ``length`` tokens in all."""
    tail = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(max(0, length - len(prefix)))]
    return [*prefix, *tail]


async def start_streams(clients: Clients, prompts: list[list[int]], max_tokens: int,
                        timeout_s: float = 60.0) -> tuple[list[asyncio.Future], int]:
    """Greedy streams for ``prompts``, waited on until every one has its first
    tokens (or ``timeout_s``). -> (the stream tasks, how many had started)."""
    started = asyncio.Event()
    num_started = 0

    def on_first() -> None:
        nonlocal num_started
        num_started += 1
        if num_started == len(prompts):
            started.set()

    tasks = [asyncio.ensure_future(clients.generate(greedy_request(p, max_tokens), on_first=on_first))
             for p in prompts]
    try:
        await asyncio.wait_for(started.wait(), timeout_s)
    except TimeoutError:
        pass
    return tasks, num_started
