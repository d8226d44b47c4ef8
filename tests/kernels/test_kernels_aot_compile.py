"""Every kernel compiles to a cubin for H100/H200 (sm_90) without register
spills, checked on CPU.

Runs kvpager_kernels.aot_check in a fresh process because triton fixes
compiled-vs-interpreted at import and this test process is interpreted.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="triton without the NVIDIA backend")
def test_all_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "kvpager_kernels.aot_check", "--arch", "90", "--no-spills"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
