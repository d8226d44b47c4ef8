"""The mirror writer: KV events -> Redis, off the hot path.

One concept (hence one module past the usual size): the write-behind
writer's state machine — hooks, the flush loop, fencing by batch number,
failure and full resync share the shadow index and the per-executor batch
counters, and are only correct together.

The allocator appends events to the manager's EventQueue (no I/O). The
memory service's hooks (`on_step`, `on_register`, …) only set flags and wake
this task. Each wake-up, after a short coalescing window, the writer drains
the queue and sends everything in ONE pipelined round trip: one APPLY script
call per namespace (normally one), carrying a batch per executor.

Writes are absolute values fenced by the executor's incarnation and a
per-executor batch number (see scripts.py): a retried batch is a no-op, a gap
or a missing record makes the writer resync that executor fully.

The writer keeps a *shadow* of every pool's prefix index, built from the same
events (hash -> encoded record), so a full resync is a copy of a dict, not a
walk of the pools, and never needs Redis's old contents.

Redis down or slow: the Step path never notices. The writer marks the mirror
stale, keeps draining events into the shadow (so memory stays bounded), retries
with exponential backoff, and resyncs every executor once Redis answers again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio
from redis.backoff import ExponentialBackoff
from redis.exceptions import NoScriptError, RedisError

from kvpager.telemetry import get_logger
from memory_service.events import BlockRemoved, BlockStored, EventQueue, KVEvent
from memory_service.kv_manager import ExecutorSpec
from memory_service.mirror import metrics as m
from kvpager.prefix_index.ops import CLEARED_OP, ScriptCall, removed_op
from memory_service.mirror.records import namespace_of, op_of, spec_fields
from kvpager.prefix_index.client import make_async_client
from kvpager.prefix_index.keys import NAMESPACES_KEY, Namespace, redact
from kvpager.prefix_index.scripts import APPLY_SCRIPT
from memory_service.service_state import MemoryState, MirrorStatus

log = get_logger("memory_service.mirror")


@dataclass(slots=True)
class _Mirrored:
    """What Redis holds (or is being sent) for one executor."""

    ns: Namespace
    incarnation: int
    pool_generation: int


class MirrorWriter:
    """Write-behind of every pool's prefix index to Redis.

    Args:
        state: the memory service state; the writer installs itself as
            ``state.mirror``. Its manager's EventQueue must be enabled.
        redis_url: redis://[user:pass@]host:port/db (or pass ``client``).
        lease_s: how long an executor record stays live without renewal
            (default: the memory service's own expiry, lease_s * expiry_leases).
        window_s: coalescing window after a wake-up (5 ms: the mirror trails by that plus a round trip).
        retention_s: TTL of records and reverse indexes (renewed with the lease),
            so a namespace nobody writes any more does not live forever.
        chunk_blocks: most ops per batch (resyncs are sent in such chunks).
        gc_cap: most retired index entries cleaned per script call.
    """

    def __init__(self, state: MemoryState, redis_url: str | None = None, *,
                 client: redis.asyncio.Redis | None = None, username: str | None = None,
                 password: str | None = None, lease_s: float | None = None, window_s: float = 0.005,
                 retention_s: float = 3600.0, chunk_blocks: int = 2000, gc_cap: int = 2000,
                 socket_timeout_s: float = 2.0, backoff_cap_s: float = 2.0) -> None:
        if client is None and redis_url is None:
            raise ValueError("MirrorWriter needs redis_url or client")
        events = state.manager.events
        if not events.enabled:
            raise ValueError("the manager's EventQueue is disabled: build it with EventQueue(enabled=True)")
        self.state = state
        self.events: EventQueue = events
        self.url = redact(redis_url) if redis_url else "(client)"
        self.client = client or make_async_client(redis_url, username=username, password=password,
                                                  socket_timeout_s=socket_timeout_s, single_connection=True)
        self.lease_s = lease_s or state.lease_s * state.expiry_leases
        self.window_s = window_s
        self.retention_s = max(retention_s, self.lease_s * 2)
        self.chunk_blocks = chunk_blocks
        self.gc_cap = gc_cap
        self._backoff = ExponentialBackoff(cap=backoff_cap_s, base=0.05)

        self._shadow: dict[str, dict[bytes, bytes]] = {}     # executor -> hash -> S op
        self._pending: dict[str, list[bytes]] = {}           # executor -> ops not yet sent
        self._mirrored: dict[str, _Mirrored] = {}
        self._resync: set[str] = set()
        self._drops: dict[tuple[str, str], tuple[Namespace, int | None]] = {}
        self._renew: set[str] = set()
        self._batch: dict[str, int] = {}                     # last batch number given out
        # Step fencing: executor -> step_id of the latest Step whose plan gave it rows (what the
        # gateway executes there), and the executors whose step id is not in Redis yet.
        self._steps: dict[str, int] = {}
        self._step_dirty: set[str] = set()
        self._gc: dict[str, Namespace] = {}                  # namespaces with retired indexes left
        self._announced: set[str] = set()
        self._connected = False
        self._busy = False
        self._resyncing = False  # resync chunks in flight
        self._closing = False
        self._failures = 0
        self._next_attempt = 0.0
        self._applied_upto = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_resyncs = 0
        self.num_flushes = 0
        state.mirror = self

    # ---- hooks: called by MemoryState on the request path; O(1), no I/O -------------

    def on_step(self, step_id: int | None = None, executor_ids: Iterable[str] = ()) -> None:
        """After a Step (or Fork / Free: no step id). `executor_ids`: the
        executors whose plan of step `step_id` has rows. The next flush writes
        that step id into their records as `last_step_id` together with every
        event emitted so far (restart recovery compares it with ConfirmPool's)."""
        if step_id is not None:
            for eid in executor_ids:
                self._steps[eid] = step_id
                self._step_dirty.add(eid)
        self._wake.set()

    def restore_step(self, executor_id: str, step_id: int) -> None:
        """Recovery: the last_step_id the recovered record holds, so the rewrite keeps it."""
        self._steps[executor_id] = step_id
        self._step_dirty.add(executor_id)

    def on_register(self, spec: ExecutorSpec, replaced: bool) -> None:
        eid = spec.executor_id
        ns = namespace_of(spec)
        cur = self._mirrored.get(eid)
        if cur is not None and cur.ns != ns:  # same id, another model or block size
            self._drops[(cur.ns.tag, eid)] = (cur.ns, cur.incarnation)
            del self._mirrored[eid]
            cur = None
        same_pool = cur is not None and (cur.incarnation, cur.pool_generation) == (spec.incarnation,
                                                                                    spec.pool_generation)
        if same_pool and not replaced:
            self._renew.add(eid)  # the same pool again: refresh lease and address
        else:
            self._resync.add(eid)
            if not same_pool:  # a pool this process has planned nothing for yet
                self._steps.pop(eid, None)
        self._wake.set()

    def on_deregister(self, executor_id: str) -> None:
        self._resync.discard(executor_id)
        self._pending.pop(executor_id, None)
        self._steps.pop(executor_id, None)
        self._step_dirty.discard(executor_id)
        cur = self._mirrored.pop(executor_id, None)
        if cur is not None:
            self._drops[(cur.ns.tag, executor_id)] = (cur.ns, cur.incarnation)
        self._wake.set()

    def on_heartbeat(self, spec: ExecutorSpec) -> None:
        self._renew.add(spec.executor_id)
        self._wake.set()

    def forget(self, ns: Namespace, executor_id: str, incarnation: int | None) -> None:
        """Drop a record this process never registered (restart recovery)."""
        if executor_id not in self._mirrored:
            self._drops[(ns.tag, executor_id)] = (ns, incarnation)
            self._wake.set()

    # ---- status -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """The last Redis call succeeded."""
        return self._connected

    @property
    def stale(self) -> bool:
        """Redis is behind the in-process index in more than the usual lag."""
        return not self._connected or bool(self._resync) or self._resyncing

    @property
    def lag_events(self) -> int:
        return self.events.num_emitted - self._applied_upto

    def status(self) -> MirrorStatus:
        return MirrorStatus(enabled=True, stale=self.stale, lag_events=self.lag_events)

    def _synced(self) -> bool:
        return (self._connected and not self._busy and not self._resync and not self._pending
                and not self._step_dirty
                and not self._drops and not self._gc and not len(self.events)
                and self._applied_upto == self.events.num_emitted)

    async def sync(self, timeout_s: float = 10.0) -> None:
        """Wait until Redis reflects every event emitted so far (tests, shutdown).

        Raises:
            TimeoutError: not in sync within timeout_s.
        """
        deadline = time.monotonic() + timeout_s
        while not self._synced():
            if time.monotonic() > deadline:
                raise TimeoutError(f"mirror not in sync after {timeout_s:g}s (stale={self.stale}, "
                                   f"lag={self.lag_events})")
            self._wake.set()
            await asyncio.sleep(0.005)

    def resync_all(self) -> None:
        """Rebuild every executor's records from the shadow at the next flush."""
        self._resync |= set(self.state.manager.executors)
        self._wake.set()

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> MirrorWriter:
        """Start the task; a first connection attempt is made now (failure is fine)."""
        await self._connect()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvpager-mirror-writer")
        return self

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        """Flush what is queued (bounded), then stop and close the connection."""
        if self._task is not None and self._connected:
            try:
                await self.sync(flush_timeout_s)
            except TimeoutError:
                log.warning("mirror not flushed at stop", lag_events=self.lag_events)
        await self.abort()

    async def abort(self) -> None:
        """Stop at once without flushing (what a crash looks like to Redis)."""
        self._closing = True
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("mirror writer died", exc_info=task.exception())
        await self.client.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        renew_every = self.lease_s / 3
        next_renew = time.monotonic() + renew_every
        while not self._closing:
            wait_until = next_renew if self._connected else min(next_renew, self._next_attempt)
            if not self._wake.is_set():
                # A timer sets the same event: no wait_for, whose 3.11 form can
                # swallow a cancellation that races the wake-up.
                timer = loop.call_later(max(0.0, wait_until - time.monotonic()), self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
            self._wake.clear()
            if self.window_s:
                await asyncio.sleep(self.window_s)
            now = time.monotonic()
            if now >= next_renew:
                self._renew_live()
                next_renew = now + renew_every
            if not self._connected:
                self._absorb()  # keep memory bounded; a full resync follows the reconnect
                self._pending.clear()
                if now < self._next_attempt or not await self._connect():
                    continue
            try:
                await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the writer must outlive any Redis failure
                self._failed(exc)
            m.LAG_EVENTS.set(self.lag_events)
            m.STALE.set(1 if self.stale else 0)

    async def _connect(self) -> bool:
        try:
            await self.client.ping()
            await self.client.script_load(APPLY_SCRIPT.source)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return False
        if self._failures:
            log.info("mirror reconnected; resyncing", url=self.url, failures=self._failures)
        self._connected = True
        self._failures = 0
        self._announced.clear()
        self._resync |= set(self.state.manager.executors)
        return True

    def _failed(self, exc: BaseException) -> None:
        first = self._connected or self._failures == 0
        self._connected = False
        self._failures += 1
        self._next_attempt = time.monotonic() + self._backoff.compute(self._failures)
        self._pending.clear()
        self._announced.clear()
        self._resync |= set(self.state.manager.executors)
        self._resyncing = False
        m.ERRORS.labels("redis").inc()
        m.STALE.set(1)
        if first:
            log.warning("mirror stale: redis failed; serving from memory", url=self.url, error=repr(exc),
                        exc_info=not isinstance(exc, (RedisError, OSError)))

    def _renew_live(self) -> None:
        """Renew the lease of every executor whose heartbeats arrive (or that
        needs none: no address)."""
        limit = self.state.lease_s * self.state.expiry_leases
        for eid, kv in self.state.manager.executors.items():
            if eid not in self._mirrored:
                continue
            age = self.state.heartbeat_age_s(eid)
            if not kv.spec.address or (age is not None and age <= limit):
                self._renew.add(eid)

    # ---- the flush --------------------------------------------------------------------

    def _absorb(self) -> None:
        """Drain the event queue into the shadow and the pending batches."""
        events: list[KVEvent] = self.events.drain()
        if not events:
            return
        shadow, pending, mirrored, resync = self._shadow, self._pending, self._mirrored, self._resync
        for ev in events:
            eid = ev.executor_id
            kind = type(ev)
            if kind is BlockStored:
                op = op_of(ev)
                s = shadow.get(eid)
                if s is None:
                    s = shadow[eid] = {}
                s[ev.block_hash] = op
            elif kind is BlockRemoved:
                op = removed_op(ev.block_hash)
                s = shadow.get(eid)
                if s is not None:
                    s.pop(ev.block_hash, None)
            else:  # AllCleared
                op = CLEARED_OP
                shadow.pop(eid, None)
            if eid in mirrored and eid not in resync:
                ops = pending.get(eid)
                if ops is None:
                    pending[eid] = [op]
                else:
                    ops.append(op)

    def _next_batch(self, executor_id: str, n: int = 1) -> int:
        """Reserve n consecutive batch numbers; returns the first."""
        first = self._batch.get(executor_id, 0) + 1
        self._batch[executor_id] = first + n - 1
        return first

    def _chunks(self, ops: list[bytes]) -> list[list[bytes]]:
        c = self.chunk_blocks
        return [ops[i:i + c] for i in range(0, len(ops), c)] or [[]]

    async def _flush(self) -> None:
        self._busy = True
        try:
            await self._flush_once()
        finally:
            self._busy = False
            self._resyncing = False

    async def _flush_once(self) -> None:
        self._absorb()
        watermark = self.events.num_emitted
        executors = self.state.manager.executors
        calls: dict[str, ScriptCall] = {}

        def call(ns: Namespace) -> ScriptCall:
            c = calls.get(ns.tag)
            if c is None:
                c = calls[ns.tag] = ScriptCall(ns)
            return c

        drops, self._drops = self._drops, {}
        for (_, eid), (ns, inc) in drops.items():
            call(ns).drop(eid, inc)

        # Step fencing: an executor's last_step_id rides on its LAST batch of this flush (or on
        # its reset when nothing follows), so Redis never claims a step whose events it lacks.
        steps = self._steps
        dirty, self._step_dirty = self._step_dirty, set()
        jobs = []
        resync, self._resync = self._resync, set()
        for eid in sorted(resync):
            kv = executors.get(eid)
            if kv is None:
                continue
            spec = kv.spec
            ns = namespace_of(spec)
            snapshot = list(self._shadow.get(eid, {}).values())
            chunks = self._chunks(snapshot) if snapshot else []
            step = steps.get(eid, 0)
            call(ns).reset(eid, spec.incarnation, spec_fields(spec), self._next_batch(eid), None if chunks else step)
            if chunks:
                jobs.append((ns, eid, spec.incarnation, self._next_batch(eid, len(chunks)), chunks, True, step))
            self._mirrored[eid] = _Mirrored(ns, spec.incarnation, spec.pool_generation)
            self._pending.pop(eid, None)
            self.num_resyncs += 1
            m.RESYNCS.inc()

        pending, self._pending = self._pending, {}
        for eid in dirty:  # a step without events for it: an empty batch carries the step id
            if eid in self._mirrored and eid not in resync and eid not in pending:
                pending[eid] = []
        for eid, ops in pending.items():
            cur = self._mirrored[eid]
            step = steps.get(eid)
            first, *rest = self._chunks(ops)
            call(cur.ns).batch(eid, cur.incarnation, self._next_batch(eid), first, None if rest else step)
            if rest:  # a burst: the rest follows in calls of its own, so no call blocks Redis for long
                jobs.append((cur.ns, eid, cur.incarnation, self._next_batch(eid, len(rest)), rest, False, step))

        renew, self._renew = self._renew, set()
        for eid in renew:
            cur, kv = self._mirrored.get(eid), executors.get(eid)
            if cur is not None and kv is not None and kv.spec.incarnation == cur.incarnation:
                call(cur.ns).renew(eid, cur.incarnation, kv.spec.address)

        for tag, ns in self._gc.items():  # an empty call still cleans retired indexes
            call(ns)

        try:
            if calls:
                await self._send(list(calls.values()))
            self._resyncing = any(job[5] for job in jobs)
            for ns, eid, inc, first, chunks, _, step in jobs:
                for k, chunk in enumerate(chunks):
                    c = ScriptCall(ns)
                    c.batch(eid, inc, first + k, chunk, step if k == len(chunks) - 1 else None)
                    if not await self._send([c]):
                        break
        except BaseException:
            self._drops = {**drops, **self._drops}
            self._renew |= renew
            self._step_dirty |= dirty
            raise
        self.num_flushes += 1
        if not self._resync:
            self._applied_upto = watermark
        if self._gc:
            self._wake.set()

    async def _send(self, calls: list[ScriptCall]) -> bool:
        """One round trip: announce new namespaces, then one APPLY per call.
        Returns False when a section asks for a resync."""
        lease_ms, retention_ms = int(self.lease_s * 1000), int(self.retention_s * 1000)
        # A reset may follow a Redis that lost everything: announce its namespace again.
        fresh = [c.ns for c in calls if c.ns.tag not in self._announced or any(sec[0] == "R" for sec in c.sections)]
        for attempt in (0, 1):
            args = [(APPLY_SCRIPT.sha, 1, c.ns.executors, c.ns.prefix, lease_ms, retention_ms, self.gc_cap,
                     len(c.sections), *c.argv) for c in calls]
            try:
                if len(args) == 1 and not fresh:  # the usual flush: one command, no pipeline machinery
                    replies = [await self.client.evalsha(*args[0])]
                    break
                pipe = self.client.pipeline(transaction=False)
                for ns in fresh:
                    pipe.sadd(NAMESPACES_KEY, ns.tag)
                    pipe.hset(ns.meta, mapping={"model_id": ns.model_id, "block_size": ns.block_size,
                                                "hash_version": ns.hash_version})
                for a in args:
                    pipe.evalsha(*a)
                replies = await pipe.execute()
                break
            except NoScriptError:  # SCRIPT FLUSH or a fresh server on the same connection
                if attempt:
                    raise
                await self.client.script_load(APPLY_SCRIPT.source)
        self._announced.update(ns.tag for ns in fresh)
        m.BATCHES.inc(len(calls))
        ok = True
        for c, reply in zip(calls, replies[2 * len(fresh):]):
            *statuses, gc_left = reply
            if int(gc_left):
                self._gc[c.ns.tag] = c.ns
            else:
                self._gc.pop(c.ns.tag, None)
            for (kind, eid, inc, nops), status in zip(c.sections, statuses):
                status = status.decode() if isinstance(status, bytes) else status
                if status == "ok":
                    if kind == "B":
                        m.EVENTS_APPLIED.inc(nops)
                    continue
                if status == "dup" or kind == "D":
                    continue
                # gap / missing / stale: Redis disagrees with us about this executor
                m.ERRORS.labels(status).inc()
                kv = self.state.manager.executors.get(eid)
                if kv is not None and kv.spec.incarnation == inc:
                    log.warning("mirror batch refused; resyncing executor", executor_id=eid, kind=kind,
                                status=status)
                    self._resync.add(eid)
                    ok = False
        return ok
