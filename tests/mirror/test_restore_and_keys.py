"""Pure pieces of the mirror (no Redis): BlockPool.restore_cached exactly,
the key schema's single slot, op encoding, credentials redaction."""

from __future__ import annotations

from redis.crc import key_slot

from memory_service.block_pool import BlockPool
from memory_service.events import BlockStored, EventQueue
from kvpager.prefix_index.ops import pack_tokens, unpack_tokens
from memory_service.mirror.records import op_of
from kvpager.prefix_index.keys import Namespace, redact, redis_kwargs
from kvpager.prefix_index.hashing import hash_block


def test_restore_cached_rebuilds_evictable_blocks_after_plain_free_ones():
    events = EventQueue(enabled=True)
    pool = BlockPool("e0", 6, 2, events)
    h1 = hash_block(b"root", [1, 2])
    h2 = hash_block(h1, [3, 4])
    # deepest first: it goes nearer the head, so it is evicted before its prefix
    assert pool.restore_cached(h2, 4, (3, 4), h1, 1)
    assert pool.restore_cached(h1, 1, (1, 2), None, 0)
    assert pool.free_queue.block_ids() == [0, 2, 3, 5, 4, 1]
    assert pool.num_free == 6 and pool.num_cached_free == 2
    assert pool.lookup(h1, [1, 2]) is pool.blocks[1] and pool.lookup(h1, [9, 9]) is None
    assert [type(e) for e in events.drain()] == [BlockStored, BlockStored]

    # refused, and nothing changes: hash already indexed, block cached, bad id, wrong size, block in use
    h3 = hash_block(h2, [5, 6])
    assert not pool.restore_cached(h1, 0, (1, 2))
    assert not pool.restore_cached(h3, 1, (5, 6))
    assert not pool.restore_cached(h3, 6, (5, 6))
    assert not pool.restore_cached(h3, 0, (5, 6, 7))
    (used,) = pool.allocate(1)
    assert used.block_id == 0
    assert not pool.restore_cached(h3, 0, (5, 6))
    assert len(events) == 0 and pool.num_cached_free == 2

    # plain free blocks are taken before restored ones; then LRU order evicts the deeper one first
    taken = [b.block_id for b in pool.allocate(3)]
    assert taken == [2, 3, 5]
    (evicted,) = pool.allocate(1)
    assert evicted.block_id == 4 and h2 not in pool.cached and h1 in pool.cached


def test_every_key_of_a_namespace_is_in_one_cluster_slot():
    ns = Namespace("meta-llama/Llama-3-8B", 16)
    keys = [ns.meta, ns.executors, ns.executor("e0"), ns.executor("other:exec"), ns.index("e0", 2**62 + 5),
            ns.block("ab" * 32), ns.prefix + "gc", ns.prefix + "gc:17"]
    assert len({key_slot(k.encode()) for k in keys}) == 1
    assert ns.tag != Namespace("meta-llama/Llama-3-8B", 32).tag != Namespace("other", 16).tag
    assert ns.prefix == f"kvp:{{{ns.tag}}}:" and len(ns.tag) == 16


def test_stored_op_encoding_and_tokens_roundtrip():
    tokens = (0, 1, 2**32 - 1, 7)
    assert unpack_tokens(pack_tokens(tokens)) == tokens
    root = op_of(BlockStored("e0", b"\x01" * 32, None, 3, 0, tokens))
    assert root.startswith(b"F" + b"01" * 32 + b"00000000" + b"00000003" + b"d" + b"00000010")
    child = op_of(BlockStored("e0", b"\x02" * 32, b"\x01" * 32, 300, 1, tokens, "cpu"))
    assert child[:129] == b"S" + b"02" * 32 + b"01" * 32
    assert child[129:154] == b"00000001" + b"0000012c" + b"c" + b"00000010"
    assert child[154:] == pack_tokens(tokens)


def test_credentials_redaction_and_env(monkeypatch):
    assert redact("redis://alice:pw@h:6379/0") == "redis://alice:***@h:6379/0"
    assert redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    monkeypatch.delenv("KVPAGER_REDIS_USERNAME", raising=False)
    monkeypatch.delenv("KVPAGER_REDIS_PASSWORD", raising=False)
    assert redis_kwargs() == {}
    monkeypatch.setenv("KVPAGER_REDIS_USERNAME", "bob")
    monkeypatch.setenv("KVPAGER_REDIS_PASSWORD", "secret")
    assert redis_kwargs() == {"username": "bob", "password": "secret"}
    assert redis_kwargs("carol", "pw2") == {"username": "carol", "password": "pw2"}
