"""What one RPC may ask of the memory service (docs/security.md, "Limits").

Each is a flag of ``kvpager memory``; each is checked before the work it
bounds, and an RPC over one gets INVALID_ARGUMENT (a request too large to
take) or RESOURCE_EXHAUSTED (the registry is full) with a message naming the
flag. Why they exist: a pool is numbers here, but each block is an object
(2^22 blocks: ~600 MiB and seconds of the event loop to register), each fork
child a sequence with its own copy of the tokens (~17 KiB), and each
ScorePrefix executor id a walk of that executor's prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpager.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    max_pool_blocks: int = 1 << 22        # device or swap blocks of one executor
    max_total_blocks: int = 1 << 22       # device + swap blocks of all executors together
    max_executors: int = 64               # registered at once; also ScorePrefix's executor ids (distinct)
    max_executor_id_chars: int = 128
    max_name_chars: int = 256             # address, model id, dtype, adapter at registration
    max_fork_children: int = 1024         # children of all forks of one Step (or one Fork)
    max_watchers: int = 16                # WatchAccounting streams open at once
    min_watch_interval_ms: int = 100      # WatchAccounting's shortest interval
    snapshot_reuse_ms: int = 100          # watchers share one accounting snapshot this long

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


def check_name(value: str, field: str, limit: int, flag: str) -> None:
    """A name a peer registers (it ends up in logs and in other services' listings)."""
    if len(value) > limit:
        raise InvalidArgument(f"{field} has {len(value)} characters; the limit is {limit} ({flag})")
    if not value.isprintable():
        raise InvalidArgument(f"{field} must be printable")
