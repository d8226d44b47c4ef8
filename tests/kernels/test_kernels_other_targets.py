"""The C++ CPU kernels compile for x86 targets other than this machine's.

They are built with -march=native, and whole headers sit under `#if` on the
CPU's features: attention_amx.h and packed_gemm.cpp's AMX paths where the
compiler targets AMX, attention_pairs.h where it targets AVX512-BF16, the
fp32-emulated bf16 tiles on AVX-512 without it, the AVX2 forms below that.
A build only ever compiles the branches of the CPU it runs on, so a change
to a shared signature once left the AMX tile calling the old one, and every
AMX machine fell back to the torch references unseen. Here the sources with
such branches are checked (-fsyntax-only, which still instantiates the
templates) for one CPU of each kind."""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch.utils.cpp_extension as cpp_extension

from kvpager_kernels import cpu_build

# (target, the features its branches need), one CPU of each kind.
TARGETS = {
    "sapphirerapids": "AMX tiles and AVX512-BF16",
    "cooperlake": "AVX512-BF16 without AMX",
    "skylake-avx512": "AVX-512 without AVX512-BF16",
    "x86-64-v3": "AVX2 + FMA",
}
SOURCES = ("paged_attention.cpp", "packed_gemm.cpp", "fused.cpp")

pytestmark = [
    pytest.mark.skipif(sysconfig.get_platform().split("-")[-1] not in ("x86_64", "amd64"),
                       reason="x86 targets"),
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++"),
    pytest.mark.timeout(600),
]


def _knows(target: str) -> bool:
    return subprocess.run(["g++", f"-march={target}", "-x", "c++", "-E", "-"], input="", capture_output=True,
                          text=True).returncode == 0


def test_the_kernels_compile_for_each_kind_of_x86_cpu():
    includes = [str(cpu_build.SOURCE_DIR), *cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    jobs = {}
    for target in TARGETS:
        if not _knows(target):
            continue
        for src in SOURCES:
            cmd = ["g++", "-fsyntax-only", "-w", "-std=c++17", f"-march={target}", "-fopenmp",
                   *(f"-I{p}" for p in includes), os.path.join(cpu_build.SOURCE_DIR, src)]
            jobs[(target, src)] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            while sum(p.poll() is None for p in jobs.values()) >= (os.cpu_count() or 2):
                next(p for p in jobs.values() if p.poll() is None).wait()
    assert any(t == "sapphirerapids" for t, _ in jobs), f"{sys.platform}: g++ knows no AMX target"
    failed = {}
    for key, proc in jobs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed[key] = "\n".join(line for line in err.splitlines() if "error" in line)[:2000]
    assert not failed, "\n".join(f"{t} ({TARGETS[t]}) {s}:\n{e}" for (t, s), e in failed.items())
