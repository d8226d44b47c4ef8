"""GPU benchmark: a decode step replayed as a CUDA graph vs run eagerly (CUDA only).

    TRITON_INTERPRET=0 python benchmarks/decode_graphs_gpu.py --json > decode_graphs_gpu.json

For each batch size, one decode step of our own forward (the Triton
backend, ``executor_service.models.llama``) over a pool whose sequences hold
``--context`` tokens each, timed as the executor runs it: eagerly
(``ModelRunner.forward``) and through ``DecodeGraphs.replay`` (inputs copied
into the static buffers, padding, replay, logits rows taken). Each figure is
the median of ``--rounds`` rounds, a round the mean of ``--steps`` steps
after a synchronize. Prints the capture time, per batch the two step times,
``speedup`` (eager / graph) and decode tokens/s, and the largest logits
difference between the two paths. Default model: the random
Qwen2.5-0.5B-shaped Llama of ``kvpager bench compare-vllm`` in bf16.

The batch builder is a plain function so tests can run it on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # run as a script from anywhere

from executor_service.model_runner import ForwardBatch  # noqa: E402

BATCHES = (1, 8, 32, 128)


def decode_batch(batch: int, context: int, block_size: int, width: int, device) -> ForwardBatch:
    """One decode step of ``batch`` sequences, row i in blocks
    ``1 + i * per_seq ...`` (block 0 left free), its new token at position
    ``context - 1``. Tables are ``width`` blocks wide."""
    per_seq = -(-context // block_size)
    if per_seq > width:
        raise ValueError(f"context {context} needs {per_seq} blocks a sequence, the tables hold {width}")
    tables = 1 + torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    tables = torch.cat([tables, torch.zeros(batch, width - per_seq, dtype=torch.int32)], dim=1)
    pos = context - 1
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # [batch]
    return ForwardBatch(
        input_ids=(torch.arange(batch, dtype=torch.int64) % 1000 + 3).to(device),
        positions=torch.full((batch,), pos, dtype=torch.int64, device=device),
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        logits_indices=torch.arange(batch, dtype=torch.int64, device=device),
    )


def pool_blocks(batches, context: int, block_size: int) -> int:
    """Blocks the largest batch needs, plus block 0."""
    return 1 + max(batches) * -(-context // block_size)


def time_steps(fn, steps: int, rounds: int, sync) -> tuple[float, list[float]]:
    """Median over rounds of the mean step time (ms), and every round's."""
    per_round = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        per_round.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(per_round), per_round


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-0.5b", help="'llama-30m', 'llama-0.5b' or a checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--context", type=int, default=512, help="tokens each sequence holds")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048, help="sets the static tables' width")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_graphs_gpu: needs a CUDA device", file=sys.stderr)
        return 2
    from executor_service.attention import load_backend
    from executor_service.cuda_graphs import DecodeGraphs, cuda_graph_factory
    from executor_service.model_runner import ModelRunner
    from kvpager_tools.bench.common import model_dir

    batches = sorted({int(b) for b in args.batches.split(",")})
    runner = ModelRunner(model_dir(args.model), device="cuda", dtype=args.dtype, model_impl="kvpager")
    backend = load_backend("triton")
    width = -(-args.max_model_len // args.block_size)
    kv = torch.randn((runner.num_layers, 2, pool_blocks(batches, args.context, args.block_size), args.block_size,
                      runner.num_kv_heads, runner.head_dim), dtype=runner.dtype, device=runner.device)
    kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(runner.num_layers)]
    t0 = time.perf_counter()
    graphs = DecodeGraphs(runner, kv_caches, backend, None, num_groups=1, max_blocks_per_seq=width,
                          max_batch=max(batches), new_graph=cuda_graph_factory(),
                          on_progress=lambda done, total: print(f"captured {done}/{total}", file=sys.stderr))
    capture_s = time.perf_counter() - t0
    sync = torch.cuda.synchronize
    rows = []
    for b in batches:
        batch = decode_batch(b, args.context, args.block_size, width, runner.device)
        eager_fn = lambda: runner.forward(batch, kv_caches, backend)  # noqa: E731
        graph_fn = lambda: graphs.replay(batch)  # noqa: E731
        diff = (eager_fn() - graph_fn()).abs().max().item()
        eager_ms, eager_rounds = time_steps(eager_fn, args.steps, args.rounds, sync)
        graph_ms, graph_rounds = time_steps(graph_fn, args.steps, args.rounds, sync)
        rows.append(dict(batch=b, graph_size=graphs.size_for(b), eager_ms=round(eager_ms, 3),
                         graph_ms=round(graph_ms, 3), speedup=round(eager_ms / graph_ms, 3),
                         graph_tok_s=round(b / graph_ms * 1e3, 1), eager_tok_s=round(b / eager_ms * 1e3, 1),
                         max_abs_logit_diff=diff, eager_rounds_ms=[round(x, 3) for x in eager_rounds],
                         graph_rounds_ms=[round(x, 3) for x in graph_rounds]))
        print(f"batch {b}: eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms ({eager_ms / graph_ms:.2f}x)",
              file=sys.stderr)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, model=str(args.model),
                  dtype=args.dtype, context=args.context, block_size=args.block_size, table_width=width,
                  capture_s=round(capture_s, 2), graph_sizes=graphs.sizes, steps=args.steps, rounds=args.rounds,
                  results=rows)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
