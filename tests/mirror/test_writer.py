"""The mirror writer against a real redis-server: contents equal the
in-process index after random operation sequences, batch fencing (repeat =
no-op, gap = resync, stale incarnation rejected), incarnation fencing,
lease expiry, and the reader agreeing with the in-process scores."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mirror_helpers import BS, Stepper, make_state, mirror_problems, spec, start_writer, sync_client

from kvpager.errors import KvpagerError
from memory_service.events import BlockStored
from kvpager.prefix_index.reader import AsyncPrefixReader, PrefixReader
from kvpager.prefix_index.scripts import APPLY_SCRIPT
from kvpager.prefix_index.ops import ScriptCall
from memory_service.mirror.records import namespace_of, op_of
from memory_service.records import NewSeq, StepInput
from kvpager.seq_status import SeqStatus

BASES = [list(range(10, 40)), list(range(50, 80)), [7] * 30]
OPS = ["new", "new", "schedule", "schedule", "decode", "free", "fork", "reincarnate", "yield"]


async def _random_run(url: str, data) -> None:
    sync_client(url).flushall()
    state = make_state()
    # Tiny chunks and gc steps so resync chunking and cleanup are exercised too.
    writer = await start_writer(state, url, chunk_blocks=3, gc_cap=2)
    try:
        incarnations = {"e0": 1, "e1": 1}
        for eid in incarnations:
            state.register_executor(spec(eid, num_blocks=10, max_model_len=32))
        step_id = 0
        next_seq = 0
        for _ in range(data.draw(st.integers(5, 30), label="num_ops")):
            op = data.draw(st.sampled_from(OPS), label="op")
            seqs = state.manager.seqs
            step = None
            if op == "new":
                base = data.draw(st.sampled_from(BASES), label="base")
                tokens = base[:data.draw(st.integers(2, 22), label="prefix_len")]
                tokens += data.draw(st.lists(st.integers(0, 9), max_size=4), label="suffix")
                next_seq += 1
                eid = data.draw(st.sampled_from(sorted(incarnations)), label="executor")
                step = StepInput(new_seqs=[NewSeq(next_seq, eid, tokens)], schedule_seq_ids=[next_seq],
                                 schedule_num_tokens=[len(tokens)])
            elif op == "schedule":
                ready = [s for s in seqs.values() if s.num_tokens > s.num_computed]
                if ready:
                    s = data.draw(st.sampled_from(ready), label="seq")
                    step = StepInput(schedule_seq_ids=[s.seq_id], schedule_num_tokens=[s.num_tokens])
            elif op == "decode":
                ready = [s for s in seqs.values() if s.status is SeqStatus.RUNNING
                         and s.num_computed == s.num_tokens and s.num_tokens < 31]
                if ready:
                    s = data.draw(st.sampled_from(ready), label="seq")
                    tok = data.draw(st.integers(0, 9), label="token")
                    step = StepInput(appended_seq_ids=[s.seq_id], appended_offsets=[0, 1], appended_tokens=[tok],
                                     schedule_seq_ids=[s.seq_id], schedule_num_tokens=[1])
            elif op == "free" and seqs:
                s = data.draw(st.sampled_from(sorted(seqs)), label="seq")
                step = StepInput(free_seq_ids=[s])
            elif op == "fork":
                parents = [s for s in seqs.values() if s.status is not SeqStatus.SWAPPED]
                if parents:
                    p = data.draw(st.sampled_from(parents), label="parent")
                    next_seq += 1
                    step = StepInput(forks=[(p.seq_id, [next_seq])])
            elif op == "reincarnate":
                eid = data.draw(st.sampled_from(sorted(incarnations)), label="executor")
                incarnations[eid] += 1
                state.register_executor(spec(eid, incarnations[eid], num_blocks=10, max_model_len=32))
            elif op == "yield":
                await asyncio.sleep(data.draw(st.sampled_from([0, 0.001, 0.003]), label="sleep"))
            if step is not None:
                step_id += 1
                step.step_id = step_id
                try:
                    state.step(step)
                except KvpagerError:
                    pass  # refused as a whole: nothing changed
            if data.draw(st.booleans(), label="let_writer_run"):
                await asyncio.sleep(0)
        assert not state.manager.check_invariants()
        await writer.sync()
        assert mirror_problems(sync_client(url), state) == []
    finally:
        await writer.stop()
        state.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_mirror_equals_index_after_random_operations(redis_proc, data):
    asyncio.run(_random_run(redis_proc.url, data))


async def _apply(writer, call: ScriptCall) -> list:
    return await writer.client.evalsha(APPLY_SCRIPT.sha, 1, call.ns.executors, call.ns.prefix, 60_000, 60_000,
                                       100, len(call.sections), *call.argv)


def _dump(r, ns) -> dict:
    out = {}
    for key in r.scan_iter(match=ns.prefix.replace("{", "\\{").replace("}", "\\}") + "*"):
        kind = r.type(key)
        if kind == b"hash":
            out[key] = {k: v for k, v in r.hgetall(key).items() if k not in (b"heartbeat_ms", b"lease_until_ms")}
        elif kind == b"zset":
            out[key] = r.zrange(key, 0, -1, withscores=True)
        else:
            out[key] = kind
    return out


async def test_repeated_batch_is_a_noop_gap_resyncs_stale_incarnation_rejected(redis_proc):
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    r = sync_client(redis_proc.url)
    state.register_executor(spec("e0"))
    steps = Stepper(state)
    steps.prefill("e0", range(1, 14))
    await writer.sync()
    ns = namespace_of(state.manager.executors["e0"].spec)
    last = int(r.hget(ns.executor("e0"), "last_batch"))

    # the batch the writer would send next, sent twice: the second is a retry
    fake = BlockStored("e0", bytes(32), None, 15, 0, (1, 2, 3, 4))
    batch = ScriptCall(ns)
    batch.batch("e0", 1, last + 1, [op_of(fake)])
    assert (await _apply(writer, batch))[:-1] == [b"ok"]
    before = _dump(r, ns)
    assert (await _apply(writer, batch))[:-1] == [b"dup"]
    assert _dump(r, ns) == before

    # another incarnation's batch is rejected and changes nothing
    stale = ScriptCall(ns)
    stale.batch("e0", 99, last + 2, [op_of(fake)])
    assert (await _apply(writer, stale))[:-1] == [b"stale"]
    assert _dump(r, ns) == before

    # a gap is refused; the writer then resyncs the executor from memory,
    # which also removes the block we slipped in above
    writer._batch["e0"] += 5
    resyncs = writer.num_resyncs
    steps.prefill("e0", range(50, 63))
    await writer.sync()
    assert writer.num_resyncs == resyncs + 1
    assert mirror_problems(r, state) == []
    await writer.stop()
    state.close()


async def test_new_incarnation_is_fenced_at_once(redis_proc):
    state = make_state()
    # gc_cap=0: old owner fields stay in Redis; fencing alone must hide them
    writer = await start_writer(state, redis_proc.url, gc_cap=0)
    reader = PrefixReader(redis_proc.url, model_id="m", block_size=BS, dtype="float32")
    prompt = list(range(1, 14))
    state.register_executor(spec("e0", 1))
    state.register_executor(spec("e1", 1))
    steps = Stepper(state)
    steps.prefill("e0", prompt)
    steps.prefill("e1", prompt)
    for _ in range(200):
        await asyncio.sleep(0.005)
        if reader.score(prompt) == {"e0": 3, "e1": 3}:
            break
    assert reader.score(prompt) == {"e0": 3, "e1": 3}

    state.register_executor(spec("e0", 2))  # e0 restarted: its KV is gone
    for _ in range(200):
        await asyncio.sleep(0.005)
        if reader.score(prompt)["e0"] == 0:
            break
    assert reader.score(prompt) == {"e0": 0, "e1": 3}
    r = sync_client(redis_proc.url)
    ns = namespace_of(spec("e0"))
    assert r.llen(ns.prefix + "gc") == 1  # the old index is retired, not yet cleaned
    assert any(k.startswith(b"e:e0") for h in state.manager.executors["e1"].pool.cached
               for k in r.hkeys(ns.block(h.hex())))
    writer.gc_cap = 100
    await writer.sync()
    assert mirror_problems(r, state) == []
    reader.close()
    await writer.stop()
    state.close()


async def test_lease_expiry_hides_a_dead_executor(redis_proc):
    prompt = list(range(1, 14))
    state = make_state(lease_s=0.1)
    writer = await start_writer(state, redis_proc.url, lease_s=0.4)
    reader = PrefixReader(redis_proc.url, model_id="m", block_size=BS, dtype="float32")
    state.register_executor(spec("e0"))                         # embedded: no address, no heartbeats needed
    state.register_executor(spec("e1", address="127.0.0.1:1"))  # must heartbeat
    steps = Stepper(state)
    steps.prefill("e0", prompt)
    steps.prefill("e1", prompt)
    await writer.sync()
    assert reader.score(prompt) == {"e0": 3, "e1": 3}

    # e1 stops heartbeating: the writer stops renewing it and the memory
    # service's reaper drops it; e0 stays live past several leases
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:
        state.reap_expired()
        await asyncio.sleep(0.05)
    assert reader.score(prompt) == {"e0": 3}

    # the memory service dies without a word: e0's lease runs out in Redis
    await writer.abort()
    assert reader.score(prompt) == {"e0": 3}
    await asyncio.sleep(0.5)
    assert reader.score(prompt) == {}
    reader.close()
    state.close()


async def test_reader_agrees_with_the_in_process_index(redis_proc):
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    for i in range(4):
        state.register_executor(spec(f"e{i}", num_blocks=64, max_model_len=200))
    state.register_executor(spec("other", model_id="other-model", num_blocks=64, max_model_len=200))
    steps = Stepper(state)
    base = list(range(100, 164))  # 16 blocks
    for i in range(4):
        steps.prefill(f"e{i}", base[:BS * 4 * (i + 1) + 1])  # e_i holds 4(i+1) leading blocks
    steps.prefill("e1", base[:20] + [1] * 20)                   # a branch
    steps.prefill("e2", base[:30], cache_salt="tenant-a")
    steps.prefill("other", base)
    await writer.sync()

    reader = PrefixReader(redis_proc.url, model_id="m", block_size=BS, dtype="float32")
    areader = AsyncPrefixReader(redis_proc.url, model_id="m", block_size=BS, dtype="float32")
    prompts = [(base, ""), (base[:9], ""), (base[:20] + [1] * 20, ""), (base[:30], "tenant-a"),
               (base[:30], "tenant-b"), ([5] * 40, ""), (base[:3], "")]
    ids = [f"e{i}" for i in range(4)]
    for tokens, salt in prompts:
        expected = {s.executor_id: s.hit_blocks for s in state.score_prefix(tokens, salt, ids)}
        assert reader.score(tokens, salt) == expected, (len(tokens), salt)
        assert await areader.score(tokens, salt) == expected
        assert reader.score(tokens, salt, executor_ids=["e1", "nope"]) == {"e1": expected["e1"]}
    assert reader.score(base[:4 * BS + 2]) == {"e0": 4, "e1": 4, "e2": 4, "e3": 4}
    capped = PrefixReader(redis_proc.url, model_id="m", block_size=BS, dtype="float32", max_blocks=2)
    assert capped.score(base) == dict.fromkeys(ids, 2)
    other = PrefixReader(redis_proc.url, model_id="other-model", block_size=BS, dtype="float32")
    assert other.score(base) == {"other": 16}
    with pytest.raises(ValueError):
        PrefixReader(redis_proc.url, model_id="m", block_size=BS, dtype="float32", max_blocks=513)
    for rd in (reader, capped, other):
        rd.close()
    await areader.aclose()
    await writer.stop()
    state.close()
