"""How a CPU executor uses its machine: the intra-op thread count of each
step, chosen from measured step times, and which core each of the step's
threads runs on (the allocator's settings: cpu_allocator)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import torch

from kvpager.telemetry import get_logger

log = get_logger(__name__)

# Set by a user who places OpenMP threads themselves: the executor then binds nothing.
AFFINITY_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def allowed_cores() -> tuple[int, ...]:
    """The CPUs this process may run on, in order."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


MAX_CPU = 1 << 16  # a CPU list names none at or past this (no machine has them; a typo must not expand)


def parse_cores(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6), sorted, each once. Raises ValueError on anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r}: expected CPU numbers and ranges, e.g. 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{text!r}: range {part.strip()} runs backwards")
        if last >= MAX_CPU:
            raise ValueError(f"{text!r}: CPU {last} is past {MAX_CPU - 1}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def restrict_to_cores(cores: tuple[int, ...]) -> None:
    """Limit this whole process to ``cores``: every thread it has now, and (inherited) every
    thread it starts later; ``allowed_cores`` answers them from then on."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def thread_candidates() -> tuple[int, ...]:
    """Intra-op thread counts a CPU executor chooses between, the preferred
    first: every core this process may run on, then one fewer (left to the
    control plane). An explicit OMP_NUM_THREADS fixes the count."""
    if os.environ.get("OMP_NUM_THREADS"):
        return (torch.get_num_threads(),)
    cores = len(allowed_cores())
    return (cores, cores - 1) if cores > 1 else (1,)


BindTeam = Callable[[int, list[int], bool], list[int]]  # (threads, cpus, spread) -> errno per team thread


def bind_team_op() -> BindTeam | None:
    """The C++ op that sets the affinity of the calling thread's OpenMP team
    (``kvpager_kernels/cpu/threads.cpp``), or None where the kernels are off."""
    from kvpager_kernels import cpu_build

    return torch.ops.kvpager_cpu.bind_team if cpu_build.available() else None


class CoreBinding:
    """Sets the intra-op thread count of each step and, while a step's team
    uses every allowed core, binds it one thread per core.

    An executor idles between requests, and a lone request that wakes it
    often ran its two threads no faster than one (likely: Linux places the
    woken OpenMP worker on the waker's core, and the two share it until the
    load balancer moves one). Measured on the 2-core EPYC (30M Llama, bf16,
    a lone 149-token prefill every 0.5 s, two stacks alternated): unbound,
    9 of 24 forwards took 16-35 ms where the rest took 10-13; bound, all 24
    took 10.2-13.1.
    A team on fewer cores (the thread tuner's answer to other load) is
    unbound again, so the system can move it off a busy core. Nothing is
    bound when the user places OpenMP threads themselves (``AFFINITY_ENV``),
    when the team is not as wide as the allowed cores (several executors
    share them), or with ``enabled`` False.

    ``use`` must run on the thread that runs the steps: an OpenMP team
    belongs to the thread that starts it.
    """

    def __init__(self, cores: tuple[int, ...], enabled: bool = True, bind: BindTeam | None = None) -> None:
        self.cores = cores
        self.enabled = (enabled and len(cores) > 1 and bind is not None
                        and not any(os.environ.get(k) for k in AFFINITY_ENV))
        self._bind = bind
        self._bound_on: int | None = None  # the thread whose team is bound

    @property
    def bound(self) -> bool:
        return self._bound_on == threading.get_native_id()

    def use(self, threads: int) -> None:
        current = torch.get_num_threads()
        if self.bound and threads != len(self.cores):
            self._bind(current, list(self.cores), False)  # free again, before the team shrinks
            self._bound_on = None
        if threads != current:
            torch.set_num_threads(threads)
        if self.enabled and threads == len(self.cores) and not self.bound:
            try:
                errors = list(self._bind(threads, list(self.cores), True))
            except RuntimeError as exc:  # a CPU number the op cannot express (past CPU_SETSIZE)
                errors = [str(exc)]
            if any(errors):
                self.enabled = False
                log.warning("could not bind the step threads to cores; they run unbound", cores=list(self.cores),
                            errors=errors)
                with contextlib.suppress(RuntimeError):
                    self._bind(threads, list(self.cores), False)
            else:
                self._bound_on = threading.get_native_id()


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
    powers of two), in seconds per token (a class's steps differ in size up
    to twice). A class starts on the preferred count (the first
    candidate) and tries the others only when there is a reason: the
    preferred count's steps became slower than the fastest it has shown
    (``slowdown``, its average and its latest step: the load changed), or,
    rarely (every ``explore_every``-th step), to notice a change the times
    alone cannot show (the load went away while fewer threads run, or it
    was there from the start; when one class finds the load gone, every
    class off the preferred count rechecks it at its next step). An
    exploring step of a slower count costs up to twice a step, so on a quiet
    machine nearly every step runs on every core, and each exploration that
    finds the preferred count still best doubles the wait for the next (up
    to ``quiet_backoff`` times ``explore_every``; a decode class meets 64
    steps every round of 64 tokens).

    Two things keep noise from moving a class off the preferred count (on
    the 2-core EPYC, 3 of every round's 67 steps ran on one thread, each up
    to 1.6x slower): the first step of each token count on each thread count
    is not timed (oneDNN builds its kernels for a new shape then: that step
    took 28 ms where the next took 12), and another count is chosen only
    when it is clearly faster (``margin``: its average below that fraction
    of the preferred count's; load makes it 3-6x faster, noise a few %).
    """

    def __init__(self, candidates: tuple[int, ...], explore_every: int = 64, slowdown: float = 1.3,
                 alpha: float = 0.3, margin: float = 0.85, quiet_backoff: int = 8) -> None:
        self.candidates = tuple(dict.fromkeys(candidates))
        self.explore_every = explore_every
        self.slowdown = slowdown
        self.alpha = alpha
        self.margin = margin
        self.quiet_backoff = quiet_backoff
        self._ema: dict[tuple[int, int], float] = {}   # (size class, threads) -> seconds per token
        self._fastest: dict[tuple[int, int], float] = {}
        self._latest: dict[tuple[int, int], float] = {}  # its last timed step
        self._seen: dict[int, int] = {}                # steps per size class
        self._exploring: tuple[int, int] | None = None  # the (class, threads) a choice went to try
        self._warm: set[tuple[int, int]] = set()       # (tokens, threads) run once already
        self._retry: dict[int, int] = {}               # class -> a count its next step tries (see record)
        self._retried: set[int] = set()                # classes whose last exploration was retried
        self._last: dict[int, int] = {}                # class -> its step count at its last exploration
        self._period: dict[int, int] = {}              # class -> steps from one exploration to the next
        self._explorations: dict[int, int] = {}

    def _best(self, size: int) -> int:
        """The preferred count unless a measured other is clearly faster."""
        preferred = self.candidates[0]
        bar = self.margin * self._ema[(size, preferred)]
        faster = [t for t in self.candidates[1:] if self._ema.get((size, t), bar) < bar]
        return min(faster, key=lambda t: self._ema[(size, t)]) if faster else preferred

    def choose(self, num_tokens: int) -> int:
        preferred = self.candidates[0]
        if len(self.candidates) == 1:
            return preferred
        size = num_tokens.bit_length()
        n = self._seen.get(size, 0)
        self._seen[size] = n + 1
        retry = self._retry.pop(size, None)
        if retry is not None:  # an exploration untimed (a warm-up): once more, timed if its shape repeats
            self._exploring = (size, retry)
            return retry
        if (size, preferred) not in self._ema:
            return preferred
        best = self._best(size)
        untried = [t for t in self.candidates if (size, t) not in self._ema]
        choice = best
        period = self._period.get(size, self.explore_every) if best == preferred else self.explore_every
        bar = self.slowdown * self._fastest[(size, preferred)]
        # Slowed down: its average and its latest step (an average still falling
        # after one slow step, the latest the fastest yet, is not load).
        if untried and self._ema[(size, preferred)] > bar and self._latest[(size, preferred)] > bar:
            choice = untried[0]  # the preferred count slowed down: is another faster now?
            self._period[size] = self.explore_every
        elif n - self._last.get(size, 0) >= period:
            others = [t for t in self.candidates if t != best]
            k = self._explorations.get(size, 0)
            self._explorations[size] = k + 1
            choice = others[k % len(others)]
            self._last[size] = n
            # Each exploration from the preferred count that finds it still best
            # waits twice as long for the next (up to ``quiet_backoff`` times).
            self._period[size] = (min(2 * period, self.quiet_backoff * self.explore_every) if best == preferred
                                  else self.explore_every)
        self._exploring = (size, choice) if choice != best else None
        return choice

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        size = num_tokens.bit_length()
        # Per token: a class spans twice the tokens from its smallest step to its
        # largest, so raw step times would compare a count timed on small steps
        # with one timed on large ones (a 232-token step timed on two threads
        # under load, a 149-token one on one thread quiet: one thread won and
        # every lone 149-token prefill then ran on it, 41 ms against 23).
        seconds /= max(num_tokens, 1)
        key = (size, threads)
        explored, self._exploring = self._exploring == key, None
        if (num_tokens, threads) not in self._warm:
            self._warm.add((num_tokens, threads))
            if explored and size not in self._retried:
                self._retry[size] = threads
                self._retried.add(size)
            return
        self._retried.discard(size)
        old = self._ema.get(key)
        preferred = self.candidates[0]
        was_off = explored and threads == preferred and self._best(size) != preferred
        # A count tried after a while: its old average is stale, the fresh time stands.
        self._ema[key] = seconds if old is None or explored else old + self.alpha * (seconds - old)
        self._fastest[key] = min(seconds, self._fastest.get(key, seconds))
        self._latest[key] = seconds
        if was_off and self._best(size) == preferred:
            # The load went away (it is the machine's, not a class's): every class
            # still off the preferred count tries it on its next step instead of
            # waiting out its own period (``explore_every`` steps of that class;
            # a class of lone prefills meets 64 steps only after 64 requests).
            for other in self._seen:
                if other != size and (other, preferred) in self._ema and self._best(other) != preferred:
                    self._retry.setdefault(other, preferred)
