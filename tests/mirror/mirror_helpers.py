"""Shared pieces of the mirror tests: a state with events on, steps, and the
comparison of Redis against every pool's prefix index."""

from __future__ import annotations

import hashlib

import redis

from memory_service.events import EventQueue
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from kvpager.prefix_index.keys import NAMESPACES_KEY, OWNER_PREFIX, prefix_of_tag
from kvpager.prefix_index.ops import pack_tokens
from memory_service.mirror.records import namespace_of
from memory_service.mirror.writer import MirrorWriter
from memory_service.records import NewSeq, StepInput
from memory_service.service_state import MemoryState

BS = 4


def spec(executor_id: str = "e0", incarnation: int = 1, *, num_blocks: int = 16, address: str = "",
         model_id: str = "m", pool_generation: int = 1, max_model_len: int = 48) -> ExecutorSpec:
    return ExecutorSpec(executor_id=executor_id, num_blocks=num_blocks, block_size=BS, num_swap_blocks=4,
                        address=address, model_id=model_id, dtype="float32", incarnation=incarnation,
                        pool_generation=pool_generation, max_model_len=max_model_len, vocab_size=1000)


def make_state(lease_s: float = 5.0) -> MemoryState:
    return MemoryState(MemoryManager(events=EventQueue(enabled=True)), lease_s=lease_s)


async def start_writer(state: MemoryState, url: str, **kw) -> MirrorWriter:
    kw.setdefault("window_s", 0.001)
    return await MirrorWriter(state, url, **kw).start()


class Stepper:
    """Step ids and sequence ids for hand-written scenarios."""

    def __init__(self, state: MemoryState) -> None:
        self.state = state
        self.step_id = 0
        self.seq_id = 0

    def prefill(self, executor_id: str, tokens, cache_salt: str = "") -> int:
        self.step_id += 1
        self.seq_id += 1
        tokens = list(tokens)
        self.state.step(StepInput(self.step_id, new_seqs=[NewSeq(self.seq_id, executor_id, tokens,
                                                                 cache_salt=cache_salt)],
                                  schedule_seq_ids=[self.seq_id], schedule_num_tokens=[len(tokens)]))
        return self.seq_id

    def free(self, *seq_ids: int) -> None:
        self.step_id += 1
        self.state.step(StepInput(self.step_id, free_seq_ids=list(seq_ids)))


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _s(b) -> str:
    return b.decode() if isinstance(b, bytes) else b


def mirror_problems(r: redis.Redis, state: MemoryState) -> list[str]:
    """Everything in which Redis differs from the in-process index (empty = equal).

    Per executor: the record's incarnation, the reverse index == pool.cached,
    each block record's owner field (incarnation:tier:block_id), tokens, depth,
    and parent chaining. Across the keyspace (a test may scan): no owner field
    outside its executor's current index, no block record without owners,
    no retired index left, the executor set == the registered executors.
    """
    bad: list[str] = []
    executors = state.manager.executors
    by_tag: dict[str, set[str]] = {}
    for eid, kv in executors.items():
        sp = kv.spec
        ns = namespace_of(sp)
        by_tag.setdefault(ns.tag, set()).add(eid)
        rec = {_s(k): _s(v) for k, v in r.hgetall(ns.executor(eid)).items()}
        if rec.get("incarnation") != str(sp.incarnation):
            bad.append(f"{eid}: record incarnation {rec.get('incarnation')} != {sp.incarnation}")
            continue
        index = {_s(h): d for h, d in r.zrange(ns.index(eid, sp.incarnation), 0, -1, withscores=True)}
        expected = {h.hex(): b for h, b in kv.pool.cached.items()}
        if set(index) != set(expected):
            bad.append(f"{eid}: index has {len(set(index) - set(expected))} extra, "
                       f"{len(set(expected) - set(index))} missing of {len(expected)}")
            continue
        for h, block in expected.items():
            rec_b = {_s(k): v for k, v in r.hgetall(ns.block(h)).items()}
            owner = _s(rec_b.get(OWNER_PREFIX + eid, b""))
            if owner != f"{sp.incarnation}:device:{block.block_id}":
                bad.append(f"{eid}: block {h[:8]} owner {owner!r} != block {block.block_id}")
            if rec_b.get("t") != pack_tokens(block.token_ids):
                bad.append(f"{eid}: block {h[:8]} tokens differ")
            if float(_s(rec_b.get("d", b"-1"))) != index[h]:
                bad.append(f"{eid}: block {h[:8]} depth {rec_b.get('d')} != index {index[h]}")
            parent = _s(rec_b.get("p", b""))
            if (index[h] == 0) != (parent == ""):
                bad.append(f"{eid}: block {h[:8]} at depth {index[h]} has parent {parent[:8]!r}")
            if parent and hashlib.sha256(bytes.fromhex(parent) + rec_b["t"]).hexdigest() != h:
                bad.append(f"{eid}: block {h[:8]} does not chain from its parent")
    tags = {_s(t) for t in r.smembers(NAMESPACES_KEY)}
    for tag in tags | set(by_tag):
        prefix = prefix_of_tag(tag)
        members = {_s(e) for e in r.smembers(prefix + "executors")}
        if members != by_tag.get(tag, set()):
            bad.append(f"namespace {tag}: executor set {sorted(members)} != {sorted(by_tag.get(tag, set()))}")
        if r.llen(prefix + "gc"):
            bad.append(f"namespace {tag}: {r.llen(prefix + 'gc')} retired indexes not cleaned")
        for key in r.scan_iter(match=prefix.replace("{", "\\{").replace("}", "\\}") + "b:*", count=1000):
            h = _s(key)[len(prefix) + 2:]
            fields = {_s(f) for f in r.hkeys(key)}
            owners = {f[len(OWNER_PREFIX):] for f in fields if f.startswith(OWNER_PREFIX)}
            if not owners:
                bad.append(f"block record {h[:8]} has no owner")
            for eid in owners:
                kv = executors.get(eid)
                if kv is None or namespace_of(kv.spec).tag != tag or h not in {
                        x.hex() for x in kv.pool.cached}:
                    bad.append(f"block record {h[:8]} still lists {eid}")
    return bad
