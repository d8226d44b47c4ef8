"""The executors the gateway routes to, as the memory service lists them.

Joins and departures come from the memory service's registry
(``ListExecutors``, re-read every ``executor_refresh_s``): a new listing
connects to new executors and reports those that left or restarted (another
incarnation or address); the engine then ends their requests. The limits a
request is validated against (context length, vocabulary, eos ids) come
from the executors' own ``GetInfo``.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpager.errors import KvpagerError
from kvpager.telemetry import get_logger
from kvpager.v1 import executor_pb2, memory_pb2
from gateway.clients import ExecutorClient, MemoryClient
from gateway.params import Limits

log = get_logger("gateway.membership")


class Executors:
    """Live executor clients by id (a read-only mapping for routing and info)."""

    def __init__(self, memory: MemoryClient, *, max_n: int, max_prompt_tokens: int, tls=None,
                 token: str | None = None) -> None:
        self.memory = memory
        self.max_n = max_n
        self.max_prompt_tokens = max_prompt_tokens
        self._tls = tls            # ClientTls for Execute channels (None = insecure)
        self._token = token        # the admin token executors require
        self.clients: dict[str, ExecutorClient] = {}
        self.limits: Limits | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.model_id = ""

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

    async def apply(self, pools: list[memory_pb2.ExecutorPoolInfo]) -> list[ExecutorClient]:
        """Connect to newly listed executors; returns the ones that left or
        restarted (removed here; the caller ends their requests)."""
        listed = {p.executor_id: p for p in pools}
        gone = []
        for executor_id, ex in list(self.clients.items()):
            pool = listed.get(executor_id)
            if pool is None or pool.incarnation != ex.incarnation or pool.address != ex.address:
                self.remove(ex)
                gone.append(ex)
        for executor_id, pool in listed.items():
            if executor_id in self.clients or not pool.address:
                continue
            ex = ExecutorClient(pool, tls=self._tls, token=self._token)
            try:
                info = await ex.load_info()
            except KvpagerError as exc:
                log.warning("executor unreachable", executor_id=executor_id, error=exc.message)
                await ex.close()
                continue
            self.clients[executor_id] = ex
            self._set_limits(info)
            log.info("executor joined", executor_id=executor_id, address=pool.address, model=info.model_id)
        return gone

    def remove(self, ex: ExecutorClient) -> None:
        ex.alive = False
        if self.clients.get(ex.executor_id) is ex:
            del self.clients[ex.executor_id]

    async def deregister(self, ex: ExecutorClient) -> None:
        """Tell the memory service a lost executor is gone (it releases every block it held)."""
        try:
            await self.memory.deregister(ex.executor_id, ex.incarnation)
        except KvpagerError as exc:  # already gone or re-registered: its blocks are released either way
            log.info("deregister after executor loss", executor_id=ex.executor_id, result=exc.status)
        await ex.close()

    async def close(self) -> None:
        for ex in self.clients.values():
            await ex.close()

    def _set_limits(self, info: executor_pb2.ExecutorInfo) -> None:
        alive = [e.info for e in self.clients.values() if e.alive and e.info is not None]
        max_len = min(i.max_model_len for i in alive)
        self.limits = Limits(max_model_len=max_len, vocab_size=info.vocab_size, max_n=self.max_n,
                             max_prompt_tokens=self.max_prompt_tokens)
        self.eos_ids = frozenset(info.eos_token_ids)
        self.model_id = info.model_id
