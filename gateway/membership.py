"""The executors the gateway routes to, as the memory service lists them.

Joins and departures come from the memory service's registry
(``ListExecutors``, re-read every ``executor_refresh_s`` by a task of its
own): a new listing reports those that left or restarted (another
incarnation or address) and starts joining new ones; the engine then ends
the departed executors' requests. Joining (connecting and the executor's own
``GetInfo``, which gives the limits a request is validated against: context
length, vocabulary, eos ids) runs in its own task per executor with a short
deadline, never on the engine loop: an executor that does not answer is
retried later with a backoff that doubles per address, and the loop only
ever takes finished joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

from kvpager.errors import KvpagerError
from kvpager.log_limits import LogLimiter, clip
from kvpager.telemetry import get_logger
from kvpager.v1 import executor_pb2, memory_pb2
from gateway.clients import ExecutorClient, MemoryClient
from gateway.params import Limits, RequestCaps

log = get_logger("gateway.membership")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0


def _key(pool: memory_pb2.ExecutorPoolInfo) -> tuple[str, str, int]:
    return pool.executor_id, pool.address, pool.incarnation


class Executors:
    """Live executor clients by id (a read-only mapping for routing and info)."""

    def __init__(self, memory: MemoryClient, *, max_n: int, max_prompt_tokens: int, tls=None,
                 token: str | None = None, caps: RequestCaps | None = None, info_timeout_s: float = 2.0,
                 on_join: Callable[[], None] | None = None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.memory = memory
        self.max_n = max_n
        self.max_prompt_tokens = max_prompt_tokens
        self.stream_interval = stream_interval
        self.caps = caps or RequestCaps()
        self.info_timeout_s = info_timeout_s
        self._tls = tls            # ClientTls for Execute channels (None = insecure)
        self._token = token        # the admin token executors require
        self._on_join = on_join or (lambda: None)  # wakes the engine loop: a listing or a join to apply
        self.clients: dict[str, ExecutorClient] = {}
        self.limits: Limits | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.model_id = ""
        self._listing: dict[str, memory_pb2.ExecutorPoolInfo] = {}
        self._new_listing = False
        self._joining: dict[tuple, asyncio.Task] = {}
        self._joined: list[ExecutorClient] = []
        self._retry: dict[tuple, tuple[float, float]] = {}  # pool key -> (next attempt, monotonic; delay s)
        self._warnings = LogLimiter(30.0)
        self.memory_step_id = 0  # the memory service's last applied Step, as of the latest listing

    # mapping view
    def __getitem__(self, executor_id: str) -> ExecutorClient:
        return self.clients[executor_id]

    def __contains__(self, executor_id: str) -> bool:
        return executor_id in self.clients

    def __iter__(self) -> Iterator[str]:
        return iter(self.clients)

    def __len__(self) -> int:
        return len(self.clients)

    def get(self, executor_id: str) -> ExecutorClient | None:
        return self.clients.get(executor_id)

    def items(self):
        return self.clients.items()

    def values(self):
        return self.clients.values()

    @property
    def ready(self) -> bool:
        return self.limits is not None and any(e.alive for e in self.clients.values())

    # ---- changes ----------------------------------------------------------------------

    async def refresh(self, interval_s: float, now: asyncio.Event) -> None:
        """The registry, re-read every ``interval_s`` (or when ``now`` is set) by
        a task of its own: joins run in their own tasks, and the engine loop
        applies a listing (and finished joins) without waiting."""
        warnings = LogLimiter(30.0)
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(now.wait(), interval_s)
            now.clear()
            try:
                registry = await self.memory.registry()
                self.memory_step_id = registry.last_step_id
                self.listed(list(registry.executors))
                self._on_join()
            except Exception as exc:  # noqa: BLE001 - the refresh task must outlive any one listing
                warnings.log(log.warning, "refresh", "executor refresh failed",
                             error=clip(exc.message if isinstance(exc, KvpagerError) else repr(exc)))

    def listed(self, pools: list[memory_pb2.ExecutorPoolInfo]) -> None:
        """A new listing (the refresh task): applied by the loop's next ``apply``;
        executors not known yet start joining now, each in its own task."""
        self._listing = {p.executor_id: p for p in pools}
        self._new_listing = True
        now = time.monotonic()
        for pool in pools:
            key = _key(pool)
            ex = self.clients.get(pool.executor_id)
            if (not pool.address or key in self._joining or (ex is not None and _key(ex.pool) == key)
                    or self._retry.get(key, (0.0, 0.0))[0] > now):
                continue
            self._joining[key] = asyncio.get_running_loop().create_task(self._join(pool))
        for key in [k for k in self._retry if self._listing.get(k[0]) is None or _key(self._listing[k[0]]) != k]:
            del self._retry[key]  # gone from the registry: forget its backoff

    async def _join(self, pool: memory_pb2.ExecutorPoolInfo) -> None:
        key = _key(pool)
        ex = ExecutorClient(pool, tls=self._tls, token=self._token)
        try:
            await ex.load_info(self.info_timeout_s)
        except Exception as exc:  # noqa: BLE001 - unreachable, refused, malformed: retried later either way
            delay = min(self._retry.get(key, (0.0, BACKOFF_FIRST_S / 2))[1] * 2, BACKOFF_MAX_S)
            self._retry[key] = (time.monotonic() + delay, delay)
            self._warnings.log(log.warning, key, "executor unreachable", executor_id=clip(pool.executor_id),
                               address=clip(pool.address), error=clip(getattr(exc, "message", repr(exc))),
                               retry_in_s=delay)
            await ex.close()
            return
        finally:
            self._joining.pop(key, None)
        self._retry.pop(key, None)
        self._joined.append(ex)
        self._on_join()

    async def wait_joins(self) -> None:
        """Until the joins started so far are done (start-up only: never on the loop)."""
        if self._joining:
            await asyncio.gather(*self._joining.values(), return_exceptions=True)

    @property
    def has_updates(self) -> bool:
        return self._new_listing or bool(self._joined)

    def apply(self) -> list[ExecutorClient]:
        """Take the latest listing and the finished joins (the engine loop; no
        waiting). Returns the executors that left or restarted (removed here;
        the caller ends their requests)."""
        gone = []
        if self._new_listing:
            self._new_listing = False
            for ex in list(self.clients.values()):
                pool = self._listing.get(ex.executor_id)
                if pool is None or _key(pool) != _key(ex.pool):
                    self.remove(ex)
                    gone.append(ex)
        joined, self._joined = self._joined, []
        for ex in joined:
            pool = self._listing.get(ex.executor_id)
            if pool is None or _key(pool) != _key(ex.pool) or ex.executor_id in self.clients:
                asyncio.get_running_loop().create_task(ex.close())  # left (or replaced) while it joined
                continue
            self.clients[ex.executor_id] = ex
            self._set_limits(ex.info)
            log.info("executor joined", executor_id=clip(ex.executor_id), address=clip(ex.address),
                     model=clip(ex.info.model_id))
        return gone

    def remove(self, ex: ExecutorClient) -> None:
        ex.alive = False
        if self.clients.get(ex.executor_id) is ex:
            del self.clients[ex.executor_id]

    async def reregister_missing(self, pools: list[memory_pb2.ExecutorPoolInfo]) -> None:
        """After the memory service lost its registry (a cold restart): register
        again those of ``pools`` (the executors served through before the loss,
        as they last registered) that it does not list and that still hold
        that pool (their GetInfo: same incarnation and generation) and are SERVING.
        The same incarnation and generation make it a no-op for one that
        re-registered itself meanwhile (its own heartbeats go on); it spares
        the streams waiting for them a heartbeat period. A draining executor
        (NOT_SERVING) is left alone."""
        try:
            listed = {p.executor_id for p in await self.memory.list_executors()}
        except KvpagerError:
            return  # still down: the next failed Step tries again
        registered = 0
        for pool in pools:
            if pool.executor_id in listed:
                continue
            probe = ExecutorClient(pool, tls=self._tls, token=self._token)
            try:
                try:
                    info = await probe.load_info(self.info_timeout_s)
                except KvpagerError:
                    continue  # down: it registers itself when (if) it comes back
                # Only the very pool it registered (a new process there registers itself), and not draining.
                if (info.executor_id, info.incarnation, info.pool_generation) != (
                        pool.executor_id, pool.incarnation, pool.pool_generation) or not await probe.serving():
                    continue
                await self.memory.register(pool)
                registered += 1
                log.info("executor registered again for the memory service", executor_id=clip(pool.executor_id))
            except KvpagerError as exc:
                self._warnings.log(log.warning, "reregister", "registering an executor again failed",
                                   executor_id=clip(pool.executor_id), error=clip(exc.message))
            finally:
                await probe.close()
        if registered:  # join them now, not at the next periodic refresh
            with contextlib.suppress(KvpagerError):
                self.listed(await self.memory.list_executors())
                self._on_join()

    async def deregister(self, ex: ExecutorClient) -> None:
        """Tell the memory service a lost executor is gone (it releases every block it held)."""
        try:
            await self.memory.deregister(ex.executor_id, ex.incarnation)
        except KvpagerError as exc:  # already gone or re-registered: its blocks are released either way
            log.info("deregister after executor loss", executor_id=clip(ex.executor_id), result=exc.status)
        await ex.close()

    async def close(self) -> None:
        for task in list(self._joining.values()):
            task.cancel()
        for ex in [*self.clients.values(), *self._joined]:
            await ex.close()

    def _set_limits(self, info: executor_pb2.ExecutorInfo) -> None:
        alive = [e.info for e in self.clients.values() if e.alive and e.info is not None]
        max_len = min(i.max_model_len for i in alive)
        self.limits = Limits(max_model_len=max_len, vocab_size=info.vocab_size, max_n=self.max_n,
                             max_prompt_tokens=self.max_prompt_tokens, caps=self.caps,
                             stream_interval=self.stream_interval)
        self.eos_ids = frozenset(info.eos_token_ids)
        self.model_id = info.model_id
