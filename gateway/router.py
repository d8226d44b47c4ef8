"""Which executor a new request goes to: the one that already holds the
longest prefix of its prompt, weighed against how busy each one is.

Prompts are scored by their block-hash chain (``kvpager.prefix_index``: the
same hashes the memory service and the Redis mirror index), computed once per
request in a ``PromptChain`` that the admission then sends along."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict

from kvpager.errors import Unavailable
from kvpager.prefix_index.hashing import PromptChain, pack_hashes
from kvpager.telemetry import get_logger

log = get_logger("gateway.router")


class RoundRobinRouter:
    """Executors in turn, ignoring prefixes and load (the baseline routing)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._next = 0

    async def choose(self, prompt_ids: list[int], cache_salt: str, deadline: float | None = None,
                     chain: PromptChain | None = None) -> str:
        alive = sorted(eid for eid, ex in self.engine.executors.items() if ex.alive)
        if not alive:
            raise Unavailable("no executor is serving", retry_after_s=1.0)
        self._next += 1
        return alive[(self._next - 1) % len(alive)]


ROUTINGS = ("prefix", "round-robin")
SCORE_TIMEOUT_S = 5.0  # longest a routing decision waits for prefix scores


def make_router(routing: str, engine, load_weight_tokens: float = 16.0, redis_url: str | None = None):
    """The router a gateway config names: "prefix" (default) or "round-robin"."""
    if routing == "round-robin":
        return RoundRobinRouter(engine)
    if routing == "prefix":
        return PrefixAwareRouter(engine, load_weight_tokens, redis_url)
    raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")


class RoutedPrefixes:
    """The executors recent requests were sent to, by prompt prefix (whole
    blocks), kept for the prompts the memory service has not computed yet.

    Requests arriving together all find an empty prefix index (their
    prefixes are computed a step or more after routing), so scoring by the
    memory service alone spreads one prefix over several executors, each then
    holding and evicting a copy. Like SGLang's cache-aware router, routing
    also counts the prefixes it has already sent somewhere. A hint only: the
    memory service's hit counts win when larger. Bounded LRU keyed by the
    prompts' block hashes (the chain of the executor's namespace).
    """

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> executor id
        self.footprint: Counter[str] = Counter()  # executor id -> blocks of prompts routed there (in the LRU)

    def hits(self, hashes: list[bytes], block_size: int) -> dict[str, int]:
        """executor -> prompt tokens of the longest block prefix last routed there."""
        best: dict[str, int] = {}
        for i, key in enumerate(hashes):
            owner = self._owner.get(key)
            if owner is None:
                break
            best[owner] = (i + 1) * block_size
        return best

    def record(self, hashes: list[bytes], executor_id: str) -> None:
        owner, footprint = self._owner, self.footprint
        for key in hashes:
            old = owner.get(key)
            if old != executor_id:
                if old is not None:
                    footprint[old] -= 1
                footprint[executor_id] += 1
            owner[key] = executor_id
            owner.move_to_end(key)
        while len(owner) > self.max_entries:
            footprint[owner.popitem(last=False)[1]] -= 1


class PrefixAwareRouter:
    """Cache-aware routing in two regimes (as SGLang's router does):

    * the prompt's best cached (or already routed) prefix covers at least
      ``cache_threshold`` of it: cost(e) = prompt tokens e would compute +
      load_weight_tokens x sequences e serves; the cheapest executor wins;
    * otherwise the prompt is new everywhere, and where it lands decides which
      cache will hold it: among the executors within ``load_slack`` sequences
      of the least loaded, the one with the smallest routed footprint wins, so
      distinct prefixes spread evenly over the caches instead of piling several
      onto whichever executor was idle at the time (which then evicts them).

    Ties go to the lower executor id."""

    def __init__(self, engine, load_weight_tokens: float = 16.0, redis_url: str | None = None, *,
                 cache_threshold: float = 0.5, load_slack: int = 8) -> None:
        self.engine = engine
        self.load_weight_tokens = load_weight_tokens
        self.cache_threshold = cache_threshold
        self.load_slack = load_slack
        self.redis_url = redis_url  # score from the Redis mirror instead of the memory service
        self.prefix_reader = None   # built once an executor tells the hash namespace
        self.routed = RoutedPrefixes()

    async def choose(self, prompt_ids: list[int], cache_salt: str, deadline: float | None = None,
                     chain: PromptChain | None = None) -> str:
        """deadline: the request's, in event-loop time; scoring gives up by then
        (and after SCORE_TIMEOUT_S at most) and routes by load alone. chain:
        the request's PromptChain (made here when not given)."""
        alive = sorted(eid for eid, ex in self.engine.executors.items() if ex.alive)
        if not alive:
            raise Unavailable("no executor is serving", retry_after_s=1.0)
        if len(alive) == 1:
            return alive[0]
        chain = chain or PromptChain(prompt_ids, cache_salt)
        timeout = SCORE_TIMEOUT_S
        if deadline is not None:
            timeout = min(timeout, deadline - asyncio.get_running_loop().time())
        # The routed-prefix memory keys prompts by one namespace's chain (executors of a model share it).
        ref = self.engine.executors[alive[0]]
        keys = chain.hashes(ref.namespace, ref.block_size)
        hits = await self._hits(chain, timeout) if timeout > 0 else {}
        for eid, n in self.routed.hits(keys, ref.block_size).items():
            hits[eid] = max(hits.get(eid, 0), n)
        alive = [eid for eid in alive if self.engine.executors.get(eid) is not None
                 and self.engine.executors[eid].alive]  # one may have gone while we awaited the scores
        if not alive:
            raise Unavailable("no executor is serving", retry_after_s=1.0)
        load = {eid: self.engine.load(eid) for eid in alive}
        best_hit = max((hits.get(eid, 0) for eid in alive), default=0)
        if best_hit >= self.cache_threshold * len(prompt_ids) and best_hit > 0:
            def cost(eid: str) -> tuple[float, str]:
                return (len(prompt_ids) - hits.get(eid, 0) + self.load_weight_tokens * load[eid], eid)

            chosen = min(alive, key=cost)
        else:
            least = min(load.values())
            near = [eid for eid in alive if load[eid] <= least + self.load_slack]
            chosen = min(near, key=lambda eid: (self.routed.footprint[eid], load[eid], eid))
        if self.engine.executors[chosen].namespace == ref.namespace:
            self.routed.record(keys, chosen)
        return chosen

    async def _hits(self, chain: PromptChain, timeout_s: float) -> dict[str, int]:
        try:
            return await asyncio.wait_for(self._score(chain), timeout_s)
        except Exception as exc:  # scoring is an optimisation (Redis may be down, time short): route by load
            log.warning("prefix scoring failed", error=str(exc) or type(exc).__name__)
            return {}

    async def _score(self, chain: PromptChain) -> dict[str, int]:
        """executor -> prompt tokens it holds, scored with the chain's hashes
        (each namespace's chain computed once for this request)."""
        if self.redis_url:
            if self.prefix_reader is None:
                from kvpager.prefix_index.reader import AsyncPrefixReader

                pool = next(ex.pool for ex in self.engine.executors.values() if ex.alive)
                self.prefix_reader = AsyncPrefixReader(self.redis_url, model_id=pool.model_id,
                                                       block_size=pool.block_size, dtype=pool.dtype,
                                                       adapter=pool.adapter)
            reader = self.prefix_reader
            blocks = await reader.score(None, chain.cache_salt,
                                        hashes=chain.hashes(reader.namespace, reader.block_size))
            bs = {eid: ex.block_size for eid, ex in self.engine.executors.items()}
            return {eid: n * bs.get(eid, 0) for eid, n in blocks.items()}
        hits: dict[str, int] = {}
        by_namespace: dict[bytes, int] = {}
        for ex in self.engine.executors.values():
            if ex.alive:
                by_namespace.setdefault(ex.namespace, ex.block_size)
        for namespace, block_size in by_namespace.items():
            scores = await self.engine.memory.score_prefix_hashes(
                pack_hashes(chain.hashes(namespace, block_size)), namespace)
            for s in scores:
                hits[s.executor_id] = max(hits.get(s.executor_id, 0), s.hit_tokens)
        return hits
