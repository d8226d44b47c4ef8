#!/usr/bin/env python3
"""Offline vLLM (CPU build) throughput run on token-id prompts: the vLLM side
of `kvpager bench compare-vllm`.

A standalone script, run by the vLLM virtual environment's python (it
imports nothing of kvpager; vLLM is not a dependency of kvpager):

    VENV/bin/python vllm_runner.py --model DIR --dtype float32 \
        --prompts-json prompts.json --max-tokens 64 --rounds 3

prompts.json: a JSON list of token-id lists, e.g. [[17, 523, ...], ...].

With ``--serve-port PORT`` (no prompts) it becomes vLLM's OpenAI-compatible
server on 127.0.0.1:PORT instead, with the same environment and engine
settings (the online side of ``compare-vllm --online``).

Prints exactly ONE JSON line on stdout:
    {"tok_s": [per round], "outputs": [[ids] per prompt, last round],
     "settings": {...}, "load_avg": {...}, "wall_s": [...], ...}
Everything else (vLLM logs, progress) goes to stderr. On failure it prints
{"error": "..."} on stdout and exits 1.

The vLLM CPU environment (LD_PRELOAD of tcmalloc + Intel OpenMP, thread
binding, KV-cache size) is set here: if LD_PRELOAD is not set yet, the script
re-executes itself with it, so callers need no special environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# libiomp5.so ships with the intel-openmp wheel; it lands in <venv>/lib.
IOMP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(sys.executable))), "lib", "libiomp5.so")

ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "TOKENIZERS_PARALLELISM": "false",
    # torch.compile (inductor) artifacts: the first run per model/dtype compiles
    # for ~1 min, later runs load the cache (kept beside the venv).
    "VLLM_CACHE_ROOT": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(sys.executable))), "cache"),
    # vLLM 0.32's AOT compile cache never loads with torch 2.13 ("'function'
    # object has no attribute 'finalize_loading'") and recompiles each start;
    # the plain inductor cache does load: engine ready ~30 s instead of ~60 s,
    # same tok/s and identical outputs.
    "VLLM_USE_AOT_COMPILE": "0",
}


def log(msg: str) -> None:
    print(f"[run_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "?"


def cpu_snapshot():
    """(system busy seconds across all CPUs, CPU seconds of this process tree)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = (sum(fields[:8]) - idle) / hz  # user..steal, without guest double-count
    except Exception:
        return None
    own = 0.0
    try:
        import psutil

        me = psutil.Process()
        for pr in [me] + me.children(recursive=True):
            try:
                t = pr.cpu_times()
                own += t.user + t.system
            except psutil.Error:
                pass
    except Exception:
        return None
    return busy, own


def contention(before, after, wall):
    """Fraction of the machine's CPU capacity used by OTHER processes during a round."""
    if not before or not after or wall <= 0:
        return None
    other = (after[0] - before[0]) - (after[1] - before[1])
    return round(max(0.0, other) / (wall * (os.cpu_count() or 1)), 3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"))
    p.add_argument("--prompts-json", default=None, help="file with a JSON list of token-id lists")
    p.add_argument("--serve-port", type=int, default=None,
                   help="run vLLM's OpenAI-compatible server on 127.0.0.1:PORT instead of an offline run")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (after warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up generate calls (not measured)")
    p.add_argument("--warmup-max-tokens", type=int, default=None, help="new tokens in warm-up (default: --max-tokens)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kvcache-gib", type=int, default=None, help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    p.add_argument("--threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default 0-1)")
    p.add_argument("--prefix-caching", action="store_true", help="enable prefix caching (default off)")
    p.add_argument("--enforce-eager", action="store_true", help="disable torch.compile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="before each round wait up to this many seconds for other processes to use "
                   "< --quiet-frac of the CPUs (shared machines); 0 = don't wait")
    p.add_argument("--quiet-frac", type=float, default=0.1)
    p.add_argument("--interactive", action="store_true",
                   help="after the warm-up print {\"ready\": ...}, then run one round per line 'round' read "
                   "from stdin (one JSON line each) until 'end' (the usual summary); lets a caller interleave "
                   "these rounds with another engine's")
    p.add_argument("--no-reexec", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def maybe_reexec(args) -> None:
    """Set the CPU environment and re-exec once so LD_PRELOAD takes effect."""
    env = dict(os.environ)
    changed = False
    for k, v in ENV_DEFAULTS.items():
        if k not in env:
            env[k] = v
            changed = True
    if args.kvcache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kvcache_gib)
    if args.threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.threads_bind
    if not env.get("LD_PRELOAD"):
        libs = [x for x in (TCMALLOC, IOMP) if os.path.exists(x)]
        missing = [x for x in (TCMALLOC, IOMP) if not os.path.exists(x)]
        if missing:
            log(f"warning: not preloading missing {missing}")
        env["LD_PRELOAD"] = ":".join(libs)
        changed = True
    if args.no_reexec or not changed:
        os.environ.update(env)
        return
    env["_RUN_VLLM_REEXEC"] = "1"
    if os.environ.get("_RUN_VLLM_REEXEC"):  # already re-executed once; don't loop
        os.environ.update(env)
        return
    log(f"re-exec with LD_PRELOAD={env['LD_PRELOAD']}")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)


def serve(args) -> int:
    """exec vLLM's OpenAI server with the settings an offline run uses."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(args.serve_port), "--model", args.model, "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
           "--seed", str(args.seed), "--skip-tokenizer-init"]
    if not args.prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    log(f"serving: {' '.join(cmd[1:])}")
    sys.stdout.flush()
    os.execve(sys.executable, cmd, dict(os.environ))
    return 1  # not reached


def main(argv=None) -> int:
    args = parse_args(argv)
    maybe_reexec(args)
    if args.serve_port is not None:
        return serve(args)
    if not args.prompts_json:
        print(json.dumps({"error": "--prompts-json is required (or --serve-port)"}))
        return 1

    # Keep stdout for the single JSON line; everything else (including C++
    # prints and the engine-core subprocess) goes to stderr.
    json_fd = os.dup(1)
    os.dup2(2, 1)
    json_out = os.fdopen(json_fd, "w")

    def emit(obj) -> None:
        json_out.write(json.dumps(obj) + "\n")
        json_out.flush()

    try:
        with open(args.prompts_json) as f:
            prompts = json.load(f)
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p for p in prompts)):
            raise ValueError("prompts-json must be a non-empty list of non-empty token-id lists")
        prompts = [[int(t) for t in p] for p in prompts]

        t0 = time.perf_counter()
        log(f"importing vllm (load {loadavg()})")
        from vllm import LLM, SamplingParams

        try:
            from vllm.inputs import TokensPrompt
        except ImportError:  # older layouts
            TokensPrompt = dict  # type: ignore

        llm_kwargs = dict(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=args.prefix_caching,
            seed=args.seed,
            # The demo tokenizers are smaller than the model vocab; we only
            # pass and read token ids, so skip the tokenizer entirely.
            skip_tokenizer_init=True,
        )
        if args.max_num_batched_tokens:
            llm_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        if args.enforce_eager:
            llm_kwargs["enforce_eager"] = True
        log(f"loading {args.model} dtype={args.dtype}")
        llm = LLM(**llm_kwargs)
        load_s = time.perf_counter() - t0
        log(f"engine ready in {load_s:.1f}s")

        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}

        def sp(n):
            # No per-request seed: vLLM's seeded requests draw from a generator each (its slower path).
            return SamplingParams(**sampling, max_tokens=n, ignore_eos=True, detokenize=False)

        n_total = len(prompts) * args.max_tokens
        warm_tokens = args.warmup_max_tokens or args.max_tokens
        warm_s = []
        for i in range(args.warmup):
            t = time.perf_counter()
            llm.generate(inputs, sp(warm_tokens), use_tqdm=False)
            warm_s.append(time.perf_counter() - t)
            log(f"warm-up {i + 1}/{args.warmup}: {warm_s[-1]:.2f}s")

        tok_s, walls, loads, outputs = [], [], [], []
        def wait_quiet():
            deadline = time.time() + args.quiet_wait
            while time.time() < deadline:
                a = cpu_snapshot()
                time.sleep(2.0)
                frac = contention(a, cpu_snapshot(), 2.0)
                if frac is None or frac < args.quiet_frac:
                    return
                log(f"waiting for a quiet machine: other processes use {frac:.0%} of the CPUs")

        def one_round(label: str) -> None:
            nonlocal outputs
            if args.quiet_wait > 0:
                wait_quiet()
            la = loadavg()
            snap = cpu_snapshot()
            t = time.perf_counter()
            res = llm.generate(inputs, sp(args.max_tokens), use_tqdm=False)
            wall = time.perf_counter() - t
            outputs = [list(o.outputs[0].token_ids) for o in res]
            got = sum(len(o) for o in outputs)
            if got != n_total:
                log(f"warning: generated {got} tokens, expected {n_total}")
            walls.append(wall)
            tok_s.append(got / wall)
            other = contention(snap, cpu_snapshot(), wall)
            loads.append({"before": la, "after": loadavg(), "other_cpu_frac": other})
            log(f"round {label}: {wall:.2f}s  {tok_s[-1]:.1f} tok/s  load {loads[-1]['after']}  other-procs CPU {other}")

        if args.interactive:
            emit({"ready": True, "load_s": load_s, "warmup_s": warm_s})
            for line in sys.stdin:
                command = line.strip()
                if command == "end":
                    break
                if command != "round":
                    raise ValueError(f"unknown command {command!r} (round | end)")
                one_round(str(len(walls) + 1))
                emit({"wall_s": walls[-1], "tok_s": tok_s[-1], "load": loads[-1]})
        else:
            for r in range(args.rounds):
                one_round(f"{r + 1}/{args.rounds}")

        import torch
        import vllm

        srt = sorted(tok_s)
        emit(
            {
                "tok_s": tok_s,
                "median_tok_s": srt[len(srt) // 2] if srt else None,
                "wall_s": walls,
                "outputs": outputs,
                "settings": {
                    "model": os.path.abspath(args.model),
                    "dtype": args.dtype,
                    "num_prompts": len(prompts),
                    "prompt_lens": [len(p) for p in prompts],
                    "max_tokens": args.max_tokens,
                    "rounds": len(walls),
                    "interactive": args.interactive,
                    "quiet_wait": args.quiet_wait,
                    "warmup": args.warmup,
                    "warmup_max_tokens": warm_tokens,
                    "warmup_s": warm_s,
                    "load_s": load_s,
                    "llm_kwargs": llm_kwargs,
                    "sampling": {**sampling, "ignore_eos": True},
                    "env": {k: os.environ.get(k) for k in list(ENV_DEFAULTS) + ["LD_PRELOAD"]},
                    "vllm_version": vllm.__version__,
                    "torch_version": torch.__version__,
                    "nproc": os.cpu_count(),
                },
                "load_avg": {"rounds": loads, "end": loadavg()},
            }
        )
        # Shut the engine down explicitly so no engine-core process lingers.
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        return 0
    except Exception as e:  # report, don't hang
        import traceback

        traceback.print_exc()
        emit({"error": f"{type(e).__name__}: {e}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
