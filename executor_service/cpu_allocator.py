"""How a CPU executor's memory allocator is set: freed blocks kept for reuse,
not handed back to the OS and faulted in again on the next step."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class AllocatorSettings:
    """What keep_freed_memory could set in this process."""

    malloc_library: str | None  # the file whose malloc the process calls (None: could not be told)
    glibc_kept: bool  # glibc's malloc is in use and was told to keep freed blocks


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def malloc_library() -> str | None:
    """The file of the library whose ``malloc`` this process calls, or None where it cannot be told.

    glibc's on a plain process; a preloaded allocator's (``LD_PRELOAD`` of
    jemalloc, tcmalloc, mimalloc) where one interposes it: ``malloc`` as the
    process resolves it is then not the C library's own.
    """
    try:
        resolved = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p)
        info = _DlInfo()
        if not _libc().dladdr(resolved, ctypes.byref(info)) or not info.dli_fname:
            return None
        return os.fsdecode(info.dli_fname)
    except (OSError, AttributeError):
        return None


def _glibc_malloc_in_use() -> ctypes.CDLL | None:
    """glibc's handle where its malloc serves this process (so its mallopt governs it), else None."""
    try:
        libc = _libc()
        libc.gnu_get_libc_version  # glibc, not musl
        process = ctypes.CDLL(None)
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        # A preloaded allocator interposes the whole family; torch allocates with posix_memalign.
        if any(address(getattr(process, name)) != address(getattr(libc, name))
               for name in ("malloc", "free", "posix_memalign")):
            return None
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> AllocatorSettings:
    """Keep freed memory for reuse (process-wide, idempotent).

    A forward allocates and frees megabyte-sized activations and KV gathers
    many times per step. By default glibc serves those with fresh mmaps and
    trims freed heap tops back to the OS, so every step page-faults its
    working set in again: measured on the 2-core CI machine, a 32-sequence
    decode step of the 30M model spent ~1.1M minor faults per 40 steps and
    took 58-66 ms; with a 32 MiB mmap threshold (glibc's maximum) and a 1 GiB
    trim threshold, 0.15M faults and 33-41 ms. Blocks past 32 MiB (a prefill's
    gate/up product: 2,048 x 9,728 bf16 is 40 MB on the 0.5B Llama) were still
    fresh mmaps, faulted in on every call: no mmaps at all (``M_MMAP_MAX`` 0,
    every block from the heap) took a 4,544-token prefill of the 0.5B model,
    its MLP in one block, from 467k faults and 3.1 s to none and 2.6 s on the
    AMX Xeon. And one arena for every thread: a thread's own arena grows in
    64 MiB heaps that glibc unmaps whenever one empties, so a forward on the
    step worker thread faulted its large blocks in again (260k faults and
    2.8 s a round against none and 2.45 s on the main thread).

    Call it before the process starts the threads that run steps: a thread
    keeps the arena it has.

    What it does not promise: that a block freed and asked for again at the
    very same size is that block. torch asks for 64-byte alignment, and
    glibc's memalign (before 2.38) cuts a ~100-byte tail off each block it
    carves; the tail goes to the thread's cache of small chunks, and once a
    small object holds it the freed block is too small by that tail for the
    same request, which is then carved from fresh heap. In a loop of nothing
    but one 96 MiB block on a fresh thread (Debian 12's glibc 2.36) that was
    every time, the heap growing 96 MiB a call. The executor's steps free and
    ask for many sizes, and refill those small caches: a 0.5B bf16 prefill
    round on the step thread (four steps, 232 to 2,048 tokens) took no faults
    and its RSS stayed at 2.9 GiB through ten rounds. Turning the cache off
    (``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``) cured the loop but made a
    one-sequence 30M decode step 10 % slower (6.3 to 7.0 ms); page-aligned
    blocks (torch's ``THP_MEM_ALLOC_ENABLE``) moved the tail, not the problem.

    Where glibc's malloc is not the one in use (not glibc, or an allocator
    preloaded over it: jemalloc, tcmalloc), nothing is set in malloc; that
    allocator's own settings decide what is kept.
    """
    libc = _glibc_malloc_in_use()
    kept = False
    if libc is not None:
        m_trim_threshold, m_mmap_threshold, m_mmap_max, m_arena_max = -1, -3, -4, -8
        kept = all(libc.mallopt(option, value) for option, value in (
            (m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_mmap_max, 0), (m_arena_max, 1)))
    return AllocatorSettings(malloc_library(), kept)
