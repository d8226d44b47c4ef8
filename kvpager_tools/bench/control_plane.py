"""The control plane of one decode step, alone: a memory-service Step and an
Execute, driven from this process the way the gateway drives them, against
a real memory service and a real executor (their own processes, loopback
gRPC), with no streams, clients or gateway loop competing for the cores.

For B sequences at a context of ~C tokens (one shared C-token prefix plus
a short private suffix each, so the pool and the prefill stay small while
every sequence's table is C / block_size blocks long), after a prefill, each
decode step measures:

* ``step_us``: the Step round trip (appended tokens in, plan out);
* ``execute_overhead_us``: the Execute round trip minus the executor's own
  forward and sampling time: unpacking, validation, table changes, input
  building, packing, the RPC;
* ``control_us`` = the two, and its ratio to two bare unary RPCs (a
  grpc.health Check round trip) timed in the same run two ways:
  ``echo_us``, back to back (the services hot), and ``paced_echo_us``, one
  Check to the memory service and one to the executor in place of a step's
  Step and Execute timing, at the same moments of the cycle: after the
  forward a service has been idle for as long as before a real Step, and an
  idle process pays its wake-up (measured here: a Check after 3 ms idle
  costs ~1.5x a hot one, after 30 ms ~2.5x). ``control_x_two_echoes`` is
  against the hot echo, ``control_x_paced_echoes`` against the paced pair;
* the bytes of each message: ``step_request_bytes``, ``plan_bytes`` (the
  StepPlan, = ``bytes_per_step``: what the plan costs on the wire),
  ``execute_request_bytes``, ``execute_response_bytes``.

Medians over the decode steps (on equal contexts every sequence crosses a
block boundary in the same step, one step in block_size; the median step
crosses none).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time


async def _check_us(stub) -> float:
    from grpc_health.v1 import health_pb2

    t0 = time.perf_counter()
    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    return (time.perf_counter() - t0) * 1e6


async def _echo_us(channel, n: int = 200) -> float:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    for _ in range(20):
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class _Driver:
    """Steps B sequences of one executor through the memory service and the executor."""

    def __init__(self, memory, executor, executor_id: str, incarnation: int) -> None:
        self.memory, self.executor = memory, executor
        self.executor_id, self.incarnation = executor_id, incarnation
        self.step_id = int(time.time() * 1000) << 8
        self.computed: dict[int, int] = {}
        self.tokens: dict[int, list[int]] = {}

    async def step(self, *, new=(), schedule=(), appended=None, echo=None):
        """One Step + Execute; returns (sampled {seq: token}, figures of the step).
        ``echo``: (memory health stub, executor health stub): time a Check to each
        just before its RPC (the figures then hold the echoes, not this step's RPCs)."""
        from kvpager.packed import pack_i32, pack_i64, unpack_i32, unpack_i64
        from kvpager.v1 import common_pb2, executor_pb2, memory_pb2

        self.step_id += 1
        req = memory_pb2.StepRequest(
            step_id=self.step_id,
            new_sequences=[memory_pb2.NewSequence(seq_id=s, executor_id=self.executor_id,
                                                  prompt_token_ids=pack_i32(self.tokens[s])) for s in new],
            schedule_seq_ids=pack_i64(s for s, _ in schedule), schedule_num_tokens=pack_i32(n for _, n in schedule))
        if appended:
            ids = list(appended)
            req.appended.CopyFrom(common_pb2.TokenBatch(seq_ids=pack_i64(ids), offsets=pack_i32(range(len(ids) + 1)),
                                                        token_ids=pack_i32(appended[s] for s in ids)))
        echoes = {}
        if echo is not None:
            echoes["memory"] = await _check_us(echo[0])
        t0 = time.perf_counter()
        plan = await self.memory.Step(req, timeout=300)
        t1 = time.perf_counter()
        (ep,) = plan.executor_plans
        seq_ids = list(unpack_i64(ep.seq_ids))
        qlens = list(unpack_i32(ep.query_lens))
        starts = dict(zip(unpack_i64(ep.tables.started_seq_ids), unpack_i32(ep.tables.started_context_lens)))
        ctx = [starts.get(s, self.computed.get(s, 0)) for s in seq_ids]
        toks, samples = [], []
        for s, c, q in zip(seq_ids, ctx, qlens):
            toks.extend(self.tokens[s][c:c + q])
            samples.append(1 if c + q == len(self.tokens[s]) else 0)
            self.computed[s] = c + q
        n = len(seq_ids)
        ex_req = executor_pb2.ExecuteRequest(
            step_id=self.step_id, incarnation=self.incarnation, plan=ep, context_lens=pack_i32(ctx),
            token_ids=pack_i32(toks), sampling=executor_pb2.SamplingBatch(
                num_samples=pack_i32(samples), seeds=pack_i64([0] * sum(samples))))
        if echo is not None:
            echoes["executor"] = await _check_us(echo[1])
        t2 = time.perf_counter()
        resp = await self.executor.Execute(ex_req, timeout=300)
        t3 = time.perf_counter()
        sampled = iter(unpack_i32(resp.sampled_token_ids))
        out = {s: next(sampled) for s, k in zip(seq_ids, samples) if k}
        if echo is not None:
            return out, echoes
        figures = {"rows": n, "step_us": (t1 - t0) * 1e6,
                   "execute_overhead_us": ((t3 - t2) - resp.forward_s - resp.sample_s) * 1e6,
                   "forward_us": resp.forward_s * 1e6, "step_request_bytes": req.ByteSize(),
                   "plan_bytes": plan.ByteSize(), "execute_request_bytes": ex_req.ByteSize(),
                   "execute_response_bytes": resp.ByteSize()}
        return out, figures


async def _measure(memory_address: str, executor_address: str, batches: list[int], contexts: list[int],
                   decode_steps: int, token_lo: int, token_hi: int, seed: int) -> list[dict]:
    from grpc_health.v1 import health_pb2_grpc

    from kvpager.channel import make_channel
    from kvpager.v1 import executor_pb2_grpc, memory_pb2, memory_pb2_grpc

    rng = random.Random(seed)
    rows = []
    async with make_channel(memory_address) as mch, make_channel(executor_address) as ech:
        memory = memory_pb2_grpc.MemoryServiceStub(mch)
        executor = executor_pb2_grpc.ExecutorServiceStub(ech)
        health = (health_pb2_grpc.HealthStub(mch), health_pb2_grpc.HealthStub(ech))
        (pool,) = (await memory.ListExecutors(memory_pb2.ListExecutorsRequest(), timeout=10)).executors
        next_id = 1 << 40
        for context in contexts:
            for batch in batches:
                drv = _Driver(memory, executor, pool.executor_id, pool.incarnation)
                # The longest sequence reaches ``context`` tokens: 8 after the
                # prefix, one per step of the 2 * decode_steps (timed and paced).
                prefix_len = context - 2 * decode_steps - 8
                if prefix_len < 1:
                    raise ValueError(f"context {context} is too short for {decode_steps} decode steps")
                prefix = [rng.randrange(token_lo, token_hi) for _ in range(prefix_len)]
                ids = list(range(next_id, next_id + batch))
                next_id += batch
                for s in ids:
                    drv.tokens[s] = prefix + [rng.randrange(token_lo, token_hi) for _ in range(8)]
                # The prefill: the first computes the prefix, the others hit it in the same step.
                sampled, _ = await drv.step(new=ids, schedule=[(s, len(drv.tokens[s])) for s in ids])
                echo = await _echo_us(mch)
                figures, paced = [], []
                for i in range(2 * decode_steps):  # odd steps time the paced echoes, even ones the RPCs
                    for s, t in sampled.items():
                        drv.tokens[s].append(t)
                    sampled, f = await drv.step(schedule=[(s, 1) for s in ids], appended=sampled,
                                                echo=health if i % 2 else None)
                    (paced if i % 2 else figures).append(f)
                await memory.Free(memory_pb2.FreeRequest(seq_ids=ids), timeout=30)
                reached = max(len(t) for t in drv.tokens.values())
                assert reached == context, (reached, context)  # the figures are for the context reported
                med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
                control = med["step_us"] + med["execute_overhead_us"]
                paced_mem = statistics.median(p["memory"] for p in paced)
                paced_exec = statistics.median(p["executor"] for p in paced)
                rows.append({
                    "batch": batch, "context": context, "steps": len(figures), "echo_us": round(echo, 1),
                    "step_us": round(med["step_us"], 1), "execute_overhead_us": round(med["execute_overhead_us"], 1),
                    "control_us": round(control, 1), "control_x_two_echoes": round(control / (2 * echo), 2),
                    "paced_echo_us": {"memory": round(paced_mem, 1), "executor": round(paced_exec, 1)},
                    "control_x_paced_echoes": round(control / (paced_mem + paced_exec), 2),
                    "forward_us": round(med["forward_us"], 1),
                    "bytes_per_step": int(med["plan_bytes"]),
                    "step_request_bytes": int(med["step_request_bytes"]), "plan_bytes": int(med["plan_bytes"]),
                    "plan_bytes_max": max(f["plan_bytes"] for f in figures),
                    "execute_request_bytes": int(med["execute_request_bytes"]),
                    "execute_response_bytes": int(med["execute_response_bytes"])})
    return rows


def measure(memory_address: str, executor_address: str, batches: list[int], contexts: list[int], *,
            decode_steps: int = 24, token_lo: int = 3, token_hi: int = 300, seed: int = 0) -> list[dict]:
    return asyncio.run(_measure(memory_address, executor_address, batches, contexts, decode_steps,
                                token_lo, token_hi, seed))
