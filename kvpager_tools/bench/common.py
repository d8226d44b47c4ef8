"""Shared pieces of the gateway benchmarks (`kvpager bench serve | compare-hf
| overhead | routing`): synthetic datasets, the embedded stack, a streaming
load generator with per-token timestamps, latency statistics.

Light at import: grpc, torch and transformers load inside the functions.
Every benchmark prints one JSON object; ratios are always against a peer
measured in the same run.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpager_tools.generate import stream_generate
from kvpager_tools.stack import StackOptions
from kvpager_tools.stats import percentile

# ShareGPT-like lengths (memory_service/bench.py TRACES): lognormal, input mean
# 161 / sigma 1.0, output mean 338 / sigma 0.9.
SHAREGPT = (161, 1.0, 338, 0.9)
DATASETS = ("random", "sharegpt-like", "prefix-repetition", "shared-system-prompt")
# How long a load run waits for its gRPC channel to connect before sending.
CONNECT_WAIT_S = 5.0

# The ~30M-parameter random Llama the CPU comparisons use (as `kvpager bench executor`).
LLAMA_30M = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, model_vocab_size=8192)
# A random Llama shaped like Qwen2.5-0.5B (compute-bound on CPU): head_dim 64.
LLAMA_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                 model_vocab_size=32000)
# The 30M Llama with 8,192 positions: prompts past one 2,048-token step
# (`compare-vllm --model llama-30m-8k --min-input-len 3000 --max-input-len 6000`).
LLAMA_30M_8K = dict(LLAMA_30M, max_position_embeddings=8192)
# ... and with 32,768: prompts whose chunks attend 16k-32k keys
# (`compare-vllm --model llama-30m-32k --min-input-len 16000 --max-input-len 24000`).
LLAMA_30M_32K = dict(LLAMA_30M, max_position_embeddings=32768)
BENCH_MODELS = {"llama-30m": LLAMA_30M, "llama-0.5b": LLAMA_05B, "llama-30m-8k": LLAMA_30M_8K,
                "llama-30m-32k": LLAMA_30M_32K}


def progress(name: str, msg: str) -> None:
    print(f"[bench {name}] {msg}", file=sys.stderr, flush=True)


def _cpu_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine so far (all CPUs, /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def settle(min_s: float, max_s: float = 10.0, busy_frac: float = 0.1, window_s: float = 0.25) -> float:
    """Sleep ``min_s``, then until the machine is quiet: the CPUs busy less
    than ``busy_frac`` of one core over a ``window_s`` window (at most
    ``max_s`` in all). Between two engines' timed rounds: an engine's OpenMP
    threads spin on after its work (vLLM's CPU worker for about a second),
    and the other engine's round must not start on cores still taken.
    Returns the seconds waited."""
    t0 = time.perf_counter()
    time.sleep(min_s)
    while time.perf_counter() - t0 < max_s:
        a = _cpu_busy_s()
        time.sleep(window_s)
        b = _cpu_busy_s()
        if a is None or b is None or (b - a) / window_s < busy_frac:
            break
    return round(time.perf_counter() - t0, 2)


# ---- models -------------------------------------------------------------------


def model_dir(name: str | None) -> Path:
    """"demo" / None: the demo model; a name in BENCH_MODELS ("llama-30m", "llama-0.5b",
    "llama-30m-8k", "llama-30m-32k"): the random benchmark Llamas (built once, shared with `kvpager bench executor`);
    anything else: a directory."""
    from kvpager_tools.demo_model import build_demo_model, default_demo_dir, ensure_demo_model

    if name in (None, "", "demo"):
        return ensure_demo_model()
    if name in BENCH_MODELS:
        out = default_demo_dir().parent / f"bench-{name}"
        if not (out / "config.json").exists():
            progress("model", f"building the random {name} checkpoint in {out} (once)")
            tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
            build_demo_model(tmp, **BENCH_MODELS[name])
            try:
                tmp.rename(out)
            except OSError:  # another process built it first
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        return out
    return Path(name)


def token_range(model: str | os.PathLike) -> tuple[int, int]:
    """Token ids [lo, hi) that are ordinary tokenizer tokens (no specials) and
    inside the model's vocabulary: prompts drawn from them detokenize."""
    import json

    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
    tok = json.loads((Path(model) / "tokenizer.json").read_text())
    size = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    specials = [t["id"] for t in tok.get("added_tokens", [])]
    lo = max(specials) + 1 if specials and max(specials) < 16 else 0
    return lo, min(size, vocab)


# ---- datasets ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchSampling:
    """How every request of a run samples, the same for each engine compared:
    greedy unless a temperature is given."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.temperature == 0 and (self.top_p < 1 or self.top_k):
            raise ValueError("top_p / top_k filter sampled tokens: give a temperature > 0 with them")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


GREEDY = BenchSampling()


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    group: int = 0          # prefix group (prefix-repetition), for the best possible hit rate


def _uniform_len(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    return max(lo, min(hi, int(round(rng.lognormvariate(mu, sigma)))))


def make_dataset(name: str, num_prompts: int, *, token_lo: int, token_hi: int, seed: int = 0,
                 input_len: int = 128, output_len: int = 64, range_ratio: float = 0.0,
                 num_prefixes: int = 4, prefix_len: int = 256, suffix_len: int = 32,
                 max_len: int = 2048) -> list[BenchRequest]:
    """Synthetic requests (token ids; no tokenizer needed).

    random: input/output lengths uniform in mean x [1 - range_ratio, 1 + range_ratio].
    sharegpt-like: lognormal lengths with ShareGPT's means (input 161, output 338),
        each request's input + output capped at ``max_len``.
    prefix-repetition: ``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each
        followed by a distinct suffix of ``suffix_len`` tokens (groups in shuffled order).
    shared-system-prompt: one system prompt of ``prefix_len`` tokens + a distinct
        user turn of ``input_len`` (± range_ratio) tokens.
    """
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(token_lo, token_hi) for _ in range(n)]

    out: list[BenchRequest] = []
    if name == "random":
        for _ in range(num_prompts):
            out.append(BenchRequest(toks(_uniform_len(rng, input_len, range_ratio)),
                                    _uniform_len(rng, output_len, range_ratio)))
    elif name == "sharegpt-like":
        mi, si, mo, so = SHAREGPT
        for _ in range(num_prompts):
            n_in = _lognormal(rng, mi, si, 4, max_len // 2)
            n_out = _lognormal(rng, mo, so, 4, max_len - n_in)
            out.append(BenchRequest(toks(n_in), n_out))
    elif name == "prefix-repetition":
        prefixes = [toks(prefix_len) for _ in range(num_prefixes)]
        groups = [i % num_prefixes for i in range(num_prompts)]
        rng.shuffle(groups)  # a trace's order is not aligned with any executor count
        for g in groups:
            out.append(BenchRequest(prefixes[g] + toks(suffix_len), _uniform_len(rng, output_len, range_ratio), g))
    elif name == "shared-system-prompt":
        system = toks(prefix_len)
        for _ in range(num_prompts):
            out.append(BenchRequest(system + toks(_uniform_len(rng, input_len, range_ratio)),
                                    _uniform_len(rng, output_len, range_ratio)))
    else:
        raise ValueError(f"unknown dataset {name!r}; expected one of {DATASETS}")
    return out


def best_hit_rate(requests: list[BenchRequest], block_size: int) -> float:
    """The best prefix hit rate any placement could reach on this trace, with
    an unbounded cache: per request, the full blocks of its prompt shared with
    an earlier prompt (the last prompt token is always recomputed), over all
    prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in requests:
        p = r.prompt_ids
        total += len(p)
        usable = (len(p) - 1) // block_size  # full blocks before the last token
        n = 0
        while n < usable and tuple(p[: (n + 1) * block_size]) in seen:
            n += 1
        hit += n * block_size
        for i in range(len(p) // block_size):
            seen.add(tuple(p[: (i + 1) * block_size]))
    return hit / total if total else 0.0


# ---- statistics -----------------------------------------------------------------


def summary_ms(values_s: list[float]) -> dict:
    """mean / median / p90 / p99 in milliseconds."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ms = [v * 1e3 for v in values_s]
    return {"mean": round(statistics.fmean(ms), 3), "median": round(statistics.median(ms), 3),
            "p90": round(percentile(ms, 90), 3), "p99": round(percentile(ms, 99), 3)}


def median_of(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


# ---- the embedded stack -----------------------------------------------------------


@contextlib.contextmanager
def embedded_stack(opts: StackOptions):
    """Memory service + executors + gateway as child processes on free
    loopback ports (kvpager_tools.stack.Stack; it returns once the gateway
    routes to every executor). Yields the Stack."""
    from kvpager_tools.stack import Stack

    stack = Stack(opts.config())
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """One Prometheus endpoint as {"name{labels}": value} (histogram _sum/_count included)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def metric_sum(samples: dict[str, float], prefix: str, **labels: str) -> float:
    """Sum of the samples named ``prefix`` (exactly, before any labels) whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        name, _, rest = key.partition("{")
        if name != prefix:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def scrape_all(ports: dict[str, int]) -> dict[str, dict[str, float]]:
    return {name: scrape(port) for name, port in ports.items()}


def step_totals(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, float]:
    """Where the steps between two ``scrape_all`` snapshots (gateway,
    executor-0, memory) spent their time, in seconds, from the services' own
    timers: forward and sample (executor), execute_handler_other (the rest of
    the Execute handler: decoding, validation, input building, packing),
    execute_rpc_other (the gateway's execute phase, from sending the
    Execute to taking up its reply, outside that handler: transport, waiting
    for the gateway's event loop), memory_step (the gateway's plan phase:
    schedule + Step RPC; of it memory_step_handler inside the memory service
    and memory_step_inproc the Step itself), gateway_other (the step's
    remainder: building the Execute requests, applying results). With one
    executor the step phases add up to the step; with several, steps overlap."""

    def d(service: str, name: str, **labels) -> float:
        return metric_sum(b[service], name, **labels) - metric_sum(a[service], name, **labels)

    forward = d("executor-0", "kvpager_executor_forward_seconds_sum")
    sample = d("executor-0", "kvpager_executor_sample_seconds_sum")
    plan = d("gateway", "kvpager_gateway_step_seconds_sum", phase="plan")
    execute = d("gateway", "kvpager_gateway_step_seconds_sum", phase="execute")
    total = d("gateway", "kvpager_gateway_step_seconds_sum", phase="total")
    handler = (d("executor-0", "kvpager_rpc_latency_seconds_sum", method="/kvpager.v1.ExecutorService/Execute")
               + d("executor-0", "kvpager_rpc_latency_seconds_sum",
                   method="/kvpager.v1.ExecutorService/ExecuteStream"))  # a burst streamed sub-step by sub-step
    return {"steps": d("gateway", "kvpager_gateway_step_seconds_count", phase="total"),
            "forward": forward, "sample": sample, "execute_handler_other": handler - forward - sample,
            "execute_rpc_other": execute - handler, "memory_step": plan,
            "memory_step_handler": d("memory", "kvpager_rpc_latency_seconds_sum",
                                     method="/kvpager.v1.MemoryService/Step"),
            "memory_step_inproc": d("memory", "kvpager_memory_step_seconds_sum"),
            "gateway_other": total - plan - execute, "step_total": total}


# ---- the load generator ---------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    max_tokens: int
    start_s: float = 0.0
    first_s: float | None = None          # first token arrived
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival time of each streamed response with tokens
    num_out: int = 0
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.start_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.end_s is None or self.num_out < 2:
            return None
        return (self.end_s - self.first_s) / (self.num_out - 1)


@dataclass(slots=True)
class LoadResult:
    records: list[RequestRecord]
    start_s: float
    end_s: float
    peak_concurrency: int

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at ``rate`` requests/s (inf: all at time 0)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class Target:
    """Where a load goes: a gateway over gRPC (``address``) or an
    OpenAI-compatible server (``base_url``, "http://host:port" with or without
    "/v1") with ``backend`` "openai" (completions, token ids) or
    "openai-chat" (chat, the prompt's text: ``tokenizer`` decodes it)."""

    backend: str = "grpc"
    address: str = ""
    base_url: str = ""
    model: str = ""            # the request's "model"; "" = the first GET /v1/models lists
    api_key: str | None = None
    tokenizer: object = None

    @classmethod
    def of(cls, target) -> Target:
        return target if isinstance(target, Target) else cls(address=target)


async def run_load(target, requests: list[BenchRequest], *, rate: float = math.inf,
                   max_concurrency: int | None = None, ignore_eos: bool = True, seed: int = 0,
                   cache_salt: str = "", on_done=None, timeout_s: float = 3600.0,
                   stream_interval: int = 0, sampling: BenchSampling = GREEDY) -> LoadResult:
    """Stream every request (greedy, or as ``sampling`` says) to ``target`` (a
    gateway's gRPC address, or a Target), recording token arrival times.
    ``on_done(record)`` is called as each request finishes. A fresh
    ``cache_salt`` keeps earlier runs' cached prefixes out of this one.
    ``stream_interval`` (gRPC only): the requests' field (0 = the gateway's
    default; >= max_tokens = each completion once, when it ends)."""
    target = Target.of(target)
    offsets = arrival_offsets(len(requests), rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(len(r.prompt_ids), r.max_tokens) for r in requests]
    in_flight = peak = 0
    async with _sender(target, ignore_eos, cache_salt, seed, timeout_s, stream_interval, sampling) as send:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(i: int, req: BenchRequest) -> None:
            nonlocal in_flight, peak
            delay = t0 + offsets[i] - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = records[i]
            async with (sem if sem is not None else contextlib.nullcontext()):
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    await send(i, req, rec)
                finally:
                    in_flight -= 1
            if on_done is not None:
                on_done(rec)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        end = max((r.end_s for r in records if r.end_s is not None), default=time.perf_counter())
    return LoadResult(records, start, end, peak)


@contextlib.asynccontextmanager
async def _sender(target: Target, ignore_eos: bool, cache_salt: str, seed: int, timeout_s: float,
                  stream_interval: int = 0, sampling: BenchSampling = GREEDY):
    """send(i, request, record): one streamed request over the target's API."""
    if stream_interval and target.backend != "grpc":
        raise ValueError(f"stream_interval is a field of kvpager's gRPC requests, not of the {target.backend} API")
    if target.backend == "grpc":
        from kvpager.channel import make_channel
        from kvpager.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

        async with make_channel(target.address) as channel:
            # Connected before the clock starts, as a serving client's channel
            # is (the HTTP path's model lookup does the same): TCP and HTTP/2
            # setup is no request's time. Bounded: an unreachable gateway still
            # fails the requests themselves, as before.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(channel.channel_ready(), CONNECT_WAIT_S)
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def send(i: int, req: BenchRequest, rec: RequestRecord) -> None:
                msg = gateway_pb2.GenerateRequest(
                    prompt_token_ids=req.prompt_ids, request_id=f"bench-{seed}-{cache_salt}-{i}",
                    cache_salt=cache_salt, stream_interval=stream_interval,
                    sampling_params=common_pb2.SamplingParams(
                        max_tokens=req.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                        top_k=sampling.top_k, ignore_eos=ignore_eos))
                out = await stream_generate(stub, msg, timeout_s=timeout_s, raise_errors=False)
                rec.start_s, rec.first_s = out.started_s, out.first_s
                c = out.completions.get(0)
                if c is not None:
                    rec.chunk_s, rec.token_ids = c.chunk_times, c.token_ids
                    rec.cached_tokens = c.usage.get("cached_prompt_tokens", 0)
                if out.status == "OK":
                    rec.end_s = out.ended_s
                    rec.num_out = len(rec.token_ids)
                else:
                    rec.error = f"{out.status}: {out.details}"

            yield send
        return
    from kvpager_tools.bench.http_client import HttpClient
    from kvpager_tools.bench.openai_load import request_body, served_model, stream_one

    base = target.base_url.rstrip("/").removesuffix("/v1")
    client = HttpClient(base, headers={"Authorization": f"Bearer {target.api_key}"} if target.api_key else {},
                        timeout_s=timeout_s)
    try:
        model = target.model or await served_model(client)

        async def send(i: int, req: BenchRequest, rec: RequestRecord) -> None:
            text = target.tokenizer.decode(req.prompt_ids) if target.backend == "openai-chat" else None
            path, body = request_body(target.backend, model, req.prompt_ids, req.max_tokens, ignore_eos=ignore_eos,
                                      cache_salt=cache_salt, prompt_text=text, sampling=sampling)
            await stream_one(client, path, body, rec)

        yield send
    finally:
        await client.close()


# A stream's token from the same step as another's first token may be read just after it.
SAME_STEP_S = 0.3e-3


def prefill_stalls(records: list[RequestRecord]) -> list[float]:
    """The inter-token gaps (seconds) of the streams already running when
    another request's first token came: each such stream's gap that spans
    it. What a prefill costs the streams beside it: about one step where
    the engine computes prefills and decodes in one forward (vLLM), more
    where a prefill runs alone and the decodes wait for it."""
    running = sorted((r.chunk_s for r in records if len(r.chunk_s) > 1), key=lambda c: c[0])
    firsts = [r.first_s for r in records if r.first_s is not None]
    out = []
    for f in firsts:
        for chunks in running:
            if chunks[0] >= f - SAME_STEP_S:
                break  # sorted by their first token: none of the rest was streaming yet
            if chunks[-1] <= f + SAME_STEP_S:
                continue  # ended before it
            i = bisect.bisect_left(chunks, f - SAME_STEP_S)
            out.append(chunks[i] - chunks[i - 1])
    return out


def load_metrics(result: LoadResult, slo_ms: dict[str, float] | None = None) -> dict:
    """Throughput, latency summaries and goodput of one load run."""
    ok = [r for r in result.records if r.ok]
    dur = result.duration_s
    out_tokens = sum(r.num_out for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    m = {
        "completed": len(ok), "failed": len(result.records) - len(ok),
        "duration_s": round(dur, 3),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": round(len(ok) / dur, 4) if dur > 0 else None,
        "output_throughput": round(out_tokens / dur, 2) if dur > 0 else None,
        "total_token_throughput": round((in_tokens + out_tokens) / dur, 2) if dur > 0 else None,
        "ttft_ms": summary_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": summary_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": summary_ms(itl),
        # Running streams' gaps across another request's first token (prefill_stalls).
        "prefill_stall_ms": summary_ms(prefill_stalls(ok)),
        "e2e_ms": summary_ms([r.e2e_s for r in ok]),
        "peak_concurrency": result.peak_concurrency,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
    }
    errors = sorted({r.error for r in result.records if r.error})
    if errors:
        m["errors"] = errors[:5]
    if slo_ms:
        good = 0
        for r in ok:
            checks = {"ttft": r.ttft_s, "tpot": r.tpot_s if r.tpot_s is not None else 0.0, "e2e": r.e2e_s}
            if all(checks[k] is not None and checks[k] * 1e3 <= v for k, v in slo_ms.items()):
                good += 1
        m["goodput"] = {"slo_ms": slo_ms, "good_requests": good,
                        "request_goodput": round(good / dur, 4) if dur > 0 else None,
                        "fraction": round(good / len(result.records), 4) if result.records else None}
    return m


def parse_slo(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2e:MS, got {item!r}")
        out[key] = float(value)
    return out


# ---- memory-service accounting ------------------------------------------------------


async def accounting(memory_address: str) -> dict:
    """The memory service's totals (cumulative counters included)."""
    from kvpager.channel import make_channel
    from kvpager.v1 import memory_pb2, memory_pb2_grpc

    async with make_channel(memory_address) as ch:
        snap = await memory_pb2_grpc.MemoryServiceStub(ch).GetAccounting(memory_pb2.AccountingRequest(), timeout=10)
    t = snap.total
    return {"prefix_query_tokens": t.prefix_query_tokens, "prefix_hit_tokens": t.prefix_hit_tokens,
            "preemptions": t.preemptions, "preemptions_recompute": t.preemptions_recompute,
            "preemptions_swap": t.preemptions_swap, "total_blocks": t.total_blocks, "used_blocks": t.used_blocks,
            "evictions": t.evictions}


def accounting_delta(before: dict, after: dict) -> dict:
    q = after["prefix_query_tokens"] - before["prefix_query_tokens"]
    h = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    return {"prefix_query_tokens": q, "prefix_hit_tokens": h,
            "prefix_hit_rate": round(h / q, 5) if q else 0.0,
            "preemptions": after["preemptions"] - before["preemptions"],
            "preemptions_recompute": after["preemptions_recompute"] - before["preemptions_recompute"],
            "preemptions_swap": after["preemptions_swap"] - before["preemptions_swap"],
            "evictions": after["evictions"] - before["evictions"]}


class AccountingWatch:
    """Samples the WatchAccounting stream while a load runs: KV usage over time."""

    def __init__(self, memory_address: str, interval_ms: int = 100) -> None:
        self.memory_address = memory_address
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, float]] = []  # (unix time, used fraction, kv_utilization)
        self._task: asyncio.Task | None = None

    async def _watch(self) -> None:
        from kvpager.channel import make_channel
        from kvpager.v1 import memory_pb2, memory_pb2_grpc

        async with make_channel(self.memory_address) as ch:
            stub = memory_pb2_grpc.MemoryServiceStub(ch)
            async for snap in stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=self.interval_ms)):
                t = snap.total
                self.samples.append((snap.time_s, t.used_blocks / t.total_blocks if t.total_blocks else 0.0,
                                     t.kv_utilization))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


# ---- plots ----------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
