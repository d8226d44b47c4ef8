"""Prefix scoring from the mirror, for routers that do not run a memory service.

    reader = PrefixReader("redis://127.0.0.1:6379/0", model_id="m", block_size=16, dtype="float16")
    reader.score(token_ids)            # {"e0": 12, "e1": 0}: leading full blocks each live executor holds

The chained block hashes are computed here (memory_service.prefix_hash: the
same bytes the memory service hashes), then ONE server-side script call walks
them: bounded by `max_blocks`, it skips executors whose lease expired and
block fields of an older incarnation. Advisory: the memory service verifies
token ids on every hit, so a router acting on a stale score only loses a hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from memory_service.mirror import metrics as m
from memory_service.mirror.client import make_async_client, make_client
from memory_service.mirror.keys import Namespace
from memory_service.mirror.scripts import SCORE_SCRIPT
from memory_service.prefix_hash import hash_blocks, namespace_digest, root_hash

MAX_BLOCKS = 512


class _Scoring:
    """The pure part: hashes and script arguments in, scores out."""

    def __init__(self, model_id: str, block_size: int, dtype: str, adapter: str, max_blocks: int) -> None:
        if not 0 < max_blocks <= MAX_BLOCKS:
            raise ValueError(f"max_blocks must be in 1..{MAX_BLOCKS}")
        self.ns = Namespace(model_id, block_size)
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._namespace_root = namespace_digest(model_id, block_size, dtype, adapter)

    def args(self, token_ids: Sequence[int], cache_salt: str, executor_ids: Iterable[str]) -> list:
        root = root_hash(self._namespace_root, cache_salt)
        hashes = hash_blocks(root, token_ids, self.block_size, limit=self.max_blocks)
        wanted = list(executor_ids)
        return [SCORE_SCRIPT.sha, 1, self.ns.executors, self.ns.prefix, self.max_blocks, len(wanted),
                *wanted, b"".join(hashes).hex()]

    @staticmethod
    def parse(reply: list) -> dict[str, int]:
        it = iter(reply)
        return {(e.decode() if isinstance(e, bytes) else e): int(n) for e, n in zip(it, it)}


class PrefixReader:
    """Blocking reader (one Redis round trip per score).

    Args:
        redis_url: the mirror's Redis (credentials in the URL or KVPAGER_REDIS_USERNAME/PASSWORD).
        model_id, block_size, dtype, adapter: the executors' hash namespace, exactly
            as they register it.
        max_blocks: most leading blocks looked at (<= 512).
    """

    def __init__(self, redis_url: str | None = None, *, model_id: str, block_size: int, dtype: str,
                 adapter: str = "", max_blocks: int = MAX_BLOCKS, client: redis.Redis | None = None,
                 username: str | None = None, password: str | None = None) -> None:
        self._scoring = _Scoring(model_id, block_size, dtype, adapter, max_blocks)
        self.client = client or make_client(redis_url, username=username, password=password)

    def score(self, token_ids: Sequence[int], cache_salt: str = "",
              executor_ids: Iterable[str] = ()) -> dict[str, int]:
        """{executor_id: consecutive leading full blocks held} for every live
        executor (or only `executor_ids`)."""
        t0 = time.perf_counter()
        args = self._scoring.args(token_ids, cache_salt, executor_ids)
        try:
            reply = self.client.execute_command("EVALSHA", *args)
        except NoScriptError:
            self.client.script_load(SCORE_SCRIPT.source)
            reply = self.client.execute_command("EVALSHA", *args)
        m.SCORE_LOOKUPS.inc()
        m.SCORE_LATENCY.observe(time.perf_counter() - t0)
        return self._scoring.parse(reply)

    def close(self) -> None:
        self.client.close()


class AsyncPrefixReader:
    """The asyncio twin of PrefixReader (same arguments)."""

    def __init__(self, redis_url: str | None = None, *, model_id: str, block_size: int, dtype: str,
                 adapter: str = "", max_blocks: int = MAX_BLOCKS, client: redis.asyncio.Redis | None = None,
                 username: str | None = None, password: str | None = None) -> None:
        self._scoring = _Scoring(model_id, block_size, dtype, adapter, max_blocks)
        self.client = client or make_async_client(redis_url, username=username, password=password)

    async def score(self, token_ids: Sequence[int], cache_salt: str = "",
                    executor_ids: Iterable[str] = ()) -> dict[str, int]:
        t0 = time.perf_counter()
        args = self._scoring.args(token_ids, cache_salt, executor_ids)
        try:
            reply = await self.client.execute_command("EVALSHA", *args)
        except NoScriptError:
            await self.client.script_load(SCORE_SCRIPT.source)
            reply = await self.client.execute_command("EVALSHA", *args)
        m.SCORE_LOOKUPS.inc()
        m.SCORE_LATENCY.observe(time.perf_counter() - t0)
        return self._scoring.parse(reply)

    async def aclose(self) -> None:
        await self.client.aclose()
