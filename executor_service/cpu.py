"""How a CPU executor uses its machine: the allocator's settings and the
intra-op thread count of each step, chosen from measured step times."""

from __future__ import annotations

import os

import torch


def keep_freed_memory() -> bool:
    """Tell glibc malloc to keep freed memory for reuse (process-wide, idempotent).

    A forward allocates and frees megabyte-sized activations and KV gathers
    many times per step. By default glibc serves those with fresh mmaps and
    trims freed heap tops back to the OS, so every step page-faults its
    working set in again: measured on the 2-core CI machine, a 32-sequence
    decode step of the 30M model spent ~1.1M minor faults per 40 steps and
    took 58-66 ms; with a 32 MiB mmap threshold (glibc's maximum) and a 1 GiB
    trim threshold, 0.15M faults and 33-41 ms. Returns False where mallopt is
    not available (not glibc).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def thread_candidates() -> tuple[int, ...]:
    """Intra-op thread counts a CPU executor chooses between, the preferred
    first: every core this process may run on, then one fewer (left to the
    control plane). An explicit OMP_NUM_THREADS fixes the count."""
    if os.environ.get("OMP_NUM_THREADS"):
        return (torch.get_num_threads(),)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return (cores, cores - 1) if cores > 1 else (1,)


class ThreadTuner:
    """Picks the intra-op thread count of each CPU step from measured step times.

    The executor shares its cores with the gateway, the memory service,
    clients and whatever else the machine runs. On a quiet machine all cores
    are fastest; when other processes want CPU, every OpenMP region waits at
    its barrier for the thread they displaced, and one thread fewer is
    faster. Measured on the 2-core CI machine (30M Llama, 32 prompts x 64
    tokens): quiet, 2 threads 4.3 s vs 1 thread 5.6 s; under other load, 2
    threads 8-41 s vs 1 thread 4.9-6.6 s.

    Each count is timed on the steps it runs, per size class (tokens, in
    powers of two). A class starts on the preferred count (the first
    candidate) and tries the others only when there is a reason: the
    preferred count's steps became slower than the fastest it has shown
    (``slowdown``: the load changed), or, rarely (every ``explore_every``-th
    step), to notice a change the times alone cannot show (the load went
    away while fewer threads run, or it was there from the start). An
    exploring step of a slower count costs up to twice a step, so on a quiet
    machine nearly every step runs on every core.
    """

    def __init__(self, candidates: tuple[int, ...], explore_every: int = 64, slowdown: float = 1.3,
                 alpha: float = 0.3) -> None:
        self.candidates = tuple(dict.fromkeys(candidates))
        self.explore_every = explore_every
        self.slowdown = slowdown
        self.alpha = alpha
        self._ema: dict[tuple[int, int], float] = {}   # (size class, threads) -> seconds per step
        self._fastest: dict[tuple[int, int], float] = {}
        self._seen: dict[int, int] = {}                # steps per size class
        self._exploring: tuple[int, int] | None = None  # the (class, threads) a choice went to try

    def choose(self, num_tokens: int) -> int:
        preferred = self.candidates[0]
        if len(self.candidates) == 1:
            return preferred
        size = num_tokens.bit_length()
        n = self._seen.get(size, 0)
        self._seen[size] = n + 1
        if (size, preferred) not in self._ema:
            return preferred
        tried = [t for t in self.candidates if (size, t) in self._ema]
        best = min(tried, key=lambda t: self._ema[(size, t)])
        untried = [t for t in self.candidates if (size, t) not in self._ema]
        choice = best
        if untried and self._ema[(size, preferred)] > self.slowdown * self._fastest[(size, preferred)]:
            choice = untried[0]  # the preferred count slowed down: is another faster now?
        elif n % self.explore_every == 0:
            others = [t for t in self.candidates if t != best]
            choice = others[(n // self.explore_every) % len(others)]
        self._exploring = (size, choice) if choice != best else None
        return choice

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        key = (num_tokens.bit_length(), threads)
        old = self._ema.get(key)
        explored, self._exploring = self._exploring == key, None
        # A count tried after a while: its old average is stale, the fresh time stands.
        self._ema[key] = seconds if old is None or explored else old + self.alpha * (seconds - old)
        self._fastest[key] = min(seconds, self._fastest.get(key, seconds))
