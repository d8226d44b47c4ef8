"""Step fencing of restart recovery (docs/mirror.md): the executor record's
`last_step_id` names the last Step with rows for that executor whose events
are all in Redis; recovery restores everything when ConfirmPool's last
applied step equals it, everything but the blocks written since when the
executor applied more and can list them, nothing otherwise. Real
redis-server, in-process memory state."""

from __future__ import annotations

import pytest
from mirror_helpers import Stepper, make_state, spec, start_writer, sync_client

from memory_service.mirror.records import namespace_of
from memory_service.mirror.recovery import ConfirmAnswer, recover, without_written
from memory_service.records import StepInput

PROMPT = list(range(1, 14))  # 3 full blocks of 4 (+1)
ADDRESS = "127.0.0.1:1"      # recovery needs an address; the confirm stand-in never dials it


def recorded_step(url: str, executor_id: str = "e0") -> int | None:
    raw = sync_client(url).hget(namespace_of(spec(executor_id)).executor(executor_id), "last_step_id")
    return None if raw is None else int(raw)


def answering(last_step_id):
    calls = []

    async def confirm(address, incarnation, pool_generation, timeout_s, written_since_step=0):
        calls.append((address, incarnation, pool_generation, written_since_step))
        return last_step_id

    confirm.calls = calls
    return confirm


async def _recover(url: str, confirm, catch_up_s: float = 0.2):
    state = make_state()
    writer = await start_writer(state, url)
    report = await recover(state, writer, confirm=confirm, catch_up_s=catch_up_s)
    await writer.sync()
    return state, writer, report


async def test_record_follows_the_steps_that_gave_the_executor_rows(redis_proc):
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    state.register_executor(spec("e0", address=ADDRESS, num_blocks=32))
    state.register_executor(spec("e1", address=ADDRESS, num_blocks=32))
    steps = Stepper(state)
    await writer.sync()
    assert recorded_step(redis_proc.url) in (None, 0)

    seq = steps.prefill("e0", PROMPT)                       # step 1: rows on e0
    await writer.sync()
    assert (recorded_step(redis_proc.url), recorded_step(redis_proc.url, "e1")) == (1, 0)

    steps.prefill("e1", PROMPT)                             # step 2: rows on e1 only
    await writer.sync()
    assert (recorded_step(redis_proc.url), recorded_step(redis_proc.url, "e1")) == (1, 2)

    # step 3: a decode of one token on e0 fills no block (no event), but the gateway executes it
    emitted = state.manager.events.num_emitted
    state.step(StepInput(3, appended_seq_ids=[seq], appended_offsets=[0, 1], appended_tokens=[7],
                         schedule_seq_ids=[seq], schedule_num_tokens=[1]))
    assert state.manager.events.num_emitted == emitted
    await writer.sync()
    assert recorded_step(redis_proc.url) == 3

    state.step(StepInput(4, free_seq_ids=[seq]))          # no rows: nothing executed, the record keeps 3
    await writer.sync()
    assert recorded_step(redis_proc.url) == 3
    await writer.stop()
    state.close()


async def test_a_burst_carries_the_step_id_on_its_last_chunk_only(redis_proc):
    state = make_state()
    writer = await start_writer(state, redis_proc.url, chunk_blocks=2)
    state.register_executor(spec("e0", address=ADDRESS, num_blocks=64, max_model_len=200))
    await writer.sync()
    sent = []
    real_send = writer._send

    async def spy(calls):
        for c in calls:
            a = c.argv
            sent.extend(a[j + 6] for j in range(len(a) - 6) if a[j] == "B" and a[j + 1] == "e0")
        return await real_send(calls)

    writer._send = spy
    Stepper(state).prefill("e0", list(range(100, 141)))  # 10 full blocks: 5 batches of 2
    await writer.sync()
    assert len(sent) == 5 and sent[:-1] == [""] * 4 and sent[-1] == "1"
    assert recorded_step(redis_proc.url) == 1
    await writer.stop()
    state.close()


@pytest.mark.parametrize("applied, restored", [
    (3, True),    # the executor applied exactly what was published
    (5, False),   # it executed step 5, whose events never reached Redis, and cannot list what it wrote
    (ConfirmAnswer(5, None), False),  # the same, said explicitly (its log no longer reaches step 3)
    (ConfirmAnswer(5, frozenset()), True),  # it executed step 5, which wrote none of the cached blocks
    (1, False),   # the mirror holds step 3, which the executor never applied
    (None, False),
])
async def test_recovery_restores_only_when_the_executor_applied_what_was_published(redis_proc, applied,
                                                                                     restored):
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    state.register_executor(spec("e0", address=ADDRESS, num_blocks=32))
    steps = Stepper(state)
    steps.free(steps.prefill("e0", PROMPT))               # steps 1 (rows) and 2 (a free: no rows)
    steps.free(steps.prefill("e0", [9] * 9))             # steps 3 (rows) and 4
    await writer.sync()
    assert recorded_step(redis_proc.url) == 3
    # Step 5 is planned (and, say, executed), then the memory service dies before its flush.
    steps.prefill("e0", [5] * 13)
    await writer.abort()
    assert recorded_step(redis_proc.url) == 3
    state.close()

    confirm = answering(applied)
    state2, writer2, report = await _recover(redis_proc.url, confirm)
    try:
        assert confirm.calls[0][3] == 3  # asked for the writes since step 3
        # an executor behind the mirror is asked again until catch_up_s (it may still be running the step)
        assert (len(confirm.calls) > 1) == (applied == 1)
        if restored:
            assert report.restored == {"e0": 5} and not report.dropped and not report.fenced
            # the rewritten record stands for the executor's step
            assert recorded_step(redis_proc.url) == (applied if isinstance(applied, int) else applied.applied)
        else:
            assert report.restored == {} and "e0" in report.dropped
            assert ("step fence" in report.dropped["e0"]) == (applied is not None)
            assert "e0" not in state2.manager.executors
            assert sync_client(redis_proc.url).exists(namespace_of(spec()).executor("e0")) == 0
    finally:
        await writer2.stop()
        state2.close()


async def test_an_idle_executor_recovers_across_two_restarts(redis_proc):
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    state.register_executor(spec("e0", address=ADDRESS, num_blocks=32))
    steps = Stepper(state)
    steps.step_id = 40
    steps.free(steps.prefill("e0", PROMPT))               # step 41 has rows
    await writer.stop()                                    # a clean stop: everything flushed
    state.close()
    for _ in range(2):  # the first recovery must keep last_step_id for the second one
        state, writer, report = await _recover(redis_proc.url, answering(41))
        assert report.restored == {"e0": 3}, report
        assert recorded_step(redis_proc.url) == 41
        await writer.abort()
        state.close()
    # An executor that never stepped (step 0 on both sides; a bare True is step 0) recovers too.
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    state.register_executor(spec("e1", incarnation=7, address=ADDRESS, num_blocks=32))
    await writer.stop()
    state.close()
    state, writer, report = await _recover(redis_proc.url, answering(True))
    assert "e1" in report.restored and "e0" in report.dropped  # e0's 41 != 0
    await writer.stop()
    state.close()


async def test_blocks_written_after_the_mirror_are_left_out_with_their_descendants(redis_proc):
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    state.register_executor(spec("e0", address=ADDRESS, num_blocks=32))
    steps = Stepper(state)
    a = steps.prefill("e0", PROMPT)                        # step 1: 3 full blocks (a chain)
    a_blocks = list(state.manager.seqs[a].block_ids)
    b = steps.prefill("e0", [9] * 9)                       # step 2: 2 full blocks
    b_blocks = list(state.manager.seqs[b].block_ids)
    steps.free(a, b)                                       # step 3
    await writer.sync()
    assert recorded_step(redis_proc.url) == 2
    await writer.abort()
    state.close()
    # Steps 3..6 ran on the executor but never reached Redis; one of them overwrote
    # PROMPT's second block (and an unrelated free block 31).
    from memory_service.mirror import metrics as mirror_metrics

    left_out = mirror_metrics.FENCED_BLOCKS._value.get()
    confirm = answering(ConfirmAnswer(6, frozenset({a_blocks[1], 31})))
    state2, writer2, report = await _recover(redis_proc.url, confirm)
    try:
        assert report.restored == {"e0": 3} and report.fenced == {"e0": 2} and not report.dropped
        assert mirror_metrics.FENCED_BLOCKS._value.get() == left_out + 2
        pool = state2.manager.executors["e0"].pool
        cached_ids = {blk.block_id for blk in pool.cached.values()}
        assert cached_ids == {a_blocks[0], *b_blocks[:2]}  # PROMPT's block 2 hangs off the overwritten one
        assert recorded_step(redis_proc.url) == 6
        # a prompt sharing PROMPT's first block hits it, and only it
        again = Stepper(state2)
        again.step_id, again.seq_id = 6, 10
        seq = again.prefill("e0", PROMPT)
        assert state2.manager.seqs[seq].block_ids[0] == a_blocks[0]
        assert state2.manager.executors["e0"].counters.prefix_hit_tokens == 4
    finally:
        await writer2.stop()
        state2.close()


def test_without_written_drops_chains_through_written_blocks():
    h = [bytes([i]) * 32 for i in range(6)]
    entries = [(0, h[0], 10, (), None), (1, h[1], 11, (), h[0]), (2, h[2], 12, (), h[1]),
               (0, h[3], 13, (), None), (1, h[4], 14, (), h[3]), (0, h[5], 15, (), None)]
    kept, gone = without_written(entries, frozenset({11, 15}))
    assert sorted(e[2] for e in kept) == [10, 13, 14] and gone == 3
    assert without_written(entries, frozenset()) == (sorted(entries, key=lambda e: e[0]), 0)


async def test_recovery_waits_for_an_executor_still_running_the_published_step(redis_proc):
    """Steps planned ahead: the mirror holds step 3 while the executor is still
    running step 2 with step 3 queued behind it; once it has applied step 3
    the pool is rebuilt whole."""
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    state.register_executor(spec("e0", address=ADDRESS, num_blocks=32))
    steps = Stepper(state)
    steps.free(steps.prefill("e0", PROMPT))
    steps.free(steps.prefill("e0", [9] * 9))
    await writer.sync()
    assert recorded_step(redis_proc.url) == 3
    await writer.abort()
    state.close()

    answers = iter([1, 2, 2])
    calls = []

    async def confirm(address, incarnation, pool_generation, timeout_s, written_since_step=0):
        calls.append(written_since_step)
        return next(answers, 3)

    state2, writer2, report = await _recover(redis_proc.url, confirm, catch_up_s=5.0)
    try:
        assert len(calls) == 4
        assert report.restored == {"e0": 5} and not report.dropped
        assert recorded_step(redis_proc.url) == 3
    finally:
        await writer2.stop()
        state2.close()


async def test_two_tenants_with_the_same_prompt_never_share_a_block_even_after_a_restart(redis_proc):
    """The tenant namespaces the prefix hash, so it namespaces every tier: the
    device cache, the mirror's keys, and what a restarted service rebuilds."""
    from gateway.tenants import Tenants

    tenants = Tenants({"token-of-a-1": "a", "token-of-b-1": "b"})
    (_, salt_a), (_, salt_b) = (tenants.identify(f"Bearer token-of-{t}-1", "") for t in "ab")
    # b names a's whole namespace as its cache_salt: it can only narrow its own
    _, crossing = tenants.identify("Bearer token-of-b-1", salt_a)
    state = make_state()
    writer = await start_writer(state, redis_proc.url)
    state.register_executor(spec("e0", address=ADDRESS, num_blocks=32))
    steps = Stepper(state)
    steps.free(steps.prefill("e0", PROMPT, cache_salt=salt_a))
    kv = state.manager.executors["e0"]
    assert kv.counters.prefix_hit_tokens == 0
    for salt in (salt_b, crossing):
        steps.free(steps.prefill("e0", PROMPT, cache_salt=salt))
    assert kv.counters.prefix_hit_tokens == 0  # same prompt, other tenant: no hit
    a_hashes = set(kv.pool.cached)
    await writer.stop()
    state.close()
    keys = {k.decode() for k in sync_client(redis_proc.url).keys("*")}
    # every tenant's blocks are their own records in the mirror: 3 chains of 3 blocks
    assert sum(1 for k in keys if any(h.hex() in k for h in a_hashes)) == 9
    state2, writer2, report = await _recover(redis_proc.url, answering(recorded_step(redis_proc.url)))
    try:
        assert report.restored == {"e0": 9}, report
        again = Stepper(state2)
        again.step_id, again.seq_id = steps.step_id, 100
        kv2 = state2.manager.executors["e0"]
        hits = []
        for salt in (salt_b, salt_a, crossing, ""):
            before = kv2.counters.prefix_hit_tokens
            again.free(again.prefill("e0", PROMPT, cache_salt=salt))
            hits.append(kv2.counters.prefix_hit_tokens - before)
        assert hits == [12, 12, 12, 0]  # each tenant hits its own rebuilt blocks; the bare salt none
    finally:
        await writer2.stop()
        state2.close()
