"""Which executor a new request goes to: the one that already holds the
longest prefix of its prompt, weighed against how busy each one is."""

from __future__ import annotations

from kvpager.errors import Unavailable
from kvpager.packed import pack_i32
from kvpager.telemetry import get_logger

log = get_logger("gateway.router")


class PrefixAwareRouter:
    """cost(e) = prompt tokens e would have to compute + load_weight_tokens x
    sequences e is already serving; the cheapest executor wins (ties: the id)."""

    def __init__(self, engine, load_weight_tokens: float = 16.0, redis_url: str | None = None) -> None:
        self.engine = engine
        self.load_weight_tokens = load_weight_tokens
        self.redis_url = redis_url  # score from the Redis mirror instead of the memory service
        self.prefix_reader = None   # built once an executor tells the hash namespace

    async def choose(self, prompt_ids: list[int], cache_salt: str) -> str:
        alive = sorted(eid for eid, ex in self.engine.executors.items() if ex.alive)
        if not alive:
            raise Unavailable("no executor is serving", retry_after_s=1.0)
        if len(alive) == 1:
            return alive[0]
        hits = await self._hits(prompt_ids, cache_salt)

        def cost(eid: str) -> tuple[float, str]:
            return (len(prompt_ids) - hits.get(eid, 0) + self.load_weight_tokens * self.engine.load(eid), eid)

        return min(alive, key=cost)

    async def _hits(self, prompt_ids: list[int], cache_salt: str) -> dict[str, int]:
        try:
            if self.redis_url:
                if self.prefix_reader is None:
                    from memory_service.mirror.reader import AsyncPrefixReader

                    pool = next(ex.pool for ex in self.engine.executors.values() if ex.alive)
                    self.prefix_reader = AsyncPrefixReader(self.redis_url, model_id=pool.model_id,
                                                           block_size=pool.block_size, dtype=pool.dtype,
                                                           adapter=pool.adapter)
                blocks = await self.prefix_reader.score(prompt_ids, cache_salt)
                bs = {eid: ex.block_size for eid, ex in self.engine.executors.items()}
                return {eid: n * bs.get(eid, 0) for eid, n in blocks.items()}
            scores = await self.engine.memory.score_prefix(pack_i32(prompt_ids), cache_salt)
            return {s.executor_id: s.hit_tokens for s in scores}
        except Exception as exc:  # scoring is an optimisation (Redis may be down): fall back to load
            log.warning("prefix scoring failed", error=str(exc))
            return {}
