"""Prefix retention: a request's retention_s pins its prompt's full blocks
when it ends; pinned blocks are evicted after every unpinned one, until the
pin expires; pins are budgeted per tenant and show in the accounting."""

from __future__ import annotations

from memory_service.events import EventQueue
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.policy import TenantQuota, ThresholdModePolicy
from memory_service.records import NewSeq, StepInput
from memory_service.retention import PinBudget

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(budget=4):
    clock = Clock()
    m = MemoryManager(mode_policy=ThresholdModePolicy(10**6), events=EventQueue(enabled=False),
                      retention=PinBudget(TenantQuota(budget), clock))
    m.register_executor(ExecutorSpec("e0", 8, BS, model_id="m", dtype="float32"))
    return m, clock


def run(m, seq_id, tokens, retention_s=0.0, tenant="a", free=True):
    m.step(StepInput(new_seqs=[NewSeq(seq_id, "e0", list(tokens), tenant=tenant, retention_s=retention_s)],
                     schedule_seq_ids=[seq_id], schedule_num_tokens=[len(tokens)]))
    hit = m.seqs[seq_id].num_cached_tokens
    if free:
        m.step(StepInput(free_seq_ids=[seq_id]))
    return hit


def test_retained_prompt_blocks_are_evicted_last_and_hit_later():
    m, clock = setup()
    kv = m.executors["e0"]
    run(m, 1, range(9), retention_s=10)       # blocks 0, 1 full (pinned), 2 partial
    pinned = [b.block_id for b in kv.pool.blocks if b.retain_until]
    assert len(pinned) == 2 and m.accounting()[1][0].pinned_blocks == 2
    run(m, 2, range(50, 59))                   # unpinned, cached
    order = kv.pool.free_queue.block_ids()
    assert order[-2:] == sorted(pinned, key=order.index) and set(order[-2:]) == set(pinned)  # pins go last
    run(m, 3, range(100, 124), free=False)     # takes 6 of 8 blocks: every unpinned one, no pinned one
    assert {b.block_id for b in m.seqs[3].blocks}.isdisjoint(pinned)
    m.step(StepInput(free_seq_ids=[3]))
    assert run(m, 4, range(9)) == 8            # the retained prefix is still there
    assert m.check_invariants() == []


def test_an_expired_pin_is_an_ordinary_cached_block():
    m, clock = setup()
    kv = m.executors["e0"]
    run(m, 1, range(9), retention_s=10)
    clock.now += 11
    assert m.accounting()[1][0].pinned_blocks == 0
    assert run(m, 2, range(9)) == 8            # hit, and freed again: now unpinned (tier 0)
    run(m, 3, range(100, 132), free=False)     # all 8 blocks: the old prefix is evicted
    assert all(b.retain_until == 0.0 for b in kv.pool.blocks)  # eviction drops a pin with the content


def test_pins_are_budgeted_per_tenant():
    m, clock = setup(budget=3)
    run(m, 1, range(13), retention_s=10, tenant="a")          # 3 full blocks: the budget
    run(m, 2, range(200, 213), retention_s=10, tenant="a")    # a's budget is spent: none more
    run(m, 3, range(300, 309), retention_s=10, tenant="b")    # b has its own
    acct = m.accounting()[1][0]
    assert acct.pinned_blocks == 3 + 2
    pins = m.retention.pinned("e0", "a")
    assert sorted(b.block_hash is not None for b in pins) == [True] * 3
    # a pin renewed by a later request of the same tenant is extended, not double counted
    clock.now += 5
    run(m, 4, range(13), retention_s=10, tenant="a")
    assert len(m.retention.pinned("e0", "a")) == 3
    assert min(b.retain_until for b in m.retention.pinned("e0", "a")) == clock.now + 10


def test_without_a_budget_nothing_is_pinned():
    m = MemoryManager(events=EventQueue(enabled=False))
    m.register_executor(ExecutorSpec("e0", 8, BS, model_id="m", dtype="float32"))
    run(m, 1, range(9), retention_s=10)
    assert m.accounting()[1][0].pinned_blocks == 0
    assert all(b.retain_until == 0.0 for b in m.executors["e0"].pool.blocks)
