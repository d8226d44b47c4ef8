"""The sampling kernels built without AVX-512 (x86-64-v3: AVX2 + FMA) answer
what the machine's own build answers: the same greedy tokens, the same
sampled draws (gumbel.cpp's scalar and 8-lane logarithms are the same IEEE
operations), the same sort. A request's sampled tokens must not depend on
the CPU that served it (executor_service/sampler.py). Each build runs in a
subprocess of its own (both register the same op names)."""

import json
import platform
import subprocess
import sys

import pytest

from kvpager_kernels import cpu_build

pytestmark = [
    pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86-64 build option"),
    pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels did not build here"),
    pytest.mark.timeout(600),
]

PORTABLE = f"""
import os
from torch.utils import cpp_extension
src = {str(cpu_build.SOURCE_DIR)!r} + "/"
cpp_extension.load(name="kvpager_sampling_x86_64_v3", sources=[src + f for f in ("argmax.cpp", "gumbel.cpp", "sort_rows.cpp")],
                   extra_cflags=["-O3", "-march=x86-64-v3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"],
                   extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
"""
NATIVE = """
from kvpager_kernels import cpu_build
assert cpu_build.available()
"""
PROBE = """
import json, torch
from kvpager_kernels.gumbel import row_keys
g = torch.Generator().manual_seed(0)
out = {}
for V in (7, 9, 100, 8192):
    lp = (torch.randn(48, V, generator=g) * 2).log_softmax(-1)
    keys = row_keys(torch.arange(48), torch.arange(48) * 3, torch.zeros(48, dtype=torch.int64))
    out[f"draw{V}"] = torch.ops.kvpager_cpu.gumbel_argmax(lp, keys).tolist()
    x = torch.randn(8, V, generator=g).bfloat16().float()
    out[f"argmax{V}"] = torch.ops.kvpager_cpu.argmax_rows(x).tolist()
    out[f"sort{V}"] = torch.ops.kvpager_cpu.sort_rows(x)[1][:, :40].tolist()
print("RESULT" + json.dumps(out))
"""


def _run(prelude: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", prelude + PROBE], capture_output=True, text=True, timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(lines[0][len("RESULT"):])


def test_portable_build_samples_what_the_native_one_samples():
    native, portable = _run(NATIVE), _run(PORTABLE)
    assert native.keys() == portable.keys()
    assert [k for k in native if native[k] != portable[k]] == []
