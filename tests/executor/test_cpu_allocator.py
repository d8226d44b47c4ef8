"""keep_freed_memory: a block past glibc's mmap threshold (a prefill's gate/up
product), freed, serves the next one that fits in it (the next step's, a few
tokens fewer): not a fresh mmap, not fresh heap, not faulted in again; on the
main thread and on a thread started later (the executor's step worker). Where
a preloaded allocator replaces glibc's malloc, it is named and left alone.

(The next one at the very same size is not promised: see keep_freed_memory.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

BLOCK = 96 << 20
PAGES = BLOCK // 4096
ROUNDS = 6
SHRINK = 1 << 20  # each block this much smaller than the one before it, main thread then worker

# A subprocess: the settings are process-wide. For each block (96 MiB, then 1 MiB less each
# time), written whole: the minor faults it took, the bytes glibc had mmapped while it was
# live (mallinfo2.hblkhd), the faults of writing it again (a control: a platform that drops
# live pages would fault there too), and glibc's heap bytes once it was freed (mallinfo2.arena).
SCRIPT = """
import ctypes, dataclasses, json, resource, sys, threading
import torch
from executor_service.cpu_allocator import keep_freed_memory, malloc_library

out = {"library": malloc_library()}
if sys.argv[1] == "kept":  # first thing, as the executor does: before any tensor, before any thread
    out["settings"] = dataclasses.asdict(keep_freed_memory())

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

sizes = iter(range(BLOCK, 0, -SHRINK))

def blocks(key):
    records = []
    for _ in range(ROUNDS):
        before = faults()
        block = torch.empty(next(sizes), dtype=torch.uint8)
        block.fill_(1)
        record = {"faults": faults() - before, "mmapped": libc.mallinfo2().hblkhd}
        before = faults()
        block.fill_(2)
        record["rewrite_faults"] = faults() - before
        del block
        record["heap"] = libc.mallinfo2().arena
        records.append(record)
    out[key] = records

blocks("main")
worker = threading.Thread(target=blocks, args=("thread",))
worker.start()
worker.join()
print(json.dumps(out))
""".replace("ROUNDS", str(ROUNDS)).replace("BLOCK", str(BLOCK)).replace("SHRINK", str(SHRINK))


def run_script(mode: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def glibc_malloc(out: dict) -> bool:
    return Path(out["library"] or "").name.startswith("libc.so")


@pytest.fixture(scope="module")
def plain() -> dict:
    return run_script("plain", {"LD_PRELOAD": ""})


@pytest.fixture(scope="module")
def kept() -> dict:
    return run_script("kept", {"LD_PRELOAD": ""})


def test_large_blocks_come_from_the_heap_and_are_reused(plain, kept):
    if not glibc_malloc(kept):
        pytest.skip(f"malloc here is {kept['library']}, not glibc's")
    assert kept["settings"]["glibc_kept"], kept
    smallest = BLOCK - (2 * ROUNDS - 1) * SHRINK
    # glibc's default (the control): a block this size is a fresh mmap each time.
    assert all(record["mmapped"] >= smallest for record in plain["main"] + plain["thread"]), plain
    # From the heap, the thread's too (one arena for every thread), and each block after the
    # first is the one freed before it: the heap grows once.
    records = kept["main"] + kept["thread"]
    assert all(record["mmapped"] < smallest for record in records), kept
    assert records[-1]["heap"] - records[0]["heap"] < smallest // 2, kept


def test_large_blocks_are_not_faulted_in_again(plain, kept):
    if not glibc_malloc(kept):
        pytest.skip(f"malloc here is {kept['library']}, not glibc's")
    rewrites = [record["rewrite_faults"] for out in (plain, kept) for record in out["main"] + out["thread"]]
    if max(rewrites) >= PAGES // 20:
        pytest.skip(f"this platform faults a live block in again when it is rewritten: {rewrites}")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not (thp.exists() and "[always]" in thp.read_text()):  # huge pages fault 512 at a time
        # The control: a fresh mmap is faulted in, every time.
        assert all(record["faults"] >= PAGES // 2 for record in plain["main"] + plain["thread"]), plain
    assert all(record["faults"] < PAGES // 20 for record in (kept["main"] + kept["thread"])[1:]), kept


def preloadable() -> list[str]:
    found = []
    for name in ("libjemalloc.so.2", "libtcmalloc_minimal.so.4"):
        for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
            if (Path(folder) / name).exists():
                found.append(str(Path(folder) / name))
                break
    return found


@pytest.mark.parametrize("library", preloadable() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no jemalloc or tcmalloc installed (redis-server's Debian package brings jemalloc)"))])
def test_a_preloaded_allocator_is_named_and_left_alone(library):
    out = run_script("kept", {"LD_PRELOAD": library})
    assert Path(out["library"]).resolve() == Path(library).resolve(), out
    assert out["settings"]["malloc_library"] == out["library"] and out["settings"]["glibc_kept"] is False, out
