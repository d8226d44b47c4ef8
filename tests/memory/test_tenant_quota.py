"""Per-tenant quotas: a tenant at its quota waits or preempts its own
sequences, never another tenant's; a request that can never fit its quota
is refused (OVER_QUOTA -> RESOURCE_EXHAUSTED at the gateway)."""

from __future__ import annotations

import pytest

from memory_service.events import EventQueue
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.planner import tenant_blocks
from memory_service.policy import PreemptionMode, TenantQuota, ThresholdModePolicy
from memory_service.records import NewSeq, RejectionReason, StepInput

BS = 4


def manager(num_blocks=16, quota=0.5) -> MemoryManager:
    m = MemoryManager(mode_policy=ThresholdModePolicy(10**6), events=EventQueue(enabled=False),
                      quota=TenantQuota(quota))
    m.register_executor(ExecutorSpec("e0", num_blocks, BS, model_id="m", dtype="float32"))
    return m


def new(seq_id, tenant, n=12, salt="", max_total=0, priority=0):
    return NewSeq(seq_id, "e0", [seq_id * 100 + i for i in range(n)], priority=priority, cache_salt=salt,
                  tenant=tenant, max_total_tokens=max_total)


def held(m, tenant) -> int:
    return len(tenant_blocks(m.executors["e0"], m.seqs, tenant))


def test_quota_cap_fraction_or_count():
    assert TenantQuota(0.5).cap(16) == 8 and TenantQuota(0.01).cap(16) == 1
    assert TenantQuota(5).cap(16) == 5 and TenantQuota(100).cap(16) == 16
    with pytest.raises(ValueError):
        TenantQuota(0)


def test_a_flooding_tenant_waits_at_its_quota_and_others_overtake_it():
    m = manager()  # cap: 8 of 16 blocks per tenant
    a = [new(i, "A") for i in (1, 2, 3, 4)]   # 3 blocks each
    out = m.step(StepInput(new_seqs=[*a, new(5, "B")], schedule_seq_ids=[1, 2, 3, 4, 5],
                           schedule_num_tokens=[12] * 5))
    # A gets two (6 blocks; a third would be 9 > 8); B, behind A's waiting ones, is admitted all the same
    assert out.unscheduled == [3, 4] and not out.preempted
    assert (held(m, "A"), held(m, "B")) == (6, 3)
    assert m.check_invariants() == []


def test_a_tenant_at_its_quota_preempts_its_own_never_another():
    m = manager()
    m.step(StepInput(new_seqs=[new(1, "A"), new(2, "A"), new(3, "B", priority=9)], schedule_seq_ids=[1, 2, 3],
                     schedule_num_tokens=[12, 12, 12]))
    assert (held(m, "A"), held(m, "B")) == (6, 3)
    # A's sequences grow into their fourth blocks: 8 fit A's quota, then A must give up one of its own —
    # B's (less important!) sequence is not touched though the pool has 7 blocks free
    for step in range(2):
        for s in (1, 2, 3):
            m.seqs[s].token_ids.append(7)
        out = m.step(StepInput(schedule_seq_ids=[1, 2, 3], schedule_num_tokens=[1, 1, 1]))
    assert not out.preempted
    for s in (1, 2, 3):
        m.seqs[s].token_ids.extend([7] * 3)
    out = m.step(StepInput(schedule_seq_ids=[1, 2, 3], schedule_num_tokens=[4, 4, 4]))
    assert out.preempted == [(2, PreemptionMode.RECOMPUTE)] and out.unscheduled == [2]
    assert held(m, "A") <= 8 and held(m, "B") == 5 and m.seqs[3].status.value == "running"
    assert m.check_invariants() == []


def test_a_request_that_can_never_fit_its_quota_is_refused():
    m = manager()
    out = m.step(StepInput(new_seqs=[new(1, "A", n=12, max_total=40)], schedule_seq_ids=[1],
                           schedule_num_tokens=[12]))
    (r,) = out.rejected
    assert r.reason is RejectionReason.OVER_QUOTA and "tenant quota" in r.message
    assert 1 not in m.seqs and m.executors["e0"].pool.num_free == 16
