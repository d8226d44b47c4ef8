"""`kvpager bench compare-hf --json`: the full kvpager stack against
transformers on the same checkpoint, the same prompts and the same greedy,
fixed-length outputs, in one run.

Peers (all fp32, torch's default threads, in this process):

* hf_sequential: ``model.generate`` one prompt at a time — also the parity
  oracle: kvpager's completions must be token-identical to it;
* hf_static_batch: ``model.generate`` on padded batches (left padding,
  attention mask) of ``--hf-batch-size`` prompts;
* hf_generate_batch: transformers' own continuous batching
  (``model.generate_batch`` with a paged cache: page 16, bounded blocks and
  batch tokens).

kvpager: memory service + executor + gateway as three processes talking
gRPC (kvpager_tools.stack), every prompt submitted at once, ``ignore_eos``. Token
throughput = generated tokens / wall time from the first request sent to the
last token received. EOS is disabled on the transformers side the same way
(``eos_token_id=None``), so every output has exactly ``--max-new-tokens``.

Default workload: the ~30M-parameter random Llama (hidden 512, 8 layers,
8 heads / 2 KV heads, vocab 8192), 32 prompts of 16-256 tokens, 64 new tokens.
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
from kvpager_tools.bench.common import (GREEDY, BenchSampling, StackOptions, embedded_stack, model_dir, progress,
                                        run_load, token_range)

NAME = "compare-hf"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="kvpager stack vs transformers generate / static batch / generate_batch")
    p.add_argument("--model", default="llama-30m", help="checkpoint dir, 'llama-30m' (default) or 'demo'")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed rounds of every peer; medians are reported")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="gateway per-step token budget")
    p.add_argument("--max-running", type=int, default=None,
                   help="gateway sequences per step (default: the number of prompts, 64..256)")
    p.add_argument("--num-blocks", type=int, default=None, help="executor KV pool blocks (default: sized to fit)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static-batch generate: prompts per batch")
    p.add_argument("--hf-max-batch-tokens", type=int, default=256, help="generate_batch: tokens per step")
    p.add_argument("--hf-threads", type=int, default=None, help="torch threads of the transformers peers "
                   "(default: torch's, one per core)")
    p.add_argument("--parity-sample", type=int, default=32,
                   help="sequential generate (and the parity check) on the first N prompts only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def make_prompts(model: str, num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    import random

    t_lo, t_hi = token_range(model)
    rng = random.Random(seed)
    return [[rng.randrange(t_lo, t_hi) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


# ---- transformers -----------------------------------------------------------------


def load_hf(model: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32).eval()


def _gen_config(hf, max_new_tokens: int, **kw):
    from transformers import GenerationConfig

    # eos_token_id=None: never stop early, as kvpager's ignore_eos (an EOS is kept and generation goes on).
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, eos_token_id=None,
                            pad_token_id=hf.generation_config.pad_token_id, **kw)


def hf_sequential(hf, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    import torch

    cfg = _gen_config(hf, max_new_tokens)
    outs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            outs.append(out[0, len(p):].tolist())
    return time.perf_counter() - t0, outs


def hf_static_batch(hf, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> tuple[float, list]:
    import torch

    cfg = _gen_config(hf, max_new_tokens)
    pad = hf.generation_config.pad_token_id
    outs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = hf.generate(ids, attention_mask=mask, generation_config=cfg)
            outs.extend(out[:, width:].tolist())
    return time.perf_counter() - t0, outs


def hf_generate_batch(hf, prompts: list[list[int]], max_new_tokens: int, max_batch_tokens: int,
                      num_blocks: int) -> tuple[float, list]:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = _gen_config(hf, max_new_tokens)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    t0 = time.perf_counter()
    res = hf.generate_batch(inputs=prompts, generation_config=cfg, continuous_batching_config=cb, warmup=False)
    dt = time.perf_counter() - t0
    outs = [list(r.generated_tokens) for r in res.values()]  # in input order
    return dt, outs


# ---- kvpager ------------------------------------------------------------------------


def kvpager_run(gateway: str, prompts: list[list[int]], max_new_tokens: int, salt: str,
                stream_interval: int = 0, sampling: BenchSampling = GREEDY) -> tuple[float, list]:
    """All prompts at once; a fresh cache salt per run, so no run is served
    from the prefix cache an earlier one filled (transformers has none).
    ``stream_interval``: the requests' (0 = the gateway's default);
    ``sampling``: every request's (greedy by default)."""
    from kvpager_tools.bench.common import BenchRequest

    reqs = [BenchRequest(p, max_new_tokens) for p in prompts]
    res = asyncio.run(run_load(gateway, reqs, ignore_eos=True, cache_salt=salt, stream_interval=stream_interval,
                               sampling=sampling))
    failed = [r.error for r in res.records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} kvpager requests failed: {failed[0]}")
    cached = sum(r.cached_tokens for r in res.records)
    if cached:
        raise RuntimeError(f"kvpager run was served {cached} prompt tokens from the prefix cache")
    return res.duration_s, [r.token_ids for r in res.records]


def compare(model: str, prompts: list[list[int]], max_new_tokens: int, *, repeats: int = 1, seed: int = 0,
            max_batch_tokens: int | None = None, max_running: int | None = None, num_blocks: int | None = None,
            hf_batch_size: int = 64, hf_max_batch_tokens: int = 256, parity_sample: int = 32,
            peers: tuple[str, ...] = ("sequential", "static_batch", "generate_batch"), stack=None,
            hf_threads: int | None = None) -> dict:
    """One comparison; returns the JSON-ready result. ``stack``: a running
    kvpager_tools.stack.Stack to use instead of starting one."""
    import torch

    n = len(prompts)
    total_new = n * max_new_tokens
    bs = 16
    need_blocks = sum(-(-(len(p) + max_new_tokens) // bs) for p in prompts)
    if num_blocks is None:
        num_blocks = max(256, need_blocks + 64)  # room for every sequence: no preemption in the comparison
    if max_running is None:
        max_running = max(64, min(n, 256))  # every prompt in the running batch, as generate_batch does
    if hf_threads:
        torch.set_num_threads(hf_threads)
    hf = load_hf(model)
    times: dict[str, list[float]] = {k: [] for k in ("kvpager", *peers)}
    kv_outs: list[list[int]] = []
    seq_outs: list[list[int]] = []
    opts = StackOptions(model=model, num_blocks=num_blocks, block_size=bs, max_batch_tokens=max_batch_tokens or 0,
                        max_running=max_running, metrics=True)
    breakdowns: list[dict] = []
    progress(NAME, f"{n} prompts x {max_new_tokens} tokens; starting the stack")
    with (embedded_stack(opts) if stack is None else contextlib.nullcontext(stack)) as stack:
        gw = stack.addresses.gateway
        # warm-up at full size (first forwards of each shape, allocator, connections)
        kvpager_run(gw, prompts, 2, "warmup")
        if "static_batch" in peers:
            hf_static_batch(hf, prompts, 2, hf_batch_size)
        if "generate_batch" in peers:
            hf_generate_batch(hf, prompts, 2, hf_max_batch_tokens, need_blocks + 64)
        for r in range(repeats):
            progress(NAME, f"round {r + 1}/{repeats}: kvpager")
            ports = {k: stack.addresses.metrics[k] for k in ("gateway", "executor-0", "memory")
                     if k in stack.addresses.metrics}
            before = bc.scrape_all(ports) if len(ports) == 3 else None
            dt, kv_outs = kvpager_run(gw, prompts, max_new_tokens, f"round-{r}")
            times["kvpager"].append(dt)
            if before is not None:
                t = bc.step_totals(before, bc.scrape_all(ports))
                breakdowns.append({"wall": dt, **t, "between_steps": dt - t["step_total"]})
            if "static_batch" in peers:
                progress(NAME, f"round {r + 1}/{repeats}: transformers static batch")
                times["static_batch"].append(hf_static_batch(hf, prompts, max_new_tokens, hf_batch_size)[0])
            if "generate_batch" in peers:
                progress(NAME, f"round {r + 1}/{repeats}: transformers generate_batch")
                dt, gb_outs = hf_generate_batch(hf, prompts, max_new_tokens, hf_max_batch_tokens, need_blocks + 64)
                times["generate_batch"].append(dt)
    k = min(parity_sample, n)
    if "sequential" in peers and k:
        progress(NAME, f"transformers sequential generate on {k} prompts (parity oracle)")
        dt, seq_outs = hf_sequential(hf, prompts[:k], max_new_tokens)
        times["sequential"].append(dt * n / k)  # as tokens/s: dt covers k prompts
    tok_s = {name: round(total_new / statistics.median(ts), 2) for name, ts in times.items() if ts}

    def ratio(peer: str) -> float | None:
        """Median over rounds of (peer time / kvpager time in the same round)."""
        ts = times.get(peer) or []
        if not ts:
            return None
        if len(ts) == 1:
            return round(statistics.median(ts) / statistics.median(times["kvpager"]), 3)
        return round(statistics.median(p / k for p, k in zip(ts, times["kvpager"])), 3)
    matched = sum(1 for a, b in zip(kv_outs, seq_outs) if a == b)
    result = {
        "model": str(model), "num_params_m": round(sum(p.numel() for p in hf.parameters()) / 1e6, 2),
        "num_prompts": n, "max_new_tokens": max_new_tokens,
        "input_len_mean": round(statistics.fmean(len(p) for p in prompts), 1),
        "repeats": repeats, "hf_torch_threads": torch.get_num_threads(),
        "kvpager_tok_s": tok_s["kvpager"],
        "hf_sequential_tok_s": tok_s.get("sequential"),
        "hf_static_batch_tok_s": tok_s.get("static_batch"),
        "hf_generate_batch_tok_s": tok_s.get("generate_batch"),
        "ratio_vs_generate_batch": ratio("generate_batch"),
        "ratio_vs_static_batch": ratio("static_batch"),
        "ratio_vs_sequential": ratio("sequential"),
        "parity": {"matched": matched, "total": len(seq_outs)},
        "times_s": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
        "config": {"num_blocks": num_blocks, "block_size": bs, "max_batch_tokens": max_batch_tokens,
                   "max_running": max_running, "hf_batch_size": hf_batch_size,
                   "hf_max_batch_tokens": hf_max_batch_tokens, "hf_num_blocks": need_blocks + 64},
    }
    if breakdowns:  # where the kvpager run's time went (median over rounds, seconds)
        result["kvpager_time_s"] = {k: round(statistics.median(b[k] for b in breakdowns), 3)
                                    for k in breakdowns[0] if k != "steps"}
        result["kvpager_time_s"]["steps"] = int(statistics.median(b["steps"] for b in breakdowns))
    if "generate_batch" in peers and times["generate_batch"]:
        result["generate_batch_matches_sequential"] = sum(1 for a, b in zip(gb_outs, seq_outs) if a == b)
    return result


def _main(args: argparse.Namespace) -> int:
    model = str(model_dir(args.model))
    prompts = make_prompts(model, args.num_prompts, args.min_input_len, args.max_input_len, args.seed)
    result = compare(model, prompts, args.max_new_tokens, repeats=args.repeats, seed=args.seed,
                     max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                     num_blocks=args.num_blocks, hf_batch_size=args.hf_batch_size,
                     hf_max_batch_tokens=args.hf_max_batch_tokens, parity_sample=args.parity_sample,
                     hf_threads=args.hf_threads)
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
