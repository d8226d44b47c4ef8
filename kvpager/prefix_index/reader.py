"""Reading the mirror: prefix scoring for routers, and the record and block
dumps a restarted memory service rebuilds from.

    reader = PrefixReader("redis://127.0.0.1:6379/0", model_id="m", block_size=16, dtype="float16")
    reader.score(token_ids)            # {"e0": 12, "e1": 0}: leading full blocks each live executor holds

The chained block hashes are computed here (kvpager.prefix_index.hashing: the
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
from binascii import unhexlify

from redis.exceptions import NoScriptError

from kvpager.prefix_index import metrics as m
from kvpager.prefix_index.client import make_async_client, make_client
from kvpager.prefix_index.keys import NAMESPACES_KEY, Namespace, prefix_of_tag
from kvpager.prefix_index.ops import unpack_tokens
from kvpager.prefix_index.scripts import DUMP_SCRIPT, SCORE_SCRIPT
from kvpager.prefix_index.hashing import HASH_VERSION, hash_blocks, namespace_digest, root_hash

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

    @property
    def namespace(self) -> bytes:
        """The namespace digest chains of this reader start from (before the cache salt)."""
        return self._namespace_root

    def args(self, token_ids: Sequence[int] | None, cache_salt: str, executor_ids: Iterable[str],
             hashes: Sequence[bytes] | None = None) -> list:
        if hashes is None:
            hashes = hash_blocks(root_hash(self._namespace_root, cache_salt), token_ids, self.block_size,
                                 limit=self.max_blocks)
        wanted = list(executor_ids)
        return [SCORE_SCRIPT.sha, 1, self.ns.executors, self.ns.prefix, self.max_blocks, len(wanted),
                *wanted, b"".join(hashes[:self.max_blocks]).hex()]

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

    def score(self, token_ids: Sequence[int] | None, cache_salt: str = "",
              executor_ids: Iterable[str] = (), *, hashes: Sequence[bytes] | None = None) -> dict[str, int]:
        """{executor_id: consecutive leading full blocks held} for every live
        executor (or only `executor_ids`). ``hashes``: the prompt's chain in
        this reader's namespace, when the caller has it already (then token_ids
        may be None)."""
        t0 = time.perf_counter()
        args = self._scoring.args(token_ids, cache_salt, executor_ids, hashes)
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

    @property
    def namespace(self) -> bytes:
        return self._scoring.namespace

    @property
    def block_size(self) -> int:
        return self._scoring.block_size

    async def score(self, token_ids: Sequence[int] | None, cache_salt: str = "",
                    executor_ids: Iterable[str] = (), *, hashes: Sequence[bytes] | None = None) -> dict[str, int]:
        t0 = time.perf_counter()
        args = self._scoring.args(token_ids, cache_salt, executor_ids, hashes)
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


# ---- dumps for restart recovery ------------------------------------------------------------------

_NO_PARENT = b"-" * 64


async def executor_records(client: redis.asyncio.Redis) -> list[tuple[Namespace, str, dict[str, str]]]:
    """(namespace, executor id, record fields) of every executor record of
    every namespace of this hash version (found through kvp:namespaces, never a key scan)."""
    out = []
    for raw_tag in sorted(await client.smembers(NAMESPACES_KEY)):
        tag = raw_tag.decode()
        prefix = prefix_of_tag(tag)
        meta = {k.decode(): v.decode() for k, v in (await client.hgetall(prefix + "meta")).items()}
        if int(meta.get("hash_version", -1)) != HASH_VERSION or "model_id" not in meta:
            continue  # another hash version's namespace: not ours to read or clean
        ns = Namespace(meta["model_id"], int(meta["block_size"]))
        if ns.tag != tag:
            continue
        ids = sorted(e.decode() for e in await client.smembers(ns.executors))
        pipe = client.pipeline(transaction=False)
        for eid in ids:
            pipe.hgetall(ns.executor(eid))
        for eid, rec in zip(ids, await pipe.execute()):
            out.append((ns, eid, {k.decode(): v.decode(errors="replace") for k, v in rec.items()}))
    return out


async def executor_blocks(client: redis.asyncio.Redis, ns: Namespace, executor_id: str, incarnation: int,
                          page: int = 4096) -> list[tuple]:
    """(depth, hash, block_id, token_ids, parent) of every device block the
    executor's reverse index lists with its owner field: one DUMP call per page."""
    out = []
    start = 0
    while True:
        args = (1, ns.executors, ns.prefix, executor_id, str(incarnation), start, start + page - 1)
        try:
            seen, blob = await client.evalsha(DUMP_SCRIPT.sha, *args)
        except NoScriptError:
            await client.script_load(DUMP_SCRIPT.source)
            seen, blob = await client.evalsha(DUMP_SCRIPT.sha, *args)
        pos, n = 0, len(blob)
        while pos < n:  # <hash 64><parent 64><depth 8><block_id 8><n 8><tokens n>
            parent = blob[pos + 64:pos + 128]
            size = int(blob[pos + 144:pos + 152], 16)
            out.append((int(blob[pos + 128:pos + 136], 16), unhexlify(blob[pos:pos + 64]),
                        int(blob[pos + 136:pos + 144], 16), unpack_tokens(blob[pos + 152:pos + 152 + size]),
                        None if parent == _NO_PARENT else unhexlify(parent)))
            pos += 152 + size
        if int(seen) < page:
            return out
        start += page
