"""The C++ kernels' build lock: a build killed midway never blocks later
loads, and a live builder is waited for only so long (then the torch
references serve). Each case loads in a fresh process: this one has the ops
loaded already."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import pytest

from kvpager_kernels import cpu_build

pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="the C++ CPU kernels do not build here")

ROOT = Path(__file__).resolve().parents[2]


def build_dir() -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(f"kvpager_cpu_{cpu_build._tag()}", verbose=False))


def load_in_new_process(wait_s: float, timeout_s: float = 300) -> subprocess.CompletedProcess:
    code = ("import sys; from kvpager_kernels import cpu_build; "
            f"cpu_build.BUILD_WAIT_S = {wait_s}; print(cpu_build.available())")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def test_a_stale_lock_from_an_interrupted_build_is_removed():
    stale = build_dir() / "lock"
    stale.write_text("")  # what torch leaves behind when its builder dies
    try:
        out = load_in_new_process(wait_s=60)  # without the fix: waits on the file forever (the timeout fires)
        assert out.stdout.strip() == "True", out.stderr[-2000:]
        assert "stale build lock" in out.stderr
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_live_builder_is_waited_for_a_bounded_time_then_the_references_serve():
    with open(build_dir() / "kvpager.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another process building right now
        try:
            out = load_in_new_process(wait_s=1.0, timeout_s=120)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
    assert "building" in out.stderr and "torch references" in out.stderr
