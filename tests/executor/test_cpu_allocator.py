"""keep_freed_memory: a block past glibc's mmap threshold (a prefill's gate/up
product) is served from memory already faulted in, not from a fresh mmap,
on the main thread and on a thread started later (the executor's step worker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A subprocess: mallopt is process-wide. Faults of the second 96 MiB block, written whole.
SCRIPT = """
import resource, threading, torch
from executor_service.cpu import keep_freed_memory

def faults_of_a_fresh_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(96 << 20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

def twice(out):
    faults_of_a_fresh_block()
    out.append(faults_of_a_fresh_block())

plain, kept = [], []
twice(plain)
assert keep_freed_memory()
twice(kept)
worker = threading.Thread(target=twice, args=(kept,))
worker.start()
worker.join()
print(plain[0], *kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_large_blocks_are_reused_not_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    plain, kept, kept_on_a_thread = map(int, out.stdout.split())
    pages = (96 << 20) // 4096
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not (thp.exists() and "[always]" in thp.read_text()):  # huge pages fault 512 at a time
        assert plain >= pages // 2  # glibc's default: a fresh mmap each time (the control)
    assert kept < pages // 20 and kept_on_a_thread < pages // 20
