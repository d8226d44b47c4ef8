"""Compile every kernel for an NVIDIA target on a machine without a GPU.

    TRITON_INTERPRET=0 python -m kvpager_kernels.aot_check [--arch 90]

The interpreter is lenient where the compiler is not (loop-carried types,
tl.dot shape limits, specialisation of int arguments equal to 1, shared
memory limits), and triton's NVIDIA backend ships ptxas, so the whole
pipeline down to a cubin runs on CPU. Each public launcher is called with CPU
tensors while ``JITFunction.__getitem__`` is replaced by a stand-in that
compiles for the target instead of launching; the captured arguments become
the signature exactly as a real launch would specialise them.

Must run in a fresh process: triton fixes compiled-vs-interpreted at import.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

import torch

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int32: "i32", torch.int64: "i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _signature(arg_names: List[str], args, kwargs) -> Tuple[Dict, Dict, Dict]:
    """(signature, constexprs, attrs) the way a JIT launch specialises them:
    ints equal to 1 become constants, ints and pointers divisible by 16 get a
    divisibility hint (which is what lets loads vectorise)."""
    values = list(args) + [kwargs[n] for n in arg_names[len(args):]]
    sig, consts, attrs = {}, {}, {}
    divisible = [["tt.divisibility", 16]]
    for i, (name, value) in enumerate(zip(arg_names, values)):
        if name in kwargs:  # our kernels pass exactly their constexprs by keyword
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = divisible
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif isinstance(value, int) and value == 1:
            sig[name], consts[name] = "constexpr", 1
        elif isinstance(value, int):
            sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = divisible
        else:
            raise TypeError(f"{name}: unsupported argument {type(value)}")
    return sig, consts, attrs


def _resource_usage(cubin: bytes) -> Dict[str, int]:
    """REG/STACK/LOCAL/SHARED of a cubin via the cuobjdump triton bundles
    (empty if it is missing). STACK or LOCAL > 0 means register spills."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", out)}


def _cases():
    """(description, thunk) pairs that call the public launchers once each."""
    import kvpager_kernels as kernels
    from kvpager_kernels.testing import make_paged_batch
    from kvpager_kernels.triton_paged_attention import paged_attention_impl

    def attention(dtype, head_dim, heads, block_size, decode):
        q_lens = [1, 1] if decode else [30, 1]
        batch = make_paged_batch([40, 90], q_lens, num_heads=heads[0], num_kv_heads=heads[1],
                                 head_dim=head_dim, block_size=block_size, dtype=dtype)
        return lambda: paged_attention_impl(*batch.args())

    for dtype, head_dim, heads, block_size, decode in [
        (torch.bfloat16, 128, (32, 4), 16, False),
        (torch.bfloat16, 128, (32, 4), 16, True),
        (torch.float16, 80, (8, 8), 64, False),
        (torch.float16, 96, (64, 8), 128, True),
        (torch.float32, 256, (16, 2), 32, True),
        (torch.bfloat16, 256, (4, 1), 8, False),
    ]:
        name = f"attention {str(dtype)[6:]} d{head_dim} h{heads[0]}/{heads[1]} bs{block_size}"
        yield name + (" decode" if decode else " mixed"), attention(dtype, head_dim, heads, block_size, decode)

    pool = torch.zeros(2, 2, 8, 16, 4, 80, dtype=torch.bfloat16)
    key = torch.zeros(3, 4, 80, dtype=torch.bfloat16)
    yield "store_kv bf16 d80", lambda: kernels.store_kv(key, key, pool[1, 0], pool[1, 1], torch.tensor([1, -1, 5]))
    yield "copy_blocks", lambda: kernels.copy_blocks(pool[1, 0], pool[1, 1], torch.tensor([1]), torch.tensor([2]))
    yield "copy_blocks_all_layers", lambda: kernels.copy_blocks_all_layers(pool, torch.tensor([1, 3]), torch.tensor([2, 4]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80 or 90")
    parser.add_argument("--no-spills", action="store_true", help="fail if a kernel spills registers")
    args = parser.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kvpager_kernels._jit import is_interpreted
    from kvpager_kernels.triton_store_kv import _store_kv_kernel

    if is_interpreted(_store_kv_kernel):
        print("aot_check: triton was imported in interpreter mode; run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    compiled: List[str] = []

    def compile_instead(self, grid):
        def launch(*call_args, **kwargs):
            options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
            sig, consts, attrs = _signature(self.arg_names, call_args, kwargs)
            kernel = triton.compile(ASTSource(self, sig, consts, attrs), target=target, options=options)
            usage = _resource_usage(kernel.asm["cubin"])
            spills = usage.get("STACK", 0) + usage.get("LOCAL", 0)
            compiled.append(f"{self.__name__} (regs {usage.get('REG', '?')}, spill {spills} B, "
                            f"shared {kernel.metadata.shared} B)")
            if args.no_spills and spills:
                raise RuntimeError(f"{self.__name__} spills {spills} bytes")
        return launch

    JITFunction.__getitem__ = compile_instead
    failures = 0
    for name, thunk in _cases():
        start = time.perf_counter()
        compiled.clear()
        try:
            thunk()
        except Exception as exc:  # report every case, fail at the end
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}".splitlines()[0])
            continue
        print(f"ok   {name}: {', '.join(compiled)} [{time.perf_counter() - start:.1f}s]")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
