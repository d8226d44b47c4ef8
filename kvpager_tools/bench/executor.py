"""``kvpager bench executor``: decode step time (forward + sample) by batch size.

For each model (the demo model and a ~30M-parameter random Llama: hidden 512,
8 layers, 8 heads / 2 KV heads, vocab 8192) and each decode batch size, runs
steps of ``batch_size`` sequences, one new token each over a context of
``--context-len`` tokens, greedy sampling:

* in-process: ``Executor.execute`` on a checked ``StepInput``;
* gRPC: the same executor behind its real server (``start_executor_server``
  on loopback), a blocking client stub, request packing included.

Each figure is the median of ``--repeats`` steps after a warm-up; implied
tokens/s = batch_size / step time. The pool's contents are whatever is in it
(zeros): attention cost depends on lengths, not values, so no prefill is run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

MODELS = ("demo", "llama-30m", "llama-0.5b")  # kvpager_tools.bench.common.model_dir names
DEFAULT_BATCH_SIZES = (1, 4, 16, 64, 256)
_STOP_GRACE_S = 5.0  # nothing is in flight when the benchmark stops its server


def add_bench_parser(bench_subparsers) -> argparse.ArgumentParser:
    p = bench_subparsers.add_parser("executor", help="executor decode step time by batch size (in-process vs gRPC)")
    p.add_argument("--models", default="demo,llama-30m", help=f"comma list of {sorted(MODELS)} or checkpoint dirs")
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    p.add_argument("--context-len", type=int, default=64, help="tokens already in each sequence's cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-grpc", action="store_true", help="in-process only")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(func=main)
    return p


def _model_dir(name: str) -> Path:
    from kvpager_tools.bench.common import model_dir

    return model_dir(name)


def _start_step(step_id: int, batch: int, ctx: int, num_blocks_each: int, epoch: int):
    """StepInput that starts ``batch`` sequences with ``ctx`` tokens in cache and no rows:
    sequence i owns blocks [i*nb, (i+1)*nb) (the executor keeps the tables from here on)."""
    import numpy as np

    from executor_service.step import StepInput
    from executor_service.tables import TableChanges

    nb = num_blocks_each
    seqs = np.arange(batch)
    tables = (seqs[:, None] * nb + np.arange(nb)[None, :]).astype(np.int32)  # [B, nb]
    return StepInput(
        step_id=step_id, seq_ids=np.zeros(0, np.int64), query_lens=np.zeros(0, np.int32),
        token_ids=np.zeros(0, np.int32), table_epoch=epoch,
        tables=TableChanges(started_seq_ids=seqs.astype(np.int64), started_context_lens=np.full(batch, ctx, np.int32),
                            started_offsets=(np.arange(batch + 1) * nb).astype(np.int32),
                            started_block_ids=tables.reshape(-1)))


def _decode_step(step_id: int, batch: int, ctx: int, epoch: int):
    """StepInput of ``batch`` decodes at position ``ctx`` (no table changes: a decode inside a block)."""
    import numpy as np

    from executor_service.step import StepInput

    seqs = np.arange(batch)
    return StepInput(
        step_id=step_id, seq_ids=seqs.astype(np.int64), query_lens=np.ones(batch, np.int32),
        token_ids=((seqs * 7919 + step_id) % 250 + 3).astype(np.int32), table_epoch=epoch,
        context_lens=np.full(batch, ctx, np.int32))


def _to_proto(step):
    from kvpager.v1 import common_pb2, executor_pb2

    t = step.tables
    tables = common_pb2.TableChanges(
        started_seq_ids=t.started_seq_ids.astype("<i8").tobytes(),
        started_context_lens=t.started_context_lens.astype("<i4").tobytes(),
        started_offsets=t.started_offsets.astype("<i4").tobytes(),
        started_block_ids=t.started_block_ids.astype("<i4").tobytes())
    return executor_pb2.ExecuteRequest(
        step_id=step.step_id,
        plan=common_pb2.ExecutorPlan(table_epoch=step.table_epoch, seq_ids=step.seq_ids.astype("<i8").tobytes(),
                                     query_lens=step.query_lens.astype("<i4").tobytes(), tables=tables),
        context_lens=step.context_lens.astype("<i4").tobytes() if step.context_lens is not None else b"",
        token_ids=step.token_ids.astype("<i4").tobytes(),
    )


def _median_s(fn, repeats: int, warmup: int) -> tuple[float, list]:
    results = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            results.append((dt, r))
    return statistics.median(dt for dt, _ in results), [r for _, r in results]


def bench_model(name: str, args, batch_sizes: list[int]) -> dict:
    import asyncio
    import threading

    from executor_service.config import ExecutorConfig
    from executor_service.executor import Executor

    path = _model_dir(name)
    steps_each = 2 * (args.warmup + args.repeats)  # in process, then over gRPC
    blocks_per_seq = -(-(args.context_len + steps_each + 1) // args.block_size)
    cfg = ExecutorConfig(model=str(path), executor_id=f"bench-{Path(name).name}", block_size=args.block_size,
                         num_blocks=max(batch_sizes) * blocks_per_seq, swap_blocks=0, device=args.device,
                         dtype=args.dtype, attention_backend=args.attention_backend)
    executor = Executor(cfg)
    info = executor.info()
    stub = loop = server = channel = None
    if not args.no_grpc:
        from executor_service.service import start_executor_server
        from kvpager.channel import make_channel
        from kvpager.v1 import executor_pb2_grpc

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        server = asyncio.run_coroutine_threadsafe(start_executor_server(cfg, executor=executor), loop).result(60)
        channel = make_channel(server.address, aio=False)
        stub = executor_pb2_grpc.ExecutorServiceStub(channel)

    rows = []
    try:
        for epoch, batch in enumerate(batch_sizes, start=1):
            # Decodes from context_len on: each step one token further, tables kept by the executor.
            executor.execute(_start_step(0, batch, args.context_len, blocks_per_seq, epoch))
            position = iter(range(args.context_len, args.context_len + steps_each))

            def decode():
                return _decode_step(1, batch, next(position), epoch)

            in_s, outs = _median_s(lambda: executor.execute(decode()), args.repeats, args.warmup)
            row = {
                "batch_size": batch,
                "in_process_step_s": in_s,
                "in_process_tokens_per_s": batch / in_s,
                "forward_s": statistics.median(o.forward_s for o in outs),
                "sample_s": statistics.median(o.sample_s for o in outs),
            }
            if stub is not None:
                def call():
                    return stub.Execute(_to_proto(decode()), timeout=600)

                rpc_s, _ = _median_s(call, args.repeats, args.warmup)
                row.update(grpc_step_s=rpc_s, grpc_tokens_per_s=batch / rpc_s, grpc_overhead_s=rpc_s - in_s)
            rows.append(row)
    finally:
        if server is not None:
            channel.close()
            # A grace, not 0: stop(0) cancels all calls at once, which sends a GOAWAY carrying an
            # error to any transport still closing behind channel.close(), and grpc logs that one
            # at INFO with "Error code" in it. With nothing in flight a graceful stop returns at once.
            asyncio.run_coroutine_threadsafe(server.stop(_STOP_GRACE_S), loop).result(30)
            # Stop and close the loop before the interpreter exits: a loop left running in a
            # daemon thread still has grpc's poller fd registered, and its teardown at exit
            # logged "OSError: [Errno 9] Bad file descriptor".
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
    return {
        "model": name,
        "path": str(path),
        "num_params": executor.runner.num_params,
        "model_type": info.model_type,
        "num_layers": info.num_layers,
        "vocab_size": info.vocab_size,
        "dtype": info.dtype,
        "device": info.device,
        "attention_backend": info.attention_backend,
        "context_len": args.context_len,
        "results": rows,
    }


def run(args) -> dict:
    import torch

    batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b]
    models = [m for m in str(args.models).split(",") if m]
    return {
        "benchmark": "executor",
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "models": [bench_model(m, args, batch_sizes) for m in models],
    }


def main(args) -> int:
    from transformers.utils import logging as hf_logging

    from kvpager.telemetry import configure_logging

    configure_logging("executor-bench", level="WARNING")  # stderr; stdout is the report
    hf_logging.set_verbosity_error()
    report = run(args)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    for m in report["models"]:
        print(f"{m['model']}: {m['num_params'] / 1e6:.1f}M params, {m['device']}, {m['dtype']}, "
              f"{m['attention_backend']}, context {m['context_len']}")
        print(f"  {'batch':>5} {'in-proc ms':>11} {'tok/s':>9} {'gRPC ms':>9} {'tok/s':>9}")
        for r in m["results"]:
            grpc_ms = f"{r['grpc_step_s'] * 1e3:9.2f}" if "grpc_step_s" in r else f"{'-':>9}"
            grpc_tps = f"{r['grpc_tokens_per_s']:9.0f}" if "grpc_tokens_per_s" in r else f"{'-':>9}"
            print(f"  {r['batch_size']:>5} {r['in_process_step_s'] * 1e3:11.2f} {r['in_process_tokens_per_s']:9.0f} "
                  f"{grpc_ms} {grpc_tps}")
    return 0
