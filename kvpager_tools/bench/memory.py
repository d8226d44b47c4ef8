"""`kvpager bench memory --json`: the seeds' claims, measured through the real
manager (and the real gRPC service for the RPC figures).

* seed_example: how many 300-token sequences a 1,000-block pool holds, paged
  vs a contiguous max-length (2,048) reservation.
* traces: ShareGPT-like and Alpaca-like length distributions replayed under
  continuous batching; time-averaged KV utilization vs the last-block
  analytic bound and vs both contiguous reservations (max context, the
  seeds'; prompt + max_tokens as each request declares it, Orca's "max"),
  with block-level usage beside token-level occupancy of the pool.
* sharing: parallel sampling (n = 2, 4, 6) and beam search (k = 2, 4, 6):
  blocks saved by sharing vs the analytic maximum.
* speed: one decode Step for 256 sequences in-process, on a realistic
  workload (prompts uniform in 100-500 tokens, so ~1/16 of the sequences
  open a block each step; ``decode_step``), split into validation / apply /
  schedule / plan building; with ``--nanovllm DIR``, nano-vllm's block
  manager on the same workload in the same process, alternating step by
  step. And over gRPC against a bare unary RPC (health Check) on the same
  server in the same run.
* hybrid: a Gemma-2-shaped model (half the layers sliding) on a fixed pool,
  a block table per KV group with window frees vs all full attention:
  concurrent sequences, their ratio and the analytic bound
  (``kvpager_tools.bench.hybrid``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time

from kvpager_tools.bench import hybrid
from kvpager_tools.bench.decode_step import DecodeWorkload, measure as measure_decode
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.records import NewSeq, StepInput

VOCAB = 32000


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _progress(msg: str) -> None:
    print(f"[bench memory] {msg}", file=sys.stderr, flush=True)


# ---- seed example -------------------------------------------------------------


def seed_example(num_blocks=1000, block_size=16, max_len=2048, seq_len=300) -> dict:
    m = MemoryManager()
    m.register_executor(ExecutorSpec("e0", num_blocks, block_size, max_model_len=max_len))
    rng = random.Random(0)
    admitted = 0
    for seq_id in range(num_blocks):
        prompt = [rng.randrange(VOCAB) for _ in range(seq_len)]
        out = m.step(StepInput(new_seqs=[NewSeq(seq_id, "e0", prompt)], schedule_seq_ids=[seq_id],
                               schedule_num_tokens=[seq_len]))
        if out.unscheduled:
            break
        admitted += 1
    # A contiguous allocator reserves max_len slots per sequence up front.
    contiguous = (num_blocks * block_size) // max_len
    return {"concurrency_paged": admitted, "concurrency_contiguous": contiguous,
            "bound_paged": num_blocks // _cdiv(seq_len, block_size),
            "bound_contiguous": contiguous,
            "ratio": admitted / contiguous if contiguous else None}


# ---- traces -------------------------------------------------------------------

TRACES = {
    # (input mean, input sigma, output mean, output sigma) of lognormal lengths
    "sharegpt": (161, 1.0, 338, 0.9),
    "alpaca": (19, 0.6, 59, 0.8),
}


def lognormal_lengths(rng: random.Random, mean: float, sigma: float, n: int, lo: int, hi: int) -> list[int]:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    return [max(lo, min(hi, int(round(rng.lognormvariate(mu, sigma))))) for _ in range(n)]


def replay_trace(name: str, num_requests=600, num_blocks=4000, block_size=16, max_len=2048,
                 max_running=256, sample_every=4, seed=0) -> dict:
    """Continuous batching through the real manager: admit FCFS while the pool
    has room, decode one token per running sequence per step, free on finish."""
    mi, si, mo, so = TRACES[name]
    rng = random.Random(seed)
    ins = lognormal_lengths(rng, mi, si, num_requests, 1, max_len // 2)
    outs = lognormal_lengths(rng, mo, so, num_requests, 1, max_len // 2)
    m = MemoryManager()
    m.register_executor(ExecutorSpec("e0", num_blocks, block_size, max_model_len=max_len))
    waiting = list(range(num_requests))  # new or preempted, in FCFS order
    created: set[int] = set()
    running: list[int] = []
    generated = [0] * num_requests
    pending: dict[int, int] = {}          # token sampled last step, appended this step
    finished: list[int] = []              # freed in the next step
    util, bound, contig, declared = [], [], [], []
    usage, occupancy, used_blocks, max_blocks, declared_blocks = [], [], [], [], []
    step_no = 0
    while waiting or running or finished:
        step_no += 1
        new, sched, nums = [], list(running), [1] * len(running)
        for seq_id in waiting[: max(0, max_running - len(running))]:
            if seq_id not in created:
                new.append(NewSeq(seq_id, "e0", [rng.randrange(VOCAB) for _ in range(ins[seq_id])],
                                  max_total_tokens=ins[seq_id] + outs[seq_id]))  # what the request declares
                created.add(seq_id)
            sched.append(seq_id)
            nums.append(1 << 30)  # "as much as fits": the whole prompt (or recompute)
        app = list(pending)
        out = m.step(StepInput(appended_seq_ids=app, appended_offsets=list(range(len(app) + 1)),
                               appended_tokens=[pending[s] for s in app], free_seq_ids=finished,
                               new_seqs=new, schedule_seq_ids=sched, schedule_num_tokens=nums))
        pending, finished = {}, []
        for seq_id, _ in out.preempted:
            if seq_id in running:
                running.remove(seq_id)
                waiting.insert(0, seq_id)
        for plan in out.executor_plans:
            for seq_id in plan.seq_ids:
                seq = m.seqs[seq_id]
                if seq.num_computed < seq.num_tokens:
                    continue  # a prefill chunk: nothing sampled yet
                if seq_id in waiting:
                    waiting.remove(seq_id)
                    running.append(seq_id)
                generated[seq_id] += 1
                if generated[seq_id] >= outs[seq_id]:
                    running.remove(seq_id)
                    finished.append(seq_id)
                else:
                    pending[seq_id] = rng.randrange(VOCAB)
        if step_no % sample_every == 0:
            total, _ = m.accounting()
            live = [m.seqs[s].num_computed for s in running + finished if m.seqs[s].blocks]
            if live and total.allocated_slots:
                util.append(total.kv_utilization)
                bound.append(sum(live) / sum(_cdiv(n, block_size) * block_size for n in live))
                contig.append(sum(live) / (len(live) * max_len))
                # The accounting's own figures: both counterfactuals beside the pool's block and token usage.
                declared.append(total.live_tokens / (total.contiguous_declared_blocks * block_size))
                usage.append(total.block_usage)
                occupancy.append(total.token_occupancy)
                used_blocks.append(total.used_blocks)
                max_blocks.append(total.contiguous_equivalent_blocks)
                declared_blocks.append(total.contiguous_declared_blocks)
    bad = m.check_invariants()
    return {"kv_utilization": round(statistics.fmean(util), 5),
            "analytic_bound": round(statistics.fmean(bound), 5),
            "contiguous_utilization": round(statistics.fmean(contig), 5),
            "contiguous_declared_utilization": round(statistics.fmean(declared), 5),
            "block_usage": round(statistics.fmean(usage), 5),
            "token_occupancy": round(statistics.fmean(occupancy), 5),
            "used_blocks": round(statistics.fmean(used_blocks), 1),
            "contiguous_equivalent_blocks": round(statistics.fmean(max_blocks), 1),
            "contiguous_declared_blocks": round(statistics.fmean(declared_blocks), 1),
            "mean_input": round(statistics.fmean(ins), 1), "mean_output": round(statistics.fmean(outs), 1),
            "requests": num_requests, "steps": step_no, "invariant_violations": len(bad)}


# ---- sharing ------------------------------------------------------------------


def parallel_sharing(n: int, trials=40, block_size=16, seed=0) -> dict:
    """One prompt, n completions: prefill once, fork, diverge."""
    rng = random.Random(seed)
    mi, si, mo, so = TRACES["sharegpt"]
    saved = logical = analytic_saved = 0
    for t in range(trials):
        p = lognormal_lengths(rng, mi, si, 1, 1, 1024)[0]
        o = lognormal_lengths(rng, mo, so, 1, 2, 1024)[0]
        m = MemoryManager()
        m.register_executor(ExecutorSpec("e0", 4096, block_size, max_model_len=4096))
        prompt = [rng.randrange(VOCAB) for _ in range(p)]
        m.step(StepInput(new_seqs=[NewSeq(0, "e0", prompt)], schedule_seq_ids=[0], schedule_num_tokens=[p]))
        ids = list(range(n))
        # the prefill's logits give each completion its own first token
        m.step(StepInput(forks=[(0, ids[1:])] if n > 1 else [],
                         appended_seq_ids=ids, appended_offsets=list(range(n + 1)),
                         appended_tokens=[rng.randrange(VOCAB) for _ in ids],
                         schedule_seq_ids=ids, schedule_num_tokens=[1] * n))
        for _ in range(o - 1):
            m.step(StepInput(appended_seq_ids=ids, appended_offsets=list(range(n + 1)),
                             appended_tokens=[rng.randrange(VOCAB) for _ in ids],
                             schedule_seq_ids=ids, schedule_num_tokens=[1] * n))
        total, _ = m.accounting()
        saved += total.sharing_saved_blocks
        logical += total.logical_blocks
        per = _cdiv(p + o, block_size)
        shared_full = p // block_size  # a partial prompt block diverges at the first write
        analytic_saved += (n - 1) * shared_full
        assert total.logical_blocks == n * per
        assert not m.check_invariants()
    frac, best = saved / logical, analytic_saved / logical
    return {"saved_fraction": round(frac, 5), "analytic_max": round(best, 5),
            "ratio_to_max": round(frac / best, 5) if best else None}


def beam_sharing(k: int, steps=160, trials=6, block_size=16, seed=0) -> dict:
    """Beam search with random scores: each step every beam proposes k
    continuations, the best k survive; kept-twice beams fork, unkept beams are
    freed. Measured every step against the minimum a block trie could use."""
    rng = random.Random(seed)
    saved = logical = analytic_saved = 0
    for t in range(trials):
        m = MemoryManager()
        m.register_executor(ExecutorSpec("e0", 8192, block_size, max_model_len=8192))
        p = lognormal_lengths(rng, 161, 1.0, 1, 1, 1024)[0]
        prompt = [rng.randrange(VOCAB) for _ in range(p)]
        m.step(StepInput(new_seqs=[NewSeq(0, "e0", prompt)], schedule_seq_ids=[0], schedule_num_tokens=[p]))
        beams = {0: 0.0}  # seq id -> score
        next_id = 1
        for _ in range(steps):
            cands = [(score + math.log(rng.random()), sid, rng.randrange(VOCAB))
                     for sid, score in beams.items() for _ in range(k)]
            cands.sort(reverse=True)
            kept = cands[:k]
            by_parent: dict[int, list] = {}
            for c in kept:
                by_parent.setdefault(c[1], []).append(c)
            forks, app_ids, app_tok, new_beams = [], [], [], {}
            for parent, cs in by_parent.items():
                children = list(range(next_id, next_id + len(cs) - 1))
                next_id += len(children)
                if children:
                    forks.append((parent, children))
                for sid, c in zip([parent, *children], cs):
                    app_ids.append(sid)
                    app_tok.append(c[2])
                    new_beams[sid] = c[0]
            free = [sid for sid in beams if sid not in by_parent]
            m.step(StepInput(forks=forks, appended_seq_ids=app_ids, appended_offsets=list(range(len(app_ids) + 1)),
                             appended_tokens=app_tok, free_seq_ids=free,
                             schedule_seq_ids=app_ids, schedule_num_tokens=[1] * len(app_ids)))
            beams = new_beams
            total, _ = m.accounting()
            saved += total.sharing_saved_blocks
            logical += total.logical_blocks
            # The minimum: one block per distinct full-block prefix, plus each
            # beam's own partial tail.
            nodes = set()
            tails = 0
            for sid in beams:
                seq = m.seqs[sid]
                toks = tuple(seq.token_ids[:seq.num_computed])
                for i in range(len(toks) // block_size):
                    nodes.add(toks[: (i + 1) * block_size])
                tails += 1 if len(toks) % block_size else 0
            analytic_saved += total.logical_blocks - (len(nodes) + tails)
        assert not m.check_invariants()
    frac, best = saved / logical, analytic_saved / logical
    return {"saved_fraction": round(frac, 5), "analytic_max": round(best, 5),
            "ratio_to_max": round(frac / best, 5) if best else None}


# ---- speed --------------------------------------------------------------------


def rpc_figures(batch=256, steps=300, repeats=5) -> tuple[float, float]:
    """(Step RPC µs, bare unary RPC µs): the memory service runs in its own
    process; both are timed from the same client in the same run."""
    import os
    import subprocess

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpager.channel import make_channel
    from kvpager.packed import pack_i32, pack_i64
    from kvpager_tools.ports import free_port
    from kvpager.v1 import common_pb2, memory_pb2, memory_pb2_grpc

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "memory_service", "--port", str(port), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        channel = make_channel(f"127.0.0.1:{port}", aio=False)
        grpc.channel_ready_future(channel).result(timeout=30)
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(200):
            if health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.05)
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        rng = random.Random(0)
        step_medians, echo_medians = [], []
        for r in range(repeats):
            eid = f"bench{r}"
            stub.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
                executor_id=eid, num_blocks=batch * 64, block_size=16, max_model_len=4096, vocab_size=VOCAB)))
            base = r * 10_000_000
            ids = list(range(base, base + batch))
            # the decode-step workload's prompt mix (100-500 tokens): ~1/16 open a block per step
            prompts = DecodeWorkload(batch=batch).prompts(r)
            new = [memory_pb2.NewSequence(seq_id=i, executor_id=eid, prompt_token_ids=pack_i32(p))
                   for i, p in zip(ids, prompts)]
            step_id = r * 100_000 + 1
            stub.Step(memory_pb2.StepRequest(step_id=step_id, new_sequences=new, schedule_seq_ids=pack_i64(ids),
                                             schedule_num_tokens=pack_i32(map(len, prompts))))
            packed_ids = pack_i64(ids)
            offsets = pack_i32(range(batch + 1))
            ones = pack_i32([1] * batch)
            times, echo = [], []
            sampled = [[rng.randrange(VOCAB) for _ in ids] for _ in range(steps)]  # the executor's output
            for i in range(steps):
                step_id += 1
                t0 = time.perf_counter()
                req = memory_pb2.StepRequest(
                    step_id=step_id,
                    appended=common_pb2.TokenBatch(seq_ids=packed_ids, offsets=offsets,
                                                   token_ids=pack_i32(sampled[i])),
                    schedule_seq_ids=packed_ids, schedule_num_tokens=ones)
                stub.Step(req)
                times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                health.Check(health_pb2.HealthCheckRequest())
                echo.append(time.perf_counter() - t0)
            stub.Free(memory_pb2.FreeRequest(seq_ids=ids))
            stub.DeregisterExecutor(memory_pb2.DeregisterExecutorRequest(executor_id=eid))
            step_medians.append(statistics.median(times))
            echo_medians.append(statistics.median(echo))
        channel.close()
        return statistics.median(step_medians) * 1e6, statistics.median(echo_medians) * 1e6
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_all(quick: bool = False, nanovllm: str | None = None, decode_runs: int | None = None) -> dict:
    _progress("seed example")
    result = {"seed_example": seed_example()}
    result["traces"] = {}
    for name in TRACES:
        _progress(f"trace {name}")
        result["traces"][name] = replay_trace(name, num_requests=200 if quick else 600)
    result["sharing"] = {}
    for n in (2, 4, 6):
        _progress(f"parallel n={n}")
        result["sharing"][f"parallel_n{n}"] = parallel_sharing(n, trials=8 if quick else 40)
    for k in (2, 4, 6):
        _progress(f"beam k={k}")
        result["sharing"][f"beam_{k}"] = beam_sharing(k, steps=60 if quick else 160, trials=2 if quick else 6)
    _progress("hybrid (sliding-window groups)")
    result["hybrid"] = hybrid.run(quick=quick)
    _progress("speed (in-process decode step)")
    batch = 256
    w = DecodeWorkload(batch=batch, steps=100 if quick else 200, runs=decode_runs or (3 if quick else 5))
    decode = measure_decode(w, nanovllm, progress=_progress)
    _progress("speed (gRPC)")
    rpc_us, echo_us = rpc_figures(batch, steps=100 if quick else 300, repeats=3 if quick else 5)
    result["speed"] = {"batch": batch, "step_plan_us_inprocess": decode["decode_step_us"],
                       "step_rpc_us": round(rpc_us, 1), "echo_rpc_us": round(echo_us, 1),
                       "rpc_over_echo": round(rpc_us / echo_us, 3), **decode}
    return result


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="block-manager benchmark: paging, sharing, Step speed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="smaller traces (CI smoke)")
    p.add_argument("--nanovllm", metavar="DIR", default=None,
                   help="a nano-vllm checkout: time its block manager on the same decode workload "
                        "(needs `pip install xxhash`)")
    p.add_argument("--decode-runs", type=int, default=None, metavar="N",
                   help="runs of the decode-step comparison (default 5, 3 with --quick)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    result = run_all(quick=args.quick, nanovllm=getattr(args, "nanovllm", None),
                     decode_runs=getattr(args, "decode_runs", None))
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m kvpager_tools.bench.memory")
    cli.add_argument("--json", action="store_true")
    cli.add_argument("--quick", action="store_true")
    cli.add_argument("--nanovllm", default=None)
    cli.add_argument("--decode-runs", type=int, default=None)
    sys.exit(_run(cli.parse_args()))
