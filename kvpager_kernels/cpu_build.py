"""Builds and loads the C++ CPU kernels (``kvpager_kernels/cpu/*.cpp``) as
``torch.ops.kvpager_cpu``.

Compiled on first use with the machine's own instruction set
(``torch.utils.cpp_extension``, cached under ``TORCH_EXTENSIONS_DIR``: about
half a minute on a 2-core machine, once per machine and source version).
``available()`` says whether the ops loaded; ``KVPAGER_CPU_KERNELS=0`` turns
them off. Where they are missing the executor runs the torch references
(``kvpager_kernels.reference``, ``kvpager_kernels.fused_reference``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("cpu")
SOURCES = ("paged_attention.cpp", "fused.cpp", "packed_gemm.cpp", "argmax.cpp", "gumbel.cpp", "sort_rows.cpp", "threads.cpp")
OPS = ("paged_attention", "amx_usable", "rms_norm", "add_rms_norm", "rope_store_kv", "silu_mul", "packed_gemm",
       "packed_gemm_readable", "argmax_rows", "gumbel_argmax", "sort_rows",
       "bind_team")
# -ffp-contract=off: the fused elementwise kernels must round like torch's
# separate multiply and add (the hot loops use explicit FMA intrinsics).
# -fno-trapping-math: nothing here reads FP exception flags, and without it
# GCC keeps the clamps and selects of the vectorisable exp/silu loops as
# branches on AVX2 targets (no masked compares), so those loops ran scalar
# there; results are unchanged (same IEEE operations, same rounding).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]
# GCC auto-vectorises with 256-bit vectors on AVX-512 Intel CPUs unless told
# otherwise (bf16 RMSNorm/RoPE ran 10-20 % slower); an x86-only option.
if platform.machine().lower() in ("x86_64", "amd64"):
    CFLAGS.append("-mprefer-vector-width=512")

_lock = threading.Lock()
_state: dict = {}
# How long a process waits for another one building the same kernels.
BUILD_WAIT_S = 900.0


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature line from /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "").strip()
    except OSError:
        return ""


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX tiles for bf16 (oneDNN's 16-bit matmuls and
    SDPA run on them; read once: asked every step)."""
    return "amx_bf16" in cpu_flags().split()


@functools.cache
def cpu_class() -> str:
    """Which in-place attention budgets fit this CPU (``kvpager_kernels.cpu_attention``,
    asked every step): "amx", "avx512_bf16" (no AMX; the kernels' bf16 tiles
    use its pair dot product) or "other"."""
    if has_amx():
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in cpu_flags().split() else "other"


def _tag() -> str:
    """Compiled with -march=native: the build is keyed on the CPU's features
    (a cache directory shared between machines never loads foreign code), the
    torch version and the sources."""
    h = hashlib.sha1(f"{platform.machine()}|{cpu_flags()}|{torch.__version__}|{CFLAGS}".encode())
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _loaded() -> bool:
    ns = getattr(torch.ops, "kvpager_cpu", None)
    return ns is not None and all(hasattr(ns, op) for op in OPS)


def available() -> bool:
    """Build (once per machine; cached on disk) and load the ops. False when
    disabled or when they cannot build (the reason is logged once)."""
    with _lock:
        if "ok" not in _state:
            ok = False
            if os.environ.get("KVPAGER_CPU_KERNELS", "1") != "0":
                try:
                    ok = _build()
                except Exception as exc:  # no compiler, no headers, ...: the references still work
                    log.warning("C++ CPU kernels unavailable, using the torch references: %s", exc)
            _state["ok"] = ok
        return _state["ok"]


def _build() -> bool:
    if _loaded():
        return True
    from torch.utils import cpp_extension

    name = f"kvpager_cpu_{_tag()}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with _build_lock(build_dir, BUILD_WAIT_S):
        if not (build_dir / f"{name}.so").exists():
            log.info("compiling the C++ CPU kernels (once per machine, about half a minute) in %s", build_dir)
        cpp_extension.load(name=name, sources=[str(SOURCE_DIR / s) for s in SOURCES], extra_cflags=CFLAGS,
                           extra_ldflags=["-fopenmp"], extra_include_paths=[str(SOURCE_DIR)],
                           is_python_module=False, verbose=False)
    return _loaded()


@contextlib.contextmanager
def _build_lock(build_dir: Path, wait_s: float):
    """One builder per build directory, and never a wait on a dead one.

    torch's own lock is a file that exists while someone builds: a build
    killed midway (Ctrl-C during the first compile, a SIGKILLed executor)
    leaves it behind, and every later load waits for it forever. An flock
    dies with its process; whoever holds it is the only kvpager builder, so
    a torch lock file found then is stale and goes. Waiting for a live
    builder is bounded: past ``wait_s`` the caller gets an error (and the
    executor the torch references)."""
    import fcntl  # Linux and the like: the kernels are built with -march=native there only

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kvpager.flock", "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build_dir} for over {wait_s:g} s") from None
                time.sleep(0.2)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by an interrupted build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
