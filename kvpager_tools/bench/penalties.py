"""`kvpager bench penalties --json`: what penalties cost per decode step.

Penalties need each sequence's tokens. kvpager keeps them in the executor
(executor_service/history.py) and sends a sequence's tokens in cache once,
with its start; the alternative is to send every penalised row's history
with every step. For B decoding sequences at context C this prints, from the
real message builders (gateway.wire.execute_request, no stack):

* the bytes of one decode ExecuteRequest without penalties, with them as
  built, and with the history sent every step (what the other design sends);
* the executor's added time per step: keeping the histories
  (TokenHistories.resolve + commit) and the sampler with penalties vs
  without, at the demo vocabulary and a 32k one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

NAME = "penalties"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="bytes and executor time per decode step with penalties (no stack)")
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--contexts", default="64,2048")
    p.add_argument("--vocabs", default="320,32000", help="sampler timing vocabularies")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _rows(batch: int, context: int, penalised: bool, history_every_step: bool):
    import random

    from gateway import wire
    from gateway.params import RawParams, Limits, validate
    from gateway.state import Completion, Request, Seq

    rng = random.Random(0)
    limits = Limits(max_model_len=context + 16, vocab_size=32000)
    raw = RawParams(max_tokens=16, temperature=0.8, repetition_penalty=1.2 if penalised else None,
                    presence_penalty=0.5 if penalised else 0.0)
    rows = []
    for i in range(batch):
        tokens = [rng.randrange(32000) for _ in range(context)]
        spec = validate(raw, context - 8, limits)
        req = Request(f"r{i}", tokens[:-8], spec, seed=i)
        seq = Seq(i + 1, req, Completion(0, None), tokens, "executor-0", num_computed=context - 1)
        row = wire.Row(seq, context - 1, tokens[-1:], num_samples=1, seeds=[i])
        if history_every_step:
            row.history = tokens[:-1]
        rows.append(row)
    return rows


def message_bytes(batch: int, context: int) -> dict:
    """Decode ExecuteRequest bytes (an empty plan: the table deltas are the same for all three)."""
    from gateway import wire
    from kvpager.packed import pack_i32, pack_i64
    from kvpager.v1 import common_pb2

    plan = common_pb2.ExecutorPlan(executor_id="executor-0", seq_ids=pack_i64(range(1, batch + 1)),
                                   query_lens=pack_i32([1] * batch))
    out = {}
    for name, penalised, every in (("plain", False, False), ("penalties", True, False),
                                   ("penalties_history_every_step", True, True)):
        req = wire.execute_request(1, 1, plan, _rows(batch, context, penalised, every))
        out[f"{name}_bytes"] = req.ByteSize()
    return out


def _median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def executor_us(batch: int, context: int, vocab: int, repeats: int) -> dict:
    """The executor's per-step extra work for B penalised decoding rows at context C."""
    import numpy as np
    import torch

    from executor_service.history import TokenHistories
    from executor_service.sampler import sample
    from executor_service.step import Sampling, StepInput, build_sampling_inputs
    from executor_service.tables import Resolved

    rng = np.random.default_rng(0)
    seq_ids = np.arange(1, batch + 1, dtype=np.int64)
    ctx = np.full(batch, context - 1, np.int64)

    def step(penalised: bool) -> StepInput:
        s = Sampling(num_samples=np.ones(batch, np.int32), temperature=np.full(batch, 0.8, np.float32),
                     top_p=np.ones(batch, np.float32), top_k=np.zeros(batch, np.int32),
                     seeds=np.arange(batch, dtype=np.int64), num_top_logprobs=np.zeros(batch, np.int32))
        if penalised:
            s.repetition_penalty = np.full(batch, 1.2, np.float32)
            s.presence_penalty = np.full(batch, 0.5, np.float32)
            s.prompt_lens = np.full(batch, context - 8, np.int32)
        return StepInput(1, seq_ids, np.ones(batch, np.int32), rng.integers(0, vocab, batch).astype(np.int32),
                         sampling=s)

    resolved = Resolved(False, 0, {}, np.arange(batch, dtype=np.int64), ctx, np.zeros((batch, 1), np.int32),
                        np.zeros(batch, np.int32))
    histories = TokenHistories()
    histories._tokens = {int(s): rng.integers(0, vocab, context - 1).astype(np.int32) for s in seq_ids}
    pen = step(True)
    staged = histories.resolve(pen, resolved)
    keep_us = _median_us(lambda: histories.resolve(pen, resolved), repeats)
    logits = torch.randn(batch, vocab)
    device = torch.device("cpu")
    plain_inputs = build_sampling_inputs(step(False), resolved, device)
    sample_plain = _median_us(lambda: sample(logits, plain_inputs), repeats)
    sample_pen = _median_us(lambda: sample(logits, build_sampling_inputs(pen, resolved, device, staged.rows)),
                            repeats)
    return {"vocab": vocab, "history_resolve_us": keep_us, "sample_plain_us": sample_plain,
            "sample_penalties_us": sample_pen}


def measure(batches: list[int], contexts: list[int], vocabs: list[int], repeats: int) -> dict:
    rows = []
    for context in contexts:
        for batch in batches:
            row = {"batch": batch, "context": context, **message_bytes(batch, context)}
            if batch == max(batches):
                # a large vocabulary's CPU sampler takes ~1 s a step: fewer repeats
                row["executor"] = [executor_us(batch, context, v, repeats if v <= 4096 else 3) for v in vocabs]
            rows.append(row)
    return {"benchmark": NAME, "rows": rows}


def _main(args: argparse.Namespace) -> int:
    from kvpager_tools.bench.serve import machine

    result = measure([int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")],
                     [int(v) for v in args.vocabs.split(",")], args.repeats)
    result["machine"] = machine()
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    print(json.dumps(result, indent=None if args.json else 2, default=dataclasses.asdict))
    return 0
