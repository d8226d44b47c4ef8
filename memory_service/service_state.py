"""The memory service's process state around the pure manager: executor
leases, metrics, and the hook the Redis mirror hangs on. No grpc here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvpager.errors import FailedPrecondition, NotFound, Unavailable
from kvpager.log_limits import LogLimiter, clip
from kvpager.telemetry import get_logger
from memory_service.costs import ExecutorCosts
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.metrics import COLLECTORS, STEP_LATENCY, STEP_SEQS, AccountingCollector
from memory_service.records import PrefixScore, StepInput, StepOutput

log = get_logger("memory_service")



@dataclass(slots=True)
class MirrorStatus:
    enabled: bool = False
    stale: bool = False
    lag_events: int = 0


class MemoryState:
    """Owns the MemoryManager for one process. Executors that serve an address
    must heartbeat; one silent for `expiry_leases` leases is dropped and every
    block it held is released."""

    def __init__(self, manager: MemoryManager | None = None, lease_s: float = 5.0,
                 expiry_leases: float = 3.0) -> None:
        self.manager = manager or MemoryManager()
        self.lease_s = lease_s
        self.expiry_leases = expiry_leases
        self._last_seen: dict[str, float] = {}
        self._warnings = LogLimiter(30.0)
        self.mirror = None  # set by the Redis mirror when enabled
        # Rebuilding from the mirror (MemoryServer.start): Steps are refused, since a block
        # allocated, written and freed meanwhile could be restored with the hash of what it held.
        self._recovered = asyncio.Event()
        self._recovered.set()
        self._last_logged: StepOutput | None = None  # the last output whose preemptions were logged
        self._collector = AccountingCollector(self)
        COLLECTORS.attach(self._collector)

    def close(self) -> None:
        COLLECTORS.detach(self._collector)

    @property
    def recovering(self) -> bool:
        return not self._recovered.is_set()

    @recovering.setter
    def recovering(self, value: bool) -> None:
        if value:
            self._recovered.clear()
        else:
            self._recovered.set()

    async def until_recovered(self) -> None:
        """Returns once no rebuild from the mirror is running. Registrations
        wait for it: an executor registered meanwhile has an empty pool here,
        and the mirror writer would reset that executor's record in Redis
        (its reverse index included) while recovery is still to read it."""
        await self._recovered.wait()

    # executors
    def register_executor(self, spec: ExecutorSpec, costs: ExecutorCosts | None = None) -> bool:
        replaced = self.manager.register_executor(spec, costs)
        self._last_seen[spec.executor_id] = time.monotonic()
        log.info("executor registered", executor_id=spec.executor_id, num_blocks=spec.num_blocks,
                 block_size=spec.block_size, incarnation=spec.incarnation, replaced=replaced)
        if self.mirror is not None:
            self.mirror.on_register(spec, replaced)
        return replaced

    def deregister_executor(self, executor_id: str, incarnation: int = 0) -> int:
        dropped = self.manager.deregister_executor(executor_id, incarnation)
        self._last_seen.pop(executor_id, None)
        log.info("executor deregistered", executor_id=executor_id, sequences_dropped=dropped)
        if self.mirror is not None:
            self.mirror.on_deregister(executor_id)
        return dropped

    def heartbeat(self, executor_id: str, incarnation: int, costs: ExecutorCosts | None = None) -> None:
        kv = self.manager.executors.get(executor_id)
        if kv is None:
            raise NotFound(f"unknown executor {clip(executor_id)!r}: register first")
        if incarnation and kv.spec.incarnation != incarnation:
            raise FailedPrecondition(f"executor {clip(executor_id)!r} is registered at incarnation "
                                     f"{kv.spec.incarnation}, not {incarnation}")
        self._last_seen[executor_id] = time.monotonic()
        self.manager.update_costs(executor_id, costs)
        if self.mirror is not None:
            self.mirror.on_heartbeat(kv.spec)

    def heartbeat_age_s(self, executor_id: str, now: float | None = None) -> float | None:
        """Seconds since the executor last registered or heartbeat (None: unknown)."""
        seen = self._last_seen.get(executor_id)
        if seen is None:
            return None
        return (time.monotonic() if now is None else now) - seen

    def excuse_stall(self, stalled_s: float) -> None:
        """The service did not run for ``stalled_s`` (its reaper woke that late):
        no executor's lease runs for that time (its heartbeats could not be read).
        A late wake-up under 50 ms is scheduling noise."""
        if stalled_s < 0.05:
            return
        for eid in self._last_seen:
            self._last_seen[eid] += stalled_s
        if stalled_s >= 1.0:
            self._warnings.log(log.warning, "stall", "memory service stalled: leases extended",
                               stalled_s=round(stalled_s, 2))

    def reap_expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        limit = self.lease_s * self.expiry_leases
        dead = [eid for eid, kv in self.manager.executors.items()
                if kv.spec.address and now - self._last_seen.get(eid, now) > limit]
        for eid in dead:
            log.warning("executor lease expired", executor_id=eid, silent_s=round(now - self._last_seen[eid], 1))
            self.deregister_executor(eid)
        return dead

    # the hot path
    def step(self, step: StepInput) -> StepOutput:
        if self.recovering:
            raise Unavailable("rebuilding the prefix cache from the mirror; retry")
        t0 = time.perf_counter()
        out = self.manager.step(step)
        STEP_LATENCY.observe(time.perf_counter() - t0)
        STEP_SEQS.inc(len(step.schedule_seq_ids))
        if out.decisions and out is not self._last_logged:  # a retried step returns the same output
            self._last_logged = out
            for d in out.decisions:
                e = d.estimate
                log.info("preempted", seq_id=d.seq_id, mode=d.mode.value, reason=d.reason,
                         recompute_tokens=e.recompute_tokens, recompute_s=e.recompute_s, swap_bytes=e.swap_bytes,
                         swap_s=e.swap_total_s, unshared_blocks=e.unshared_blocks, freed_blocks=e.freed_blocks)
        if self.mirror is not None:
            # Step fencing: the executors the gateway will Execute this step on (a plan with rows).
            self.mirror.on_step(step.step_id, [p.executor_id for p in out.executor_plans if len(p.seq_ids)])
        return out

    def fork(self, parent_id: int, child_ids: list[int]) -> int:
        shared = self.manager.fork(parent_id, child_ids)
        if self.mirror is not None:
            self.mirror.on_step()
        return shared

    def free(self, seq_ids: list[int], abort: bool) -> int:
        released = self.manager.free(seq_ids, abort)
        if self.mirror is not None:
            self.mirror.on_step()
        return released

    def score_prefix(self, token_ids, cache_salt: str, executor_ids: Iterable[str]) -> list[PrefixScore]:
        return self.manager.score_prefix(token_ids, cache_salt, executor_ids)

    def score_prefix_hashes(self, block_hashes: list[bytes], namespace: bytes,
                            executor_ids: Iterable[str]) -> list[PrefixScore]:
        return self.manager.score_prefix_hashes(block_hashes, namespace, executor_ids)

    def mirror_status(self) -> MirrorStatus:
        if self.mirror is None:
            return MirrorStatus()
        return self.mirror.status()
