"""`kvpager bench serve`: a serving benchmark in the style of vLLM's
`benchmark_serving`, against a running gateway (`--address`), any
OpenAI-compatible server (`--base-url`: ours or another engine's) or an
embedded stack it starts itself (memory service + executors + gateway as
processes).

Streams every request (greedy) over one or more backends (`--backend grpc`,
`openai`: /v1/completions with the same token ids, `openai-chat`) and reports
request / token throughput, TTFT, TPOT, ITL and E2E latency (mean, median,
p90, p99), goodput under SLOs, peak concurrency, and — from the memory
service's accounting, when it is ours — the prefix hit rate, preemptions and
KV usage over time. Several backends run in the same stack, alternating
(`--repeat` rounds), and `comparison` gives each one's throughput as a ratio
to gRPC's (medians). A rich table with a progress bar while running; `--json`
prints one JSON object; `--plot DIR` writes PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import statistics
import sys
import time
from pathlib import Path

from kvpager_tools.bench import common as bc

NAME = "serve"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="serving benchmark: throughput, TTFT/TPOT/ITL/E2E, goodput, KV usage")
    where = p.add_argument_group("target")
    where.add_argument("--address", default=None, help="a running gateway host:port (default: start a stack)")
    where.add_argument("--backend", default="grpc",
                       help="grpc | openai | openai-chat, or a comma list run in turn on the same target")
    where.add_argument("--base-url", default=None,
                       help="an OpenAI-compatible server, http://host:port (with or without /v1): the openai "
                            "backends' target (default: the embedded stack's, or --address's gateway's)")
    where.add_argument("--model-name", default=None, help="the requests' model (default: the first /v1/models lists)")
    where.add_argument("--api-key", default=None, help="bearer token for --base-url")
    where.add_argument("--repeat", type=int, default=1, help="rounds of every backend, alternating (medians)")
    where.add_argument("--memory-address", default=None,
                       help="its memory service, for hit rate / preemptions / KV usage (with --address)")
    where.add_argument("--model", default=None, help="checkpoint dir, 'demo' (default) or 'llama-30m'")
    where.add_argument("--executors", type=int, default=1)
    where.add_argument("--num-blocks", type=int, default=None, help="KV blocks per executor")
    where.add_argument("--max-batch-tokens", type=int, default=None)
    where.add_argument("--max-running", type=int, default=None)
    data = p.add_argument_group("workload")
    data.add_argument("--dataset", choices=bc.DATASETS, default="random")
    data.add_argument("--num-prompts", type=int, default=200)
    data.add_argument("--input-len", type=int, default=128, help="random / shared-system-prompt user turn")
    data.add_argument("--output-len", type=int, default=64)
    data.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len x [1-r, 1+r]")
    data.add_argument("--num-prefixes", type=int, default=8, help="prefix-repetition: distinct prefixes")
    data.add_argument("--prefix-len", type=int, default=256, help="prefix / system prompt tokens")
    data.add_argument("--suffix-len", type=int, default=32, help="prefix-repetition: suffix tokens")
    data.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", default="inf",
                      help="requests/s of Poisson arrivals, 'inf' = all at once; a comma list runs each")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    load.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                      help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:5000")
    load.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    load.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus filtering (1: off)")
    load.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k filtering (0: off)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object (no table)")
    out.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts here (needs matplotlib)")
    p.set_defaults(func=_main)


def parse_rates(text: str) -> list[float]:
    return [math.inf if r.strip().lower() in ("inf", "") else float(r) for r in text.split(",")]


# ---- one run -------------------------------------------------------------------------


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a local process (/proc), None when unknown."""
    if pid is None:
        return None
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run_one(target, memory: str | None, requests, rate: float, args, salt: str, progress,
                   gateway_pid: int | None = None) -> dict:
    target = bc.Target.of(target)
    before = await bc.accounting(memory) if memory else None
    watch = bc.AccountingWatch(memory, interval_ms=100) if memory else None
    if watch is not None:
        watch.start()
    t0 = time.time()
    cpu0 = time.process_time()
    gateway_cpu0 = process_cpu_s(gateway_pid)
    res = await bc.run_load(target, requests, rate=rate, max_concurrency=args.max_concurrency,
                            ignore_eos=args.ignore_eos, seed=args.seed, cache_salt=salt, on_done=progress,
                            sampling=args.sampling)
    client_cpu_s = time.process_time() - cpu0
    gateway_cpu1 = process_cpu_s(gateway_pid)
    if watch is not None:
        await watch.stop()
    result = {"backend": target.backend, "request_rate": "inf" if math.isinf(rate) else rate,
              **bc.load_metrics(res, bc.parse_slo(args.goodput))}
    # the load generator's own CPU (this process), taken from the server on a shared machine
    result["client_cpu_us_per_token"] = (round(client_cpu_s / result["output_tokens"] * 1e6, 1)
                                         if result["output_tokens"] else None)
    if gateway_cpu0 is not None and gateway_cpu1 is not None and result["output_tokens"]:
        # the gateway process (engine loop + its front door), embedded stacks only: what the API costs the server
        result["gateway_cpu_us_per_token"] = round((gateway_cpu1 - gateway_cpu0) / result["output_tokens"] * 1e6, 1)
    if memory:
        after = await bc.accounting(memory)
        result["memory"] = bc.accounting_delta(before, after)
        result["kv_usage"] = {"samples": [(round(t - t0, 3), round(u, 4), round(k, 4))
                                          for t, u, k in watch.samples if t >= t0 - 0.2],
                              "peak_used_fraction": round(max((u for _, u, _ in watch.samples), default=0.0), 4),
                              "total_blocks": after["total_blocks"]}
    result["_records"] = res.records
    return result


def run_serve(target, memory: str | None, requests, rates: list[float], args, console=None,
              salt: str = "serve", gateway_pid: int | None = None) -> list[dict]:
    """Each rate in turn (a fresh cache salt per run: no run reuses an earlier run's prefixes;
    ``salt`` is the caller's, unique to its invocation)."""
    gateway = target
    runs = []
    for i, rate in enumerate(rates):
        label = ("inf" if math.isinf(rate) else f"{rate:g}/s") + f" {bc.Target.of(target).backend}"
        if console is not None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn(f"[bold]rate {label}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console, transient=True) as bar:
                task = bar.add_task("requests", total=len(requests))
                runs.append(asyncio.run(_run_one(gateway, memory, requests, rate, args, f"{salt}-{i}",
                                                 lambda _rec: bar.advance(task), gateway_pid)))
        else:
            runs.append(asyncio.run(_run_one(gateway, memory, requests, rate, args, f"{salt}-{i}", None,
                                             gateway_pid)))
    return runs


def comparison(runs: list[dict]) -> list[dict]:
    """Per rate: each backend's median output and request throughput, and its
    ratio to gRPC's (goal for HTTP: grpc / openai <= 1.10)."""
    out = []
    for rate in dict.fromkeys(r["request_rate"] for r in runs):
        by = {}
        for r in runs:
            if r["request_rate"] == rate and r["output_throughput"] is not None:
                by.setdefault(r["backend"], []).append(r)
        row = {"request_rate": rate}
        for backend, rs in by.items():
            cpu = [r["gateway_cpu_us_per_token"] for r in rs if r.get("gateway_cpu_us_per_token") is not None]
            row[backend] = {"output_throughput": statistics.median(r["output_throughput"] for r in rs),
                            "gateway_cpu_us_per_token": statistics.median(cpu) if cpu else None,
                            "request_throughput": statistics.median(r["request_throughput"] for r in rs),
                            "ttft_median_ms": statistics.median(r["ttft_ms"]["median"] or 0 for r in rs),
                            "runs": len(rs)}
        if "grpc" in by:
            grpc_by_round = {r.get("round"): r["output_throughput"] for r in by["grpc"]}
            for backend, rs in by.items():
                if backend == "grpc" or not row[backend]["output_throughput"]:
                    continue
                row[f"grpc_over_{backend}_throughput"] = round(
                    row["grpc"]["output_throughput"] / row[backend]["output_throughput"], 3)
                # each round's two runs are adjacent in time: their ratio cancels slow drift in the machine's load
                paired = sorted(grpc_by_round[r["round"]] / r["output_throughput"] for r in rs
                                if r.get("round") in grpc_by_round and r["output_throughput"])
                if paired:
                    row[f"grpc_over_{backend}_paired"] = {"median": round(statistics.median(paired), 3),
                                                          "min": round(paired[0], 3), "max": round(paired[-1], 3)}
        out.append(row)
    return out


# ---- rendering -------------------------------------------------------------------------


def render(runs: list[dict], config: dict):
    from rich.table import Table

    table = Table(title=f"kvpager bench serve — {config['dataset']}, {config['num_prompts']} prompts")
    table.add_column("metric")
    for r in runs:
        table.add_column(f"rate {r['request_rate']} {r.get('backend', 'grpc')}", justify="right")

    def row(name: str, get) -> None:
        table.add_row(name, *[_fmt(get(r)) for r in runs])

    row("completed / failed", lambda r: f"{r['completed']} / {r['failed']}")
    row("duration (s)", lambda r: r["duration_s"])
    row("request throughput (req/s)", lambda r: r["request_throughput"])
    row("output throughput (tok/s)", lambda r: r["output_throughput"])
    row("total throughput (tok/s)", lambda r: r["total_token_throughput"])
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"),
                       ("prefill_stall_ms", "prefill stall")):
        for stat in ("mean", "median", "p99"):
            row(f"{label} {stat} (ms)", lambda r, k=key, s=stat: r[k][s])
    if any("goodput" in r for r in runs):
        row("goodput (req/s)", lambda r: r.get("goodput", {}).get("request_goodput"))
        row("requests within SLO", lambda r: r.get("goodput", {}).get("fraction"))
    row("peak concurrency", lambda r: r["peak_concurrency"])
    if any("memory" in r for r in runs):
        row("prefix hit rate", lambda r: r.get("memory", {}).get("prefix_hit_rate"))
        row("preemptions", lambda r: r.get("memory", {}).get("preemptions"))
        row("peak KV blocks used (sampled)", lambda r: _peak(r.get("kv_usage", {})))
    return table


def _peak(kv: dict) -> str | None:
    """'12.5% of 1024' — the highest WatchAccounting sample (every 100 ms: a
    run shorter than that may show none)."""
    if not kv.get("samples"):
        return None
    return f"{100 * kv['peak_used_fraction']:.1f}% of {kv['total_blocks']}"


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def plot(runs: list[dict], out_dir: str) -> list[str]:
    """Latency CDFs, throughput vs rate (several rates), KV usage over time.
    Returns the files written ([] when matplotlib is missing)."""
    plt = bc.pyplot()
    if plt is None:
        bc.progress(NAME, "matplotlib is not installed: no plots (pip install 'kvpager[plot]')")
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(10, 3), dpi=80)
    for r in runs:
        recs = [x for x in r["_records"] if x.ok]
        for ax, (name, vals) in zip(axes, (("TTFT", [x.ttft_s for x in recs]),
                                           ("TPOT", [x.tpot_s for x in recs if x.tpot_s is not None]),
                                           ("E2E", [x.e2e_s for x in recs]))):
            xs = sorted(v * 1e3 for v in vals if v is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"rate {r['request_rate']}")
            ax.set_xlabel(f"{name} (ms)")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].set_xscale("log")  # queueing at rate inf stretches TTFT over orders of magnitude
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    written.append(str(out / "serve_latency_cdf.png"))
    fig.savefig(written[-1])
    plt.close(fig)
    finite = [r for r in runs if r["request_rate"] != "inf"]
    if len(finite) > 1:
        fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
        ax.plot([r["request_rate"] for r in finite], [r["output_throughput"] for r in finite], "o-",
                label="output tok/s")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        ax2.plot([r["request_rate"] for r in finite], [r["ttft_ms"]["median"] for r in finite], "s--", color="C1",
                 label="median TTFT")
        ax2.set_ylabel("median TTFT (ms)")
        ax2.set_ylim(bottom=0)
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="lower right", fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(str(out / "serve_throughput_vs_rate.png"))
        fig.savefig(written[-1])
        plt.close(fig)
    if any(r.get("kv_usage", {}).get("samples") for r in runs):
        fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
        for r in runs:
            s = r.get("kv_usage", {}).get("samples") or []
            ax.plot([t for t, _, _ in s], [u for _, u, _ in s], label=f"rate {r['request_rate']}")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("KV blocks in use (fraction)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(str(out / "serve_kv_usage.png"))
        fig.savefig(written[-1])
        plt.close(fig)
    return written


# ---- entry point ---------------------------------------------------------------------------


def _token_range_for(args, gateway: str) -> tuple[int, int]:
    if args.model is not None or args.address is None:
        return bc.token_range(bc.model_dir(args.model))

    async def vocab() -> int:
        from kvpager.channel import make_channel
        from kvpager.v1 import gateway_pb2, gateway_pb2_grpc

        async with make_channel(gateway) as ch:
            info = await gateway_pb2_grpc.GatewayStub(ch).GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
        return info.vocab_size

    return 16, asyncio.run(vocab())


def _targets(args, gateway: str | None, base_url: str | None) -> list:
    targets = []
    tokenizer = None
    for backend in args.backend.split(","):
        backend = backend.strip()
        if backend == "grpc":
            if not gateway:
                raise ValueError("--backend grpc needs a gateway (--address, or no --base-url: an embedded stack)")
            targets.append(bc.Target(address=gateway))
            continue
        if backend not in ("openai", "openai-chat"):
            raise ValueError(f"--backend: grpc, openai or openai-chat, got {backend!r}")
        if not base_url:
            raise ValueError(f"--backend {backend} needs --base-url (or an embedded stack)")
        if backend == "openai-chat" and tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(bc.model_dir(args.model)), local_files_only=True)
        targets.append(bc.Target(backend=backend, base_url=base_url, model=args.model_name or "",
                                 api_key=args.api_key, tokenizer=tokenizer))
    return targets


def serve(args: argparse.Namespace, console=None) -> dict:
    rates = parse_rates(args.request_rate)
    for name, default in (("backend", "grpc"), ("base_url", None), ("model_name", None), ("api_key", None),
                          ("repeat", 1), ("temperature", 0.0), ("top_p", 1.0), ("top_k", 0)):
        if not hasattr(args, name):  # callers that build the namespace themselves
            setattr(args, name, default)
    try:
        args.sampling = bc.BenchSampling(args.temperature, args.top_p, args.top_k)
    except ValueError as exc:
        raise SystemExit(f"--temperature / --top-p / --top-k: {exc}") from None
    config = {k: v for k, v in vars(args).items() if k not in ("func", "bench", "command", "api_key", "sampling")}

    def body(gateway: str | None, memory: str | None, base_url: str | None, gateway_pid: int | None = None) -> dict:
        targets = _targets(args, gateway, base_url)
        if gateway:
            lo, hi = _token_range_for(args, gateway)
        else:
            lo, hi = bc.token_range(bc.model_dir(args.model))  # another engine: the checkpoint it serves
        requests = bc.make_dataset(args.dataset, args.num_prompts, token_lo=lo, token_hi=hi, seed=args.seed,
                                   input_len=args.input_len, output_len=args.output_len,
                                   range_ratio=args.range_ratio, num_prefixes=args.num_prefixes,
                                   prefix_len=args.prefix_len, suffix_len=args.suffix_len)
        # Salts of this invocation alone: another run against the same server (--address, --base-url)
        # sends the same prompts for the same --seed, and must not find them cached.
        run_id = secrets.token_hex(4)
        for t in targets:  # warm-up: a few requests per backend, their own cache salt
            asyncio.run(bc.run_load(t, requests[:4], ignore_eos=True, cache_salt=f"serve-{run_id}-warmup-{t.backend}"))
        runs = []
        for r in range(max(1, args.repeat)):
            for t in targets:  # alternating, so drift in the machine's load hits every backend alike
                for run in run_serve(t, memory, requests, rates, args, console,
                                     salt=f"serve-{run_id}-{r}-{t.backend}", gateway_pid=gateway_pid):
                    runs.append({"round": r, **run})
        out = {"best_prefix_hit_rate": round(bc.best_hit_rate(requests, 16), 5), "runs": runs}
        if len(targets) > 1 or args.repeat > 1:
            out["comparison"] = comparison(runs)
        return out

    if args.address or args.base_url:
        result = body(args.address, args.memory_address, args.base_url)
    else:
        model = str(bc.model_dir(args.model))
        config["model"] = model
        opts = bc.StackOptions(model=model, executors=args.executors, num_blocks=args.num_blocks or 0,
                               max_batch_tokens=args.max_batch_tokens or 0, max_running=args.max_running or 0)
        if console is not None:
            console.print(f"starting the stack: {args.executors} executor(s), {model}", style="dim")
        with bc.embedded_stack(opts) as stack:
            result = body(stack.addresses.gateway, stack.addresses.memory, stack.addresses.http,
                          stack.pid("gateway"))
    return {"benchmark": NAME, "machine": machine(), "config": config, **result}


def machine() -> dict:
    import os
    import platform

    try:
        with open("/proc/loadavg") as f:
            loadavg = f.read().split()[:3]
    except OSError:
        loadavg = None
    return {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "loadavg": loadavg}


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    result = serve(args, Console(stderr=True))  # progress on stderr; stdout stays one JSON object / the table
    if args.plot:
        result["plots"] = plot(result["runs"], args.plot)
    for r in result["runs"]:
        r.pop("_records", None)
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    if args.json:
        print(json.dumps(result))
    else:
        Console().print(render(result["runs"], result["config"]))
        for row in result.get("comparison", []):
            ratios = {k: v for k, v in row.items() if k.startswith("grpc_over_")}
            if ratios:
                print(f"rate {row['request_rate']}: " + ", ".join(f"{k} = {v}" for k, v in ratios.items()))
        if result.get("plots"):
            print("plots: " + ", ".join(result["plots"]))
    return 0
