"""`kvpager bench compare-vllm --online`: vLLM's OpenAI-compatible server
against `kvpager up`'s, driven by the same client (`kvpager bench serve`'s
load generator, streamed /v1/completions with token-id prompts, greedy,
fixed length), same checkpoint, same prompts, one run.

vLLM serves from its own virtual environment (``vllm_runner.py
--serve-port``: the offline run's environment and engine settings); kvpager
is the full stack with its HTTP API. Both servers stay up side by side; each
gets a warm-up (the whole workload once), then the timed rounds alternate
(vLLM, kvpager, vLLM, ...), each after the machine has gone quiet
(``bc.settle``), all requests of a round sent at once, or (``request_rate``)
arriving as a Poisson process at that rate, the same arrival times for both
engines: a load below saturation, where what a server is judged by is its
latency, not its throughput (both serve what arrives). As offline, round i
of each engine is a pair, so drift of the shared machine moves both sides of
a ratio together. Reported per engine: output tokens per second (medians),
time to first token, time per output token and end-to-end latency (medians
over requests, median over rounds). Then, unless ``single_rounds`` is 0,
the same servers one request at a time (the median-length prompt, rounds
interleaved the same way): the latency a lone user sees on an idle server,
where what a server adds around the forward (its front door, its hops,
its socket settings) shows; under 32 streams it hides in the queue.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvpager_tools.bench import common as bc
from kvpager_tools.bench.compare_vllm import end_process_group
from kvpager_tools.bench.interval import ratio_interval
from kvpager_tools.ports import free_port

RUNNER = Path(__file__).with_name("vllm_runner.py")
NAME = "compare-vllm"
SINGLE_ROUNDS = 10  # rounds of one request at a time after the throughput rounds (--single-rounds)


@contextlib.contextmanager
def vllm_server(python: Path, model: str, dtype: str, *, max_model_len: int, max_num_seqs: int,
                timeout_s: float = 600.0):
    """vLLM's OpenAI server on a free loopback port; yields its base URL."""
    port = free_port()
    cmd = [str(python), str(RUNNER), "--serve-port", str(port), "--model", model, "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    bc.progress(NAME, f"vLLM server: {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {proc.returncode} before it served")
            try:
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's server did not serve within {timeout_s:g} s")
            time.sleep(1.0)
        yield base
    finally:
        end_process_group(proc, grace_s=30)  # its API process's engine core and worker too


# Per-round latency figures: medians and tails over the round's requests (ITL: over its tokens; the
# prefill stall: over running streams' gaps across another request's first token, bc.prefill_stalls).
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms", "ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms",
                "prefill_stall_ms")


def _round(base_url: str, requests: list[bc.BenchRequest], salt: str, sampling: bc.BenchSampling,
           rate: float = math.inf) -> dict:
    import asyncio

    target = bc.Target(backend="openai", base_url=base_url)
    load = os.getloadavg()[0]
    # run_load's fixed seed: every round of either engine gets the same arrival times.
    res = asyncio.run(bc.run_load(target, requests, rate=rate, ignore_eos=True, cache_salt=salt, sampling=sampling))
    m = bc.load_metrics(res)
    if m["failed"]:
        raise RuntimeError(f"{salt}: {m['failed']} requests failed: {m.get('errors')}")
    return {"wall_s": m["duration_s"], "tok_s": m["output_throughput"], "loadavg_1m": load,
            "output_tokens": m["output_tokens"], "ttft_ms": m["ttft_ms"]["median"],
            "tpot_ms": m["tpot_ms"]["median"], "e2e_ms": m["e2e_ms"]["median"],
            "ttft_p99_ms": m["ttft_ms"]["p99"], "tpot_p99_ms": m["tpot_ms"]["p99"], "itl_p99_ms": m["itl_ms"]["p99"],
            "e2e_p99_ms": m["e2e_ms"]["p99"], "prefill_stall_ms": m["prefill_stall_ms"]["median"],
            "peak_concurrency": m["peak_concurrency"],
            "cached_prompt_tokens": m["cached_prompt_tokens"]}


def interleaved_rounds(servers: dict[str, str], requests: list[bc.BenchRequest], repeats: int, *,
                       settle_s: float = 1.0, salt: str = "", sampling: bc.BenchSampling = bc.GREEDY,
                       rate: float = math.inf) -> dict[str, list[dict]]:
    """``servers``: label -> base URL, in the order each round visits them.
    Every server gets the whole workload once as a warm-up, then ``repeats``
    rounds each, alternating, every round after ``bc.settle(settle_s)``
    (a server's OpenMP threads spin on after its round). A fresh cache salt
    per round (prefixed ``salt``: another workload on the same servers
    passes its own) keeps earlier rounds' prefixes out. ``sampling``: every
    request's; ``rate``: Poisson arrivals (inf: all at once). Returns label
    -> rounds (``at_s``: when a round began, seconds after the first timed
    one)."""
    for label, url in servers.items():
        bc.progress(NAME, f"{label}: warm-up")
        _round(url, requests, f"{salt}{label}-warmup", sampling, rate)
    rounds: dict[str, list[dict]] = {label: [] for label in servers}
    t0 = None
    for r in range(repeats):
        for label, url in servers.items():
            waited = bc.settle(settle_s)
            now = time.perf_counter()
            t0 = now if t0 is None else t0
            rounds[label].append({**_round(url, requests, f"{salt}{label}-{r}", sampling, rate),
                                  "settled_s": waited, "at_s": round(now - t0, 3)})
            bc.progress(NAME, f"round {r + 1}/{repeats}: {label} {rounds[label][-1]['tok_s']:.1f} tok/s")
    return rounds


def _summary(rounds: list[dict], keys=("tok_s", *LATENCY_KEYS)) -> dict:
    """Medians over rounds of each figure every round has."""
    return {k: round(statistics.median(r[k] for r in rounds), 2) for k in keys
            if all(r.get(k) is not None for r in rounds)}


def single_stream(servers: dict[str, str], prompts: list[list[int]], max_new_tokens: int, rounds: int, *,
                  settle_s: float = 1.0, sampling: bc.BenchSampling = bc.GREEDY) -> dict:
    """One request at a time on each server (the median-length prompt),
    ``rounds`` interleaved rounds: per label its medians over rounds, and
    kvpager's time to first token over vLLM's when both labels are there."""
    prompt = sorted(prompts, key=len)[len(prompts) // 2]
    bc.progress(NAME, f"one request at a time: {len(prompt)}-token prompt, {rounds} rounds")
    # Its own salts: the prompt is one of the throughput rounds', whose cached
    # blocks would otherwise make its prefill a prefix hit (vLLM runs without a cache).
    got = interleaved_rounds(servers, [bc.BenchRequest(prompt_ids=prompt, max_tokens=max_new_tokens)], rounds,
                             settle_s=settle_s, salt="single-", sampling=sampling)
    out: dict = {"prompt_len": len(prompt), "rounds": rounds}
    for label, rs in got.items():
        out[label] = {**_summary(rs, ("ttft_ms", "tpot_ms", "e2e_ms")),
                      "cached_prompt_tokens": sum(r["cached_prompt_tokens"] for r in rs)}
    if "kvpager" in out and "vllm" in out and out["vllm"].get("ttft_ms"):
        out["ttft_ratio_vs_vllm"] = round(out["kvpager"]["ttft_ms"] / out["vllm"]["ttft_ms"], 3)
    return out


def compare_online(model: str, dtype: str, prompts: list[list[int]], max_new_tokens: int, *, repeats: int,
                   vllm_python: Path, vllm_timeout_s: float = 1800.0, max_batch_tokens: int = 0,
                   max_running: int = 0, num_scheduler_steps: int = 0, settle_s: float = 1.0,
                   single_rounds: int = SINGLE_ROUNDS, block_size: int = 16,
                   sampling: bc.BenchSampling = bc.GREEDY, rate: float = math.inf) -> dict:
    requests = [bc.BenchRequest(prompt_ids=p, max_tokens=max_new_tokens) for p in prompts]
    total = len(prompts) * max_new_tokens
    max_len = max(512, max(len(p) for p in prompts) + max_new_tokens + 1)
    need_blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    opts = bc.StackOptions(model=model, dtype=dtype, num_blocks=max(256, need_blocks + 64), block_size=block_size,
                           max_batch_tokens=max_batch_tokens, max_running=max_running,
                           num_scheduler_steps=num_scheduler_steps)
    with vllm_server(vllm_python, model, dtype, max_model_len=max_len, max_num_seqs=max(32, len(prompts)),
                     timeout_s=vllm_timeout_s) as base:
        bc.progress(NAME, f"kvpager: starting the stack with its HTTP API ({dtype})")
        with bc.embedded_stack(opts) as stack:
            servers = {"vllm": base, "kvpager": stack.addresses.http}
            rounds = interleaved_rounds(servers, requests, repeats, settle_s=settle_s, sampling=sampling,
                                        rate=rate)
            single = (single_stream(servers, prompts, max_new_tokens, single_rounds, settle_s=settle_s,
                                    sampling=sampling) if single_rounds else None)
    vllm_rounds, kv_rounds = rounds["vllm"], rounds["kvpager"]
    for label, rs in rounds.items():
        short = [r["output_tokens"] for r in rs if r["output_tokens"] != total]
        if short:
            raise RuntimeError(f"{label}: generated {short} tokens in some rounds, expected {total}")
    kv, vl = _summary(kv_rounds), _summary(vllm_rounds)
    paired = [round(k["tok_s"] / v["tok_s"], 3) for k, v in zip(kv_rounds, vllm_rounds)]
    return {
        "benchmark": NAME, "variant": "online", "model": model, "dtype": dtype, "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens, "input_len_mean": round(statistics.fmean(len(p) for p in prompts), 1),
        "repeats": repeats, "request_rate": "inf" if math.isinf(rate) else rate,
        "kvpager_tok_s": kv["tok_s"], "vllm_tok_s": vl["tok_s"],
        "ratio_vs_vllm": round(kv["tok_s"] / vl["tok_s"], 3),
        # Each kvpager round over the vLLM round just before it: drift of the machine cancels.
        "paired_ratios": paired, "paired_ratio_median": statistics.median(paired),
        "ratio_interval": ratio_interval([r["tok_s"] for r in kv_rounds], [r["tok_s"] for r in vllm_rounds],
                                         paired=True),
        "latency_ms": {"kvpager": {k: v for k, v in kv.items() if k != "tok_s"},
                       "vllm": {k: v for k, v in vl.items() if k != "tok_s"}},
        # kvpager's over vLLM's (below 1: kvpager lower); at a rate below saturation these, not
        # the throughput ratio, are the comparison.
        "latency_ratios_vs_vllm": {k: round(kv[k] / vl[k], 3) for k in LATENCY_KEYS
                                   if kv.get(k) is not None and vl.get(k)},
        "rounds": {"order": "interleaved: vLLM then kvpager, per round; both servers up throughout",
                   "kvpager": kv_rounds, "vllm": vllm_rounds},
        # One request at a time: medians over rounds (None with --single-rounds 0).
        "single_stream": single,
        "sampling": {**sampling.as_dict(), "ignore_eos": True},
        "settings": {"client": "kvpager bench serve's load generator: streamed /v1/completions, token-id prompts, "
                               "ignore_eos, " + ("every request at once" if math.isinf(rate) else
                                                 f"Poisson arrivals at {rate:g}/s (the same times for both)"),
                     "kvpager": {"stack": "kvpager up defaults, HTTP API", "num_blocks": opts.num_blocks,
                                 "block_size": block_size,
                                 "max_batch_tokens": max_batch_tokens or "default",
                                 "max_running": max_running or "default",
                                 "num_scheduler_steps": num_scheduler_steps or "default"},
                     "vllm": {"server": "vllm.entrypoints.openai.api_server (vllm_runner.py --serve-port)",
                              "max_model_len": max_len, "max_num_seqs": max(32, len(prompts)),
                              "prefix_caching": False, "skip_tokenizer_init": True}},
    }
